//! Where metadata and bytes come from: the source tree on slow shared storage.
//!
//! [`Source`] is the whole interface the mount has to the dataset: `stat`, `read_dir`,
//! `readlink` for the metadata snapshot, and `read_at` for data. Tests implement it to make
//! any operation slow, failing or changing; [`LocalSource`] is the real one.
//!
//! Every data read names the [`Version`] (size, mtime, ctime, inode) the snapshot recorded; the
//! source checks it against the *open descriptor* (`fstat`, one call, no path lookup) after
//! reading, so a file replaced or rewritten since the snapshot is reported as
//! [`SourceError::Changed`] and never served mixed or stale. The ctime is what makes this hold
//! against a user: size and mtime can be set back (`touch -r`, `utimensat`) after an in-place
//! rewrite, but every write, `utimensat` and `chmod` sets the ctime to the current time.
//!
//! [`LocalSource`] never leaves the source directory: paths are resolved beneath the root's
//! descriptor with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` (so a directory swapped for
//! a symlink after the snapshot cannot redirect a read outside SOURCE), files are opened
//! `O_NONBLOCK` (a FIFO swapped in cannot block a fetch thread) and must be regular files.
//! Opening a file on a parallel filesystem costs milliseconds, so file and directory
//! descriptors are kept in small LRUs.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use lru::LruCache;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};

use crate::error::SourceError;
use crate::fds;
use crate::locks::lock;

/// Type of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FileKind {
    /// Regular file.
    File = 0,
    /// Directory.
    Dir = 1,
    /// Symbolic link.
    Symlink = 2,
    /// Named pipe.
    Fifo = 3,
    /// Socket.
    Socket = 4,
    /// Character device.
    CharDevice = 5,
    /// Block device.
    BlockDevice = 6,
}

impl FileKind {
    /// The kind of a `st_mode`.
    pub fn from_mode(mode: u32) -> FileKind {
        match FileType::from_raw_mode(mode) {
            FileType::Directory => FileKind::Dir,
            FileType::Symlink => FileKind::Symlink,
            FileType::Fifo => FileKind::Fifo,
            FileType::Socket => FileKind::Socket,
            FileType::CharacterDevice => FileKind::CharDevice,
            FileType::BlockDevice => FileKind::BlockDevice,
            _ => FileKind::File,
        }
    }

    /// The kind stored as `byte` (see the `repr`), if valid.
    pub fn from_u8(byte: u8) -> Option<FileKind> {
        Some(match byte {
            0 => FileKind::File,
            1 => FileKind::Dir,
            2 => FileKind::Symlink,
            3 => FileKind::Fifo,
            4 => FileKind::Socket,
            5 => FileKind::CharDevice,
            6 => FileKind::BlockDevice,
            _ => return None,
        })
    }
}

/// The identity of one version of a file's contents: what every source read is checked against.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub struct Version {
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// Status change time, nanoseconds since the epoch: unlike the mtime, no user can set it
    /// back, so an in-place rewrite whose size and mtime were restored still changes it.
    pub ctime_ns: i64,
    /// Inode number on the source (a file replaced by another of the same size and mtime is
    /// still a different file).
    pub ino: u64,
}

/// Metadata of one source entry, as `lstat` reports it (symlinks are not followed). The
/// filesystem's snapshot keeps exactly these fields per node (`stagefs_fs::snapshot::NodeAttr`
/// is this type).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    /// Type.
    pub kind: FileKind,
    /// Permission bits (`mode & 0o7777`).
    pub perm: u16,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// Status change time, nanoseconds since the epoch (see [`Version::ctime_ns`]).
    pub ctime_ns: i64,
    /// Inode number on the source.
    pub ino: u64,
    /// Hard links.
    pub nlink: u32,
    /// Device number, for device nodes (0 otherwise).
    pub rdev: u64,
}

impl Version {
    /// The version of a file's `std` metadata.
    pub fn of(meta: &std::fs::Metadata) -> Version {
        use std::os::unix::fs::MetadataExt;
        Version {
            size: meta.size(),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
            ino: meta.ino(),
        }
    }
}

impl Meta {
    /// The identity of the contents this metadata describes.
    pub fn version(&self) -> Version {
        Version {
            size: self.size,
            mtime_ns: self.mtime_ns,
            ctime_ns: self.ctime_ns,
            ino: self.ino,
        }
    }

