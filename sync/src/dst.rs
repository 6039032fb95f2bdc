//! Changing the destination tree only through directory descriptors beneath its root.
//!
//! DST is often writable by others: a lab's directory on shared storage is group-writable, so
//! any member can rename, remove or replace any entry in it at any moment, for instance swap
//! `DST/sub` for a symlink to the syncing user's `~/.ssh`. A path is therefore never handed
//! to the kernel from DST's root downwards. DST's root is opened once, at planning
//! ([`crate::plan`]), and every change goes through a descriptor of the directory it is made
//! in, opened beneath that root with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` (or one component
//! at a time with `O_NOFOLLOW`: [`crate::beneath`]):
//! - temporaries are created `O_CREAT | O_EXCL | O_NOFOLLOW` in that directory ([`crate::copy`]);
//! - they are renamed with `renameat` from and to that same descriptor, directories are made
//!   with `mkdirat` and given their mode with `fchmod` on a descriptor opened `O_NOFOLLOW`;
//! - entries are removed with `unlinkat`, directory trees by [`remove_tree`], which never holds
//!   more than one descriptor of the tree and reopens each directory beneath its anchor.
//!
//! A symlink swapped in anywhere on a path makes that open fail (`ELOOP`; `ENOTDIR` for a
//! file) instead of leading out of DST; the path fails, is named, and the next pass retries it.
//! So nothing is ever written, renamed, re-moded or deleted outside the directories of the
//! DST tree that existed at planning, whatever is swapped in and whenever. (A directory of that
//! tree that someone moves elsewhere while a descriptor to it is open is still written: it is
//! a directory they could already write, not one of the syncing user's.)
//!
//! Descriptors are held only for the operation at hand (one per copy in flight, one per
//! directory being created, removed or fsynced), never one per file or directory for a whole
//! pass, so a pass over any tree stays far below the open-file limit.

use crate::beneath;
use crate::error::FileError;
use rustix::fs::{AtFlags, Mode};
use rustix::io::Errno;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Splits `rel` into its parent (possibly empty: the root) and its last name.
pub fn split(rel: &Path) -> io::Result<(&Path, &OsStr)> {
    match (rel.parent(), rel.file_name()) {
        (Some(dir), Some(name)) => Ok((dir, name)),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} has no parent directory in DST", rel.display()),
        )),
    }
}

/// Opens the directory that holds `rel` (beneath `root`) and returns it with `rel`'s last name.
pub fn open_parent(root: impl AsFd, rel: &Path) -> io::Result<(OwnedFd, &OsStr)> {
    let (dir, name) = split(rel)?;
    Ok((beneath::open_dir_beneath(root, dir)?, name))
}

/// Creates the directory `rel` beneath `root` (`replace`: first removing a file or link in its
/// place) and gives it `mode`, always with owner `rwx` so that the copies into it can be made.
/// An existing directory is used as it is (and given the mode).
pub fn make_dir(root: impl AsFd, rel: &Path, mode: u32, replace: bool) -> Result<(), FileError> {
    let (parent, name) =
        open_parent(root, rel).map_err(FileError::dst("open destination directory"))?;
    if replace {
        match rustix::fs::unlinkat(&parent, name, AtFlags::empty()) {
            // A directory is there by now (EISDIR): it is used below like any existing one.
            Ok(()) | Err(Errno::NOENT | Errno::ISDIR) => {}
            Err(e) => {
                return Err(FileError::io("remove file in the way of a directory")(
                    e.into(),
                ))
            }
        }
    }
    // Created private; the mode is set once it is open as a directory, not through a name.
    match rustix::fs::mkdirat(&parent, name, Mode::from_raw_mode(0o700)) {
        Ok(()) | Err(Errno::EXIST) => {}
        Err(e) => return Err(FileError::io("create directory")(e.into())),
    }
    let dir = beneath::open_dir(&parent, Path::new(name))
        .map_err(FileError::dst("open created directory"))?;
    rustix::fs::fchmod(&dir, Mode::from_raw_mode((mode & 0o7777) | 0o700))
        .map_err(|e| FileError::io("set directory mode")(e.into()))
}

/// Removes the entry `rel` beneath `root` whatever it is (a directory with its contents);
/// `Ok(false)` when it is already gone.
pub fn remove(root: impl AsFd, rel: &Path) -> io::Result<bool> {
    let (parent, name) = open_parent(root, rel)?;
    match rustix::fs::unlinkat(&parent, name, AtFlags::empty()) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT) => Ok(false),
        Err(Errno::ISDIR) => remove_tree(&parent, name).map(|()| true),
        Err(e) => Err(e.into()),
    }
}

