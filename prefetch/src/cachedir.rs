//! The cache directory on scratch: private to its user, and never steered by anyone else.
//!
//! Scratch directories on shared nodes (`/tmp`, `/scratch`) are writable by other users, who can
//! pre-create a directory a victim will use and fill it with symlinks or forged files. So:
//! - the directory is created `0700` and every file in it `0600` (whatever the umask);
//! - an existing directory is accepted only if it is a real directory (not a symlink), owned by
//!   the effective user, and not writable by group or others; otherwise it is refused with a
//!   message that says why and what to do;
//! - everything inside is reached relative to the directory's descriptor (`openat` and friends)
//!   with `O_NOFOLLOW`, new files with `O_EXCL`, temporaries with unpredictable names — so a
//!   symlink planted inside, or a rename of a path component, cannot redirect a single write.
//!
//! Nothing here trusts the contents of the directory for security: it is private, and the cache
//! still checksums everything it reads back.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

use crate::error::CacheError;

/// Mode of directories the cache creates.
pub const DIR_MODE: u32 = 0o700;
/// Mode of files the cache creates.
pub const FILE_MODE: u32 = 0o600;

/// An open, checked, private directory.
#[derive(Debug)]
pub struct CacheDir {
    fd: OwnedFd,
    path: PathBuf,
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Why an existing directory may not hold a private cache, or `None` if it may.
fn refusal(st: &rustix::fs::Stat) -> Option<String> {
    let ft = FileType::from_raw_mode(st.st_mode);
    if ft != FileType::Directory {
        return Some("is not a directory".into());
    }
    if st.st_uid != euid() {
        return Some(format!(
            "is owned by uid {}, not by you (uid {}): another user may have created it to read \
             or steer your cache",
            st.st_uid,
            euid()
        ));
    }
    if st.st_mode & 0o022 != 0 {
        return Some(format!(
            "is writable by group or others (mode {:o})",
            st.st_mode & 0o7777
        ));
    }
    None
}

impl CacheDir {
    /// Opens the private directory `path`, creating it (and missing parents) with mode `0700`.
    /// Refuses a path that is a symlink, not owned by the user, or group/world-writable.
    pub fn open(path: &Path) -> Result<CacheDir, CacheError> {
        let err = |reason: String| CacheError::Unsafe {
            path: path.to_path_buf(),
            reason,
        };
        let io_err = |source: io::Error| CacheError::Dir {
            path: path.to_path_buf(),
            source,
        };
        if std::fs::symlink_metadata(path).is_err() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(DIR_MODE)
                .create(path)
                .map_err(io_err)?;
        }
        // O_NOFOLLOW on the last component: a symlink planted at the cache's own path is refused.
        let fd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => {
                err("is a symlink or not a directory".into())
            }
            e => io_err(e.into()),
        })?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err(e.into()))?;
        if let Some(reason) = refusal(&st) {
            return Err(err(reason));
        }
        Ok(CacheDir {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The directory's path (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory's descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Opens (creating `0700` if missing) the private subdirectory `name`, with the same checks.
    pub fn subdir(&self, name: &str) -> Result<CacheDir, CacheError> {
        let path = self.path.join(name);
        let io_err = |source: io::Error| CacheError::Dir {
            path: path.clone(),
            source,
        };
        match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(DIR_MODE)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(io_err(e.into())),
        }
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => CacheError::Unsafe {
                path: path.clone(),
                reason: "is a symlink or not a directory".into(),
            },
            e => io_err(e.into()),
        })?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err(e.into()))?;
        if let Some(reason) = refusal(&st) {
            return Err(CacheError::Unsafe { path, reason });
        }
        Ok(CacheDir { fd, path })
    }

    fn check_file(fd: &OwnedFd) -> io::Result<()> {
        let st = rustix::fs::fstat(fd)?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile || st.st_uid != euid() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "not a regular file owned by this user",
            ));
        }
        Ok(())
    }

    /// Opens the existing regular file `name` for reading (never through a symlink).
    pub fn open_read(&self, name: impl AsRef<OsStr>) -> io::Result<File> {
        self.open_existing(name.as_ref(), OFlags::RDONLY | OFlags::NONBLOCK)
    }

    /// Opens the existing regular file `name` for reads that bypass the page cache
    /// (`O_DIRECT`; never through a symlink). Fails with `EINVAL` where the filesystem has no
    /// direct I/O.
    pub fn open_direct(&self, name: impl AsRef<OsStr>) -> io::Result<File> {
        self.open_existing(name.as_ref(), OFlags::RDONLY | OFlags::DIRECT)
    }

    /// Opens the existing regular file `name`, owned by the user, with `flags` (never through a
    /// symlink, never inherited by a child).
    fn open_existing(&self, name: &OsStr, flags: OFlags) -> io::Result<File> {
        let flags = flags | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&self.fd, name, flags, Mode::empty())?;
        Self::check_file(&fd)?;
        Ok(File::from(fd))
    }

    /// Opens `name` for reading and writing, creating it `0600` if `create` (never through a
    /// symlink; an existing file must be a regular file owned by the user).
    pub fn open_rw(&self, name: impl AsRef<OsStr>, create: bool) -> io::Result<File> {
        let mut flags = OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
        if create {
            flags |= OFlags::CREATE;
        }
        let fd = rustix::fs::openat(
            &self.fd,
            name.as_ref(),
            flags,
            Mode::from_raw_mode(FILE_MODE),
        )?;
        Self::check_file(&fd)?;
        Ok(File::from(fd))
    }

    /// Opens `name` for appending, creating it `0600` if missing (the daemon's log).
    pub fn open_append(&self, name: impl AsRef<OsStr>) -> io::Result<File> {
        let fd = rustix::fs::openat(
            &self.fd,
            name.as_ref(),
            OFlags::WRONLY
                | OFlags::APPEND
                | OFlags::CREATE
                | OFlags::NOFOLLOW
                | OFlags::CLOEXEC
                | OFlags::NONBLOCK,
            Mode::from_raw_mode(FILE_MODE),
        )?;
        Self::check_file(&fd)?;
        Ok(File::from(fd))
    }

    /// Creates a new temporary file `0600` under an unpredictable name starting with `prefix`
    /// (`O_EXCL`: it cannot be a file someone else made). Returns the file and its name.
    pub fn create_temp(&self, prefix: &str) -> io::Result<(File, OsString)> {
        create_temp_in(self.fd(), prefix)
    }

    /// Renames `from` to `to` inside this directory (atomically replacing `to`).
    pub fn rename(&self, from: impl AsRef<OsStr>, to: impl AsRef<OsStr>) -> io::Result<()> {
        Ok(rustix::fs::renameat(
            &self.fd,
            from.as_ref(),
            &self.fd,
            to.as_ref(),
        )?)
    }

    /// Removes the file `name` (a missing file is not an error).
    pub fn remove(&self, name: impl AsRef<OsStr>) -> io::Result<()> {
        match rustix::fs::unlinkat(&self.fd, name.as_ref(), AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether `name` exists (as anything; symlinks are not followed).
    pub fn exists(&self, name: impl AsRef<OsStr>) -> bool {
        rustix::fs::statat(&self.fd, name.as_ref(), AtFlags::SYMLINK_NOFOLLOW).is_ok()
    }

    /// Removes the subdirectory `name` and everything below it, following no symlink (a
    /// symlink inside is removed, never what it points at).
    pub fn remove_tree(&self, name: &str) -> io::Result<()> {
        let sub = self.subdir(name).map_err(io::Error::other)?;
        for child in sub.list()? {
            let st = rustix::fs::statat(&sub.fd, &child, AtFlags::SYMLINK_NOFOLLOW)?;
            if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                match child.to_str() {
                    Some(c) => sub.remove_tree(c)?,
                    None => rustix::fs::unlinkat(&sub.fd, &child, AtFlags::REMOVEDIR)?,
                }
            } else {
                sub.remove(&child)?;
            }
        }
        drop(sub);
        Ok(rustix::fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR)?)
    }

    /// Names in the directory (without `.` and `..`).
    pub fn list(&self) -> io::Result<Vec<OsString>> {
        let dir = rustix::fs::Dir::read_from(&self.fd)?;
        let mut out = Vec::new();
        for e in dir {
            let e = e?;
            let name = e.file_name().to_bytes();
            if name != b"." && name != b".." {
                out.push(OsStr::from_bytes(name).to_os_string());
            }
        }
        Ok(out)
    }

    /// Flushes the directory itself (after renames), so they survive a crash of the node.
    pub fn sync(&self) -> io::Result<()> {
        Ok(rustix::fs::fsync(&self.fd)?)
    }
}