    /// Metadata of a `stat` result.
    pub fn of_stat(st: &rustix::fs::Stat) -> Meta {
        Meta {
            kind: FileKind::from_mode(st.st_mode),
            perm: (st.st_mode & 0o7777) as u16,
            uid: st.st_uid,
            gid: st.st_gid,
            size: u64::try_from(st.st_size).unwrap_or(0),
            mtime_ns: ns(st.st_mtime, st.st_mtime_nsec as i64),
            ctime_ns: ns(st.st_ctime, st.st_ctime_nsec as i64),
            ino: st.st_ino,
            nlink: st.st_nlink as u32,
            rdev: st.st_rdev,
        }
    }
}

/// A `stat` time (seconds and nanoseconds) as nanoseconds since the epoch, saturating.
fn ns(secs: i64, nsec: i64) -> i64 {
    secs.saturating_mul(1_000_000_000).saturating_add(nsec)
}

/// A name in a directory listing, with the type the directory reports (if it does).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirName {
    /// The entry's name (one path component).
    pub name: OsString,
    /// Its type from the listing itself (`d_type`), when the filesystem gives one.
    pub kind: Option<FileKind>,
}

/// A source tree: metadata and data. Implemented by [`LocalSource`]; tests implement slow,
/// failing or changing ones. Paths are relative to the source root (`""` is the root) and made
/// of normal components only.
pub trait Source: Send + Sync + 'static {
    /// Metadata of `rel`, not following a final symlink.
    fn stat(&self, rel: &Path) -> Result<Meta, SourceError>;
    /// The names in directory `rel` (any order; without `.` and `..`).
    fn read_dir(&self, rel: &Path) -> Result<Vec<DirName>, SourceError>;
    /// The target of symlink `rel`, exactly as stored.
    fn readlink(&self, rel: &Path) -> Result<Vec<u8>, SourceError>;
    /// Up to `len` bytes at `offset` of regular file `rel`, whose contents must still be
    /// `version` (checked on the open descriptor after reading). Fewer bytes only at the end of
    /// the file.
    fn read_at(
        &self,
        rel: &Path,
        version: Version,
        offset: u64,
        len: usize,
    ) -> Result<Bytes, SourceError>;
}

/// Rejects paths that are not made of normal components (`..`, `/`, `.`): a snapshot read from
/// a file must not name anything outside the source.
pub fn check_rel(rel: &Path) -> Result<(), SourceError> {
    use std::path::Component;
    if rel.components().all(|c| matches!(c, Component::Normal(_))) {
        Ok(())
    } else {
        Err(SourceError::Outside {
            path: rel.to_path_buf(),
        })
    }
}

/// A directory on a (possibly slow) mounted filesystem.
pub struct LocalSource {
    root: PathBuf,
    root_fd: OwnedFd,
    files: Mutex<LruCache<PathBuf, Arc<File>>>,
    dirs: Mutex<LruCache<PathBuf, Arc<OwnedFd>>>,
    /// Whether the kernel has `openat2` (Linux ≥ 5.6); else paths are walked one
    /// `O_NOFOLLOW` component at a time.
    openat2: bool,
}