/// Removes the directory `name` in `parent` with everything in it, without following any
/// symlink (a link in it is removed as a link; a directory swapped for a link while it is
/// being emptied fails the removal with `ELOOP`).
///
/// Iterative, one directory descriptor open at a time: each directory is reopened beneath
/// `parent` (`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`) when its turn comes, so the removal can
/// neither leave the tree nor run out of descriptors however deep the tree is.
pub fn remove_tree(parent: impl AsFd, name: &OsStr) -> io::Result<()> {
    let parent = parent.as_fd();
    let mut stack: Vec<PathBuf> = vec![PathBuf::from(name)];
    while let Some(rel) = stack.last().cloned() {
        let dir = match beneath::open_dir_beneath(parent, &rel) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                stack.pop();
                continue;
            }
            Err(e) => return Err(e),
        };
        let mut subdirs = Vec::new();
        for entry in names(&dir)? {
            match rustix::fs::unlinkat(&dir, entry.as_os_str(), AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(Errno::ISDIR) => subdirs.push(rel.join(entry)),
                Err(e) => return Err(e.into()),
            }
        }
        drop(dir);
        if !subdirs.is_empty() {
            // Emptied first; this directory is visited again afterwards and then removed.
            stack.extend(subdirs);
            continue;
        }
        stack.pop();
        let (up, last) = split(&rel)?;
        let r = if up.as_os_str().is_empty() {
            rustix::fs::unlinkat(parent, last, AtFlags::REMOVEDIR)
        } else {
            let up = beneath::open_dir_beneath(parent, up)?;
            rustix::fs::unlinkat(&up, last, AtFlags::REMOVEDIR)
        };
        match r {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The names in the open directory `dir` (without `.` and `..`), read through a descriptor of
/// its own that is closed before they are returned.
fn names(dir: impl AsFd) -> io::Result<Vec<OsString>> {
    let mut out = Vec::new();
    for entry in rustix::fs::Dir::read_from(dir)? {
        let entry = entry?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        if name != "." && name != ".." {
            out.push(name.to_os_string());
        }
    }
    Ok(out)
}

/// Fsyncs the directory `rel` beneath `root`, so that the renames and creations in it are
/// durable.
pub fn fsync_dir(root: impl AsFd, rel: &Path) -> Result<(), FileError> {
    let dir = beneath::open_dir_beneath(root, rel).map_err(FileError::dst("open directory"))?;
    rustix::fs::fsync(&dir).map_err(|e| FileError::io("fsync directory")(e.into()))
}

#[cfg(test)]
// Tests may unwrap: a panic is the failure report there (clippy.toml allows it in #[test]
// functions; this attribute covers the helpers of the module too).
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::{symlink, PermissionsExt};

    /// DST with `sub/deep/f`, and outside it a directory that symlinks in DST point to.
    fn tree() -> (tempfile::TempDir, PathBuf, PathBuf, OwnedFd) {
        let t = tempfile::tempdir().unwrap();
        let (dst, outside) = (t.path().join("dst"), t.path().join("outside"));
        fs::create_dir_all(dst.join("sub/deep")).unwrap();
        fs::write(dst.join("sub/deep/f"), b"f").unwrap();
        fs::create_dir_all(outside.join("keep")).unwrap();
        fs::write(outside.join("secret"), b"secret").unwrap();
        fs::write(outside.join("keep/k"), b"k").unwrap();
        let root = beneath::open_root(&dst).unwrap();
        (t, dst, outside, root)
    }

    fn listing(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn nothing_is_made_or_removed_through_a_symlinked_directory() {
        beneath::both_ways(|| {
            let (_t, dst, outside, root) = tree();
            symlink(&outside, dst.join("link")).unwrap();
            let e = make_dir(&root, Path::new("link/new"), 0o755, false).unwrap_err();
            assert!(matches!(e, FileError::NotFollowed { .. }), "{e}");
            for rel in ["link/secret", "link/keep", "link/keep/k"] {
                let e = remove(&root, Path::new(rel)).unwrap_err();
                assert!(beneath::is_not_followed(&e), "{rel}: {e}");
            }
            assert!(fsync_dir(&root, Path::new("link")).is_err());
            assert_eq!(listing(&outside), ["keep", "secret"]);
            assert_eq!(fs::read(outside.join("keep/k")).unwrap(), b"k");
            // The link itself is an entry of DST: removed as a link, its target untouched.
            assert!(remove(&root, Path::new("link")).unwrap());
            assert_eq!(listing(&outside), ["keep", "secret"]);
        });
    }

    #[test]
    fn make_dir_sets_the_mode_and_replaces_a_link_without_following_it() {
        beneath::both_ways(|| {
            let (_t, dst, outside, root) = tree();
            fs::set_permissions(&outside, fs::Permissions::from_mode(0o755)).unwrap();
            symlink(&outside, dst.join("d")).unwrap();
            make_dir(&root, Path::new("d"), 0o750, true).unwrap();
            let m = fs::symlink_metadata(dst.join("d")).unwrap();
            assert!(m.is_dir());
            assert_eq!(m.permissions().mode() & 0o7777, 0o750);
            // The directory the link pointed to kept its mode.
            let m = fs::metadata(&outside).unwrap();
            assert_eq!(m.permissions().mode() & 0o7777, 0o755);
            // An existing directory is kept, with the new mode (owner rwx always).
            make_dir(&root, Path::new("sub"), 0o500, false).unwrap();
            let m = fs::metadata(dst.join("sub")).unwrap();
            assert_eq!(m.permissions().mode() & 0o7777, 0o700);
            assert!(dst.join("sub/deep/f").exists());
        });
    }

    #[test]
    fn remove_tree_removes_links_as_links_and_deep_trees() {
        beneath::both_ways(|| {
            let (_t, dst, outside, root) = tree();
            symlink(&outside, dst.join("sub/deep/to-outside")).unwrap();
            symlink(outside.join("secret"), dst.join("sub/to-secret")).unwrap();
            let mut deep = dst.join("sub");
            for i in 0..50 {
                deep.push(format!("level{i}"));
            }
            fs::create_dir_all(&deep).unwrap();
            fs::write(deep.join("bottom"), b"b").unwrap();
            assert!(remove(&root, Path::new("sub")).unwrap());
            assert!(!dst.join("sub").exists());
            assert_eq!(listing(&dst), Vec::<String>::new());
            assert_eq!(listing(&outside), ["keep", "secret"]);
            assert_eq!(fs::read(outside.join("secret")).unwrap(), b"secret");
            assert!(!remove(&root, Path::new("sub")).unwrap(), "already gone");
        });
    }
}