/// How long taking the cache's lock waits for a holder that is exiting (killed, its exit
/// not yet done: closing thousands of cache files, unwinding requests to its own mount): 10 s.
pub const LOCK_EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether process `pid` is exiting: its kernel flags carry `PF_EXITING` (or it is gone or a
/// zombie, which hold no locks but may be seen for a moment as the holder).
pub fn process_is_exiting(pid: u32) -> bool {
    /// `PF_EXITING` of the kernel's task flags (include/linux/sched.h).
    const PF_EXITING: u64 = 0x4;
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // "pid (comm) state ppid ... flags": comm may hold spaces and parentheses, so fields
    // are counted after its last ')'. State is field 3, flags field 9.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first().copied().unwrap_or("");
    let flags: u64 = fields.get(6).and_then(|f| f.parse().ok()).unwrap_or(0);
    matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0
}

/// Name of the lock file in the cache directory (see [`CacheDir::lock`]).
pub const LOCK_FILE: &str = "lock";

impl CacheDir {
    /// Takes the cache's exclusive lock: `flock` on [`LOCK_FILE`] (created `0600`), held until
    /// the returned file is dropped or its process dies (so a killed daemon never leaves a stale
    /// lock). Two mounts sharing one cache would overwrite each other's blocks and log, so the
    /// second is refused, naming the holder's pid, which the holder writes into the file.
    pub fn lock(&self) -> Result<File, CacheError> {
        use std::io::{Read, Write};
        let io_err = |source: io::Error| CacheError::Dir {
            path: self.path.clone(),
            source,
        };
        let mut file = self.open_rw(LOCK_FILE, true).map_err(io_err)?;
        let deadline = std::time::Instant::now() + LOCK_EXIT_WAIT;
        loop {
            match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => break,
                Err(rustix::io::Errno::WOULDBLOCK) => {
                    // The pid is a hint: a few bytes, parsed or ignored.
                    let mut text = String::new();
                    let _ = rustix::fs::seek(&file, rustix::fs::SeekFrom::Start(0));
                    let _ = (&file).take(32).read_to_string(&mut text);
                    let pid: Option<u32> = text.trim().parse().ok();
                    // A daemon killed a moment ago holds its lock until its exit ends (a
                    // remount right after `stagefs umount` of it was refused): wait for that,
                    // bounded; a live holder is refused at once.
                    if pid.is_some_and(process_is_exiting) && std::time::Instant::now() < deadline {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        continue;
                    }
                    return Err(CacheError::InUse {
                        path: self.path.clone(),
                        pid,
                    });
                }
                Err(e) => return Err(io_err(e.into())),
            }
        }
        file.set_len(0).map_err(io_err)?;
        file.write_all(format!("{}\n", std::process::id()).as_bytes())
            .map_err(io_err)?;
        Ok(file)
    }
}