impl LocalSource {
    /// A source rooted at `root` (opened now: a later swap of `root` itself changes nothing).
    pub fn new(root: impl Into<PathBuf>) -> io::Result<LocalSource> {
        let root = root.into();
        let root_fd = rustix::fs::open(
            &root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let openat2 = rustix::fs::openat2(
            &root_fd,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH,
        )
        .is_ok();
        // Sized by the descriptor limit (crate::fds).
        Ok(LocalSource {
            root,
            root_fd,
            files: Mutex::new(LruCache::new(fds::share(fds::SOURCE_FILES))),
            dirs: Mutex::new(LruCache::new(fds::share(fds::SOURCE_DIRS))),
            openat2,
        })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Opens `rel` beneath the root, following no symlink in any component.
    fn open_beneath(&self, rel: &Path, flags: OFlags) -> Result<OwnedFd, SourceError> {
        check_rel(rel)?;
        let flags = flags | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let path: &Path = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        let r = if self.openat2 {
            rustix::fs::openat2(
                &self.root_fd,
                path,
                flags,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
            )
        } else {
            self.open_walk(rel, flags)
        };
        r.map_err(|e| errno_err(rel, e))
    }

    /// The fallback of [`open_beneath`](Self::open_beneath): one component at a time, each
    /// directory opened `O_NOFOLLOW | O_DIRECTORY`.
    fn open_walk(&self, rel: &Path, flags: OFlags) -> rustix::io::Result<OwnedFd> {
        let mut comps: Vec<&OsStr> = rel.iter().collect();
        let Some(last) = comps.pop() else {
            return rustix::fs::openat(&self.root_fd, ".", flags, Mode::empty());
        };
        let mut dir: Option<OwnedFd> = None;
        for c in comps {
            let at = dir.as_ref().map_or(self.root_fd.as_fd(), |d| d.as_fd());
            dir = Some(rustix::fs::openat(
                at,
                c,
                OFlags::RDONLY
                    | OFlags::DIRECTORY
                    | OFlags::NOFOLLOW
                    | OFlags::CLOEXEC
                    | OFlags::NONBLOCK,
                Mode::empty(),
            )?);
        }
        let at = dir.as_ref().map_or(self.root_fd.as_fd(), |d| d.as_fd());
        rustix::fs::openat(at, last, flags, Mode::empty())
    }

    fn dir(&self, rel: &Path) -> Result<Arc<OwnedFd>, SourceError> {
        if let Some(d) = lock(&self.dirs).get(rel) {
            return Ok(d.clone());
        }
        let fd = Arc::new(self.open_beneath(rel, OFlags::RDONLY | OFlags::DIRECTORY)?);
        lock(&self.dirs).put(rel.to_path_buf(), fd.clone());
        Ok(fd)
    }

    fn file(&self, rel: &Path, version: Version) -> Result<Arc<File>, SourceError> {
        if let Some(f) = lock(&self.files).get(rel) {
            return Ok(f.clone());
        }
        let fd = self.open_beneath(rel, OFlags::RDONLY)?;
        let st = rustix::fs::fstat(&fd).map_err(|e| errno_err(rel, e))?;
        let meta = Meta::of_stat(&st);
        if meta.kind != FileKind::File || meta.version() != version {
            return Err(SourceError::Changed {
                path: rel.to_path_buf(),
            });
        }
        let f = Arc::new(File::from(fd));
        lock(&self.files).put(rel.to_path_buf(), f.clone());
        Ok(f)
    }

    /// The parent directory and final name of `rel` (which must not be the root).
    fn split(rel: &Path) -> Result<(&Path, &OsStr), SourceError> {
        match (rel.parent(), rel.file_name()) {
            (Some(p), Some(n)) => Ok((p, n)),
            _ => Err(SourceError::Outside {
                path: rel.to_path_buf(),
            }),
        }
    }
}

impl Source for LocalSource {
    fn stat(&self, rel: &Path) -> Result<Meta, SourceError> {
        check_rel(rel)?;
        if rel.as_os_str().is_empty() {
            let st = rustix::fs::fstat(&self.root_fd).map_err(|e| errno_err(rel, e))?;
            return Ok(Meta::of_stat(&st));
        }
        let (parent, name) = Self::split(rel)?;
        let dir = self.dir(parent)?;
        let st = rustix::fs::statat(&*dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| errno_err(rel, e))?;
        Ok(Meta::of_stat(&st))
    }

    fn read_dir(&self, rel: &Path) -> Result<Vec<DirName>, SourceError> {
        let dir = self.dir(rel)?;
        let entries = rustix::fs::Dir::read_from(&*dir).map_err(|e| errno_err(rel, e))?;
        let mut out = Vec::new();
        for e in entries {
            let e = e.map_err(|e| errno_err(rel, e))?;
            let name = e.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let kind = match e.file_type() {
                FileType::Unknown => None,
                t => Some(FileKind::from_mode(t.as_raw_mode())),
            };
            out.push(DirName {
                name: OsStr::from_bytes(name).to_os_string(),
                kind,
            });
        }
        Ok(out)
    }

    fn readlink(&self, rel: &Path) -> Result<Vec<u8>, SourceError> {
        check_rel(rel)?;
        let (parent, name) = Self::split(rel)?;
        let dir = self.dir(parent)?;
        let target =
            rustix::fs::readlinkat(&*dir, name, Vec::new()).map_err(|e| errno_err(rel, e))?;
        Ok(target.into_bytes())
    }

    fn read_at(
        &self,
        rel: &Path,
        version: Version,
        offset: u64,
        len: usize,
    ) -> Result<Bytes, SourceError> {
        let file = self.file(rel, version)?;
        let len = len.min(version.size.saturating_sub(offset) as usize);
        let mut buf = BytesMut::with_capacity(len);
        let done = read_uninit(&file, &mut buf, len, offset).map_err(|e| io_err(rel, e))?;
        // Checked after the read: a change during it must not slip through.
        let st = rustix::fs::fstat(&*file).map_err(|e| errno_err(rel, e))?;
        if Meta::of_stat(&st).version() != version || done < len {
            lock(&self.files).pop(rel);
            return Err(SourceError::Changed {
                path: rel.to_path_buf(),
            });
        }
        Ok(buf.freeze())
    }
}

/// Reads up to `len` bytes at `off` into the uninitialised capacity of `buf`, after the bytes
/// it holds (fewer only at end of file); returns how many. The one `pread`-into-spare-capacity
/// loop: source reads and cache reads both land in fresh memory that is never zeroed first.
pub fn read_uninit(file: &File, buf: &mut BytesMut, len: usize, off: u64) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    buf.reserve(len);
    let start = buf.len();
    let mut done = 0;
    while done < len {
        let spare = &mut buf.spare_capacity_mut()[..len - done];
        // SAFETY: pread writes at most `spare.len()` bytes into the spare capacity; only the
        // bytes it reports written are marked initialised below.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                spare.as_mut_ptr().cast(),
                spare.len(),
                (off + done as u64) as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        // SAFETY: the kernel initialised `n` more bytes.
        unsafe { buf.set_len(start + done + n as usize) };
        done += n as usize;
    }
    Ok(done)
}

/// A `FileExt` read of exactly `buf.len()` bytes (or fewer at end of file).
// The table readers' copy is `stagefs_parquet_bounds::read_full_at`: the cache depends on no
// table crate (that one would bring the parquet crate), and no crate lies below both.
pub fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

fn errno_err(rel: &Path, e: rustix::io::Errno) -> SourceError {
    match e {
        // A symlink or a non-directory where a directory was expected: the tree changed shape
        // since the snapshot (or someone tried to lead us out of it).
        rustix::io::Errno::LOOP | rustix::io::Errno::XDEV | rustix::io::Errno::NOTDIR => {
            SourceError::Changed {
                path: rel.to_path_buf(),
            }
        }
        e => io_err(rel, e.into()),
    }
}

fn io_err(rel: &Path, e: io::Error) -> SourceError {
    if e.kind() == io::ErrorKind::NotFound {
        SourceError::Gone {
            path: rel.to_path_buf(),
        }
    } else {
        SourceError::Io {
            path: rel.to_path_buf(),
            source: e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version(p: &Path) -> Version {
        Version::of(&std::fs::symlink_metadata(p).unwrap())
    }

    #[test]
    fn reads_check_the_version_on_the_descriptor() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("d")).unwrap();
        let f = tmp.path().join("d/f");
        std::fs::write(&f, b"hello world").unwrap();
        let src = LocalSource::new(tmp.path()).unwrap();
        let v = version(&f);
        assert_eq!(
            &src.read_at(Path::new("d/f"), v, 6, 100).unwrap()[..],
            b"world"
        );
        let meta = src.stat(Path::new("d/f")).unwrap();
        assert_eq!(meta.version(), v);
        assert_eq!(meta.kind, FileKind::File);
        let stale = Version { size: 5, ..v };
        assert!(matches!(
            src.read_at(Path::new("d/f"), stale, 0, 5),
            Err(SourceError::Changed { .. })
        ));
        let names = src.read_dir(Path::new("d")).unwrap();
        assert_eq!(names.len(), 1);
        assert_eq!(names[0].name, "f");
    }

    #[test]
    fn directory_swapped_for_a_symlink_is_not_followed_out_of_source() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("secret"), b"secret").unwrap();
        let root = tmp.path().join("src");
        std::fs::create_dir_all(root.join("d")).unwrap();
        std::fs::write(root.join("d/secret"), b"public").unwrap();
        let src = LocalSource::new(&root).unwrap();
        let v = version(&outside.join("secret"));
        // The snapshot saw d/ as a directory; it is swapped for a symlink to outside.
        std::fs::remove_dir_all(root.join("d")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("d")).unwrap();
        assert!(src.read_at(Path::new("d/secret"), v, 0, 6).is_err());
        assert!(src.stat(Path::new("d/secret")).is_err());
        assert!(src.read_dir(Path::new("d")).is_err());
        assert!(check_rel(Path::new("../x")).is_err());
        assert!(src.stat(Path::new("../outside/secret")).is_err());
    }

    #[test]
    fn fifo_swapped_in_does_not_block_a_read() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("f");
        std::fs::write(&p, b"data").unwrap();
        let v = version(&p);
        std::fs::remove_file(&p).unwrap();
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: mkfifo on a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let src = LocalSource::new(tmp.path()).unwrap();
        // Without O_NONBLOCK this open would wait forever for a writer.
        assert!(src.read_at(Path::new("f"), v, 0, 4).is_err());
    }
}
