//! Opening a tree beneath its root descriptor without ever following a symlink inside it: SRC
//! to read from it, DST to write into it ([`crate::dst`]).
//!
//! A root is opened once per pass (the path the user gave, symlinks in it included: that path
//! is the user's choice), and everything else is reached from that descriptor: directories are
//! walked with `openat(O_DIRECTORY | O_NOFOLLOW)`, and a file or directory deeper down is opened
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` from the root descriptor (Linux ≥ 5.6),
//! or, where the kernel or a seccomp filter lacks `openat2`, one component at a time with
//! `O_NOFOLLOW`. A symlink swapped in after planning — for the file or for any directory on
//! its way — therefore fails the open (`ELOOP`) instead of leading out of the tree, and a
//! renamed root path does not move the pass to another tree. Files are opened `O_NONBLOCK` so
//! that a FIFO swapped in cannot block a copy thread; the caller checks the type after the open.
//! Relative paths must be plain names (no `..`, no leading `/`) and shorter than `PATH_MAX`,
//! both ways, so that the fallback (which has no length limit) behaves as `openat2` does.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{Mode, OFlags, ResolveFlags, CWD};

/// Cleared after `openat2` answered ENOSYS (or EPERM from a seccomp filter): use the fallback.
static HAVE_OPENAT2: AtomicBool = AtomicBool::new(true);

/// Longest path the kernel resolves (`openat2` answers `ENAMETOOLONG` from here on).
const PATH_MAX: usize = libc::PATH_MAX as usize;

/// Retries of `openat2` after EAGAIN (a concurrent rename somewhere in the tree).
const EAGAIN_RETRIES: u32 = 8;

/// Flags for a source file: read-only, no symlink, never block (FIFO), no controlling tty.
fn file_flags() -> OFlags {
    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY
}

/// Flags for a directory: read-only (listable, fsync-able), no symlink.
fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// Opens the root directory `path` of a tree (symlinks in `path` itself are followed).
pub fn open_root(path: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        CWD,
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Opens the subdirectory `name` of `dir`, refusing a symlink.
pub fn open_dir(dir: impl AsFd, name: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(dir, name, dir_flags(), Mode::empty())?)
}

/// Opens `name` in `dir` for reading, refusing a symlink.
pub fn open_file_in(dir: impl AsFd, name: &Path) -> io::Result<File> {
    Ok(File::from(rustix::fs::openat(
        dir,
        name,
        file_flags(),
        Mode::empty(),
    )?))
}

/// Opens the file `rel` beneath `root` for reading without following any symlink on the way.
/// `rel` must be a plain relative path (names only); anything else is `InvalidInput`.
pub fn open_file_beneath(root: impl AsFd, rel: &Path) -> io::Result<File> {
    Ok(File::from(open_beneath(root.as_fd(), rel, file_flags())?))
}

/// Opens the directory `rel` beneath `root` without following any symlink on the way (the
/// empty path is `root` itself, opened anew). `rel` must be a plain relative path.
pub fn open_dir_beneath(root: impl AsFd, rel: &Path) -> io::Result<OwnedFd> {
    if rel.as_os_str().is_empty() {
        return open_dir(root, Path::new("."));
    }
    open_beneath(root.as_fd(), rel, dir_flags())
}

/// The names of a plain relative path, or `InvalidInput` (`ENAMETOOLONG` from `PATH_MAX` on).
fn plain_names(rel: &Path) -> io::Result<Vec<&OsStr>> {
    if rel.as_os_str().len() >= PATH_MAX {
        return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    rel.components()
        .map(|c| match c {
            Component::Normal(n) => Ok(n),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a plain relative path", rel.display()),
            )),
        })
        .collect()
}

/// `rel` beneath `root` opened with `flags` (which include `O_NOFOLLOW`): `openat2`, or the
/// component-at-a-time fallback.
fn open_beneath(root: BorrowedFd<'_>, rel: &Path, flags: OFlags) -> io::Result<OwnedFd> {
    let names = plain_names(rel)?;
    let Some((last, dirs)) = names.split_last() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty path"));
    };
    if HAVE_OPENAT2.load(Ordering::Relaxed) {
        let resolve =
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        let mut tries = 0;
        loop {
            match rustix::fs::openat2(root, rel, flags, Mode::empty(), resolve) {
                Ok(fd) => return Ok(fd),
                Err(rustix::io::Errno::AGAIN) if tries < EAGAIN_RETRIES => tries += 1,
                Err(rustix::io::Errno::NOSYS | rustix::io::Errno::PERM) => {
                    HAVE_OPENAT2.store(false, Ordering::Relaxed);
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    open_componentwise(root, dirs, last, flags)
}

/// The fallback: each directory with `O_NOFOLLOW | O_DIRECTORY` (one descriptor open at a
/// time besides the root: each parent is closed once its child is open), then the last name
/// with `flags`.
fn open_componentwise(
    root: BorrowedFd<'_>,
    dirs: &[&OsStr],
    last: &OsStr,
    flags: OFlags,
) -> io::Result<OwnedFd> {
    let mut cur: Option<OwnedFd> = None;
    for d in dirs {
        let next = match &cur {
            None => open_dir(root, Path::new(d))?,
            Some(fd) => open_dir(fd, Path::new(d))?,
        };
        cur = Some(next);
    }
    let parent = match &cur {
        None => root,
        Some(fd) => fd.as_fd(),
    };
    Ok(rustix::fs::openat(parent, last, flags, Mode::empty())?)
}

/// Whether an open error means "a symlink (or a non-directory) is in the way": the tree
/// changed since it was planned, and nothing was followed.
pub fn is_not_followed(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ELOOP) | Some(libc::ENOTDIR) | Some(libc::EXDEV)
    )
}

/// Runs `f` with `openat2`, then again with the component-at-a-time fallback, so that tests
/// cover both ways. (Other tests running meanwhile may take either way: both are correct.)
#[cfg(test)]
pub(crate) fn both_ways(f: impl Fn()) {
    f();
    HAVE_OPENAT2.store(false, Ordering::Relaxed);
    f();
    HAVE_OPENAT2.store(true, Ordering::Relaxed);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)
mod tests {
    use super::*;
    use std::io::Read;

    fn tree() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("src/d")).unwrap();
        std::fs::write(t.path().join("src/d/f"), b"inside").unwrap();
        std::fs::write(t.path().join("secret"), b"outside").unwrap();
        std::os::unix::fs::symlink("../secret", t.path().join("src/link")).unwrap();
        std::os::unix::fs::symlink(t.path(), t.path().join("src/up")).unwrap();
        t
    }

    #[test]
    fn opens_inside_and_refuses_every_symlink() {
        let t = tree();
        let root = open_root(&t.path().join("src")).unwrap();
        both_ways(|| {
            let mut s = String::new();
            open_file_beneath(&root, Path::new("d/f"))
                .unwrap()
                .read_to_string(&mut s)
                .unwrap();
            assert_eq!(s, "inside");
            for rel in ["link", "up/secret", "up/src/d/f"] {
                let e = open_file_beneath(&root, Path::new(rel)).unwrap_err();
                assert!(is_not_followed(&e), "{rel}: {e}");
            }
            let e = open_file_beneath(&root, Path::new("../secret")).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        });
    }

    #[test]
    fn opens_directories_inside_and_refuses_every_symlink() {
        let t = tree();
        std::os::unix::fs::symlink(t.path(), t.path().join("src/d/updir")).unwrap();
        let root = open_root(&t.path().join("src")).unwrap();
        both_ways(|| {
            let d = open_dir_beneath(&root, Path::new("d")).unwrap();
            let mut s = String::new();
            open_file_in(&d, Path::new("f"))
                .unwrap()
                .read_to_string(&mut s)
                .unwrap();
            assert_eq!(s, "inside");
            // The empty path is the root itself.
            let r = open_dir_beneath(&root, Path::new("")).unwrap();
            assert!(open_file_in(&r, Path::new("d/f")).is_ok());
            for rel in ["up", "up/src", "d/updir", "d/updir/src/d", "d/f"] {
                let e = open_dir_beneath(&root, Path::new(rel)).unwrap_err();
                assert!(is_not_followed(&e), "{rel}: {e}");
            }
            let long = "x/".repeat(PATH_MAX / 2);
            let e = open_dir_beneath(&root, Path::new(&long)).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ENAMETOOLONG));
        });
    }
}