/// Creates a new `0600` file named `<prefix>.<16 random hex digits>.tmp` in directory `dir`,
/// opened read-write: `O_EXCL | O_NOFOLLOW`, so it is never a file someone else made nor
/// reached through a symlink, and its name cannot be predicted in a shared directory. The one
/// temporary-file maker of the crate and of the snapshot writer.
pub fn create_temp_in(dir: BorrowedFd<'_>, prefix: &str) -> io::Result<(File, OsString)> {
    for _ in 0..16 {
        let name = OsString::from(format!("{prefix}.{:016x}.tmp", random_u64()?));
        match rustix::fs::openat(
            dir,
            &name,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(FILE_MODE),
        ) {
            Ok(fd) => return Ok((File::from(fd), name)),
            Err(rustix::io::Errno::EXIST) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        "no free temporary name after 16 tries",
    ))
}

/// 64 unpredictable bits from the kernel.
pub fn random_u64() -> io::Result<u64> {
    let mut b = [0u8; 8];
    rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty())?;
    Ok(u64::from_ne_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// A remount right after `stagefs umount` of a killed daemon was refused "in use by pid N":
    /// the lock outlived the recorded holder by a moment. Here the recorded holder (flock(1))
    /// is killed while its child, which inherited the locked descriptor, holds it for 1 s more.
    #[test]
    fn regression_the_lock_of_a_holder_that_is_gone_was_refused_instead_of_waited_for() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CacheDir::open(&tmp.path().join("cache")).unwrap();
        let lock = tmp.path().join("cache").join(LOCK_FILE);
        let mut holder = std::process::Command::new("flock")
            .arg("-x")
            .arg(&lock)
            .args(["sleep", "1"])
            .spawn()
            .unwrap();
        let held = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::process::Command::new("flock")
            .args(["-n", "-x"])
            .arg(&lock)
            .arg("true")
            .status()
            .unwrap()
            .success()
        {
            assert!(
                std::time::Instant::now() < held,
                "flock(1) never took the lock"
            );
        }
        std::fs::write(&lock, format!("{}\n", holder.id())).unwrap();
        holder.kill().unwrap();
        holder.wait().unwrap();
        assert!(
            process_is_exiting(holder.id()),
            "a reaped process counts as gone"
        );
        let t = std::time::Instant::now();
        let _lock = dir.lock().expect("taken once the last descriptor closes");
        assert!(t.elapsed() < LOCK_EXIT_WAIT, "{:?}", t.elapsed());
        // A live holder is refused at once.
        drop(_lock);
        let _mine = dir.lock().unwrap();
        let t = std::time::Instant::now();
        assert!(matches!(dir.lock(), Err(CacheError::InUse { .. })));
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
        assert!(!process_is_exiting(std::process::id()));
    }

    #[test]
    fn created_private_whatever_the_umask() {
        let tmp = tempfile::tempdir().unwrap();
        // SAFETY: umask only changes this process's file-creation mask.
        let old = unsafe { libc::umask(0) };
        let dir = CacheDir::open(&tmp.path().join("a/b/cache"));
        // SAFETY: as above, restoring the previous mask.
        unsafe { libc::umask(old) };
        let dir = dir.unwrap();
        let meta = std::fs::metadata(tmp.path().join("a/b/cache")).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o700);
        let (f, name) = dir.create_temp("x").unwrap();
        drop(f);
        let meta = std::fs::metadata(dir.path().join(&name)).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        let sub = dir.subdir("s").unwrap();
        let meta = std::fs::metadata(sub.path()).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o700);
    }

    #[test]
    fn cache_dir_writable_by_others_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("c");
        std::fs::create_dir(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = CacheDir::open(&p).unwrap_err().to_string();
        assert!(e.contains("writable by group or others"), "{e}");
    }

    #[test]
    fn cache_dir_that_is_a_symlink_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("real")).unwrap();
        std::os::unix::fs::symlink("real", tmp.path().join("link")).unwrap();
        let e = CacheDir::open(&tmp.path().join("link"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("symlink"), "{e}");
    }

    #[test]
    fn remove_tree_removes_symlinks_not_their_targets() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("keep"), b"x").unwrap();
        let dir = CacheDir::open(&tmp.path().join("cache")).unwrap();
        let old = dir.subdir("v1").unwrap();
        let inner = old.subdir("00").unwrap();
        std::fs::write(inner.path().join("a.data"), b"y").unwrap();
        std::os::unix::fs::symlink(&victim, inner.path().join("link")).unwrap();
        dir.remove_tree("v1").unwrap();
        assert!(!dir.exists("v1"));
        assert!(victim.join("keep").exists());
    }

    #[test]
    fn planted_symlink_inside_is_never_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let dir = CacheDir::open(&tmp.path().join("cache")).unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("stagefs.log")).unwrap();
        assert!(dir.open_append("stagefs.log").is_err());
        assert!(dir.open_rw("stagefs.log", true).is_err());
        assert!(dir.open_read("stagefs.log").is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }
}
