//! The atomic copy of one file or symlink, with torn-write detection.
//!
//! Install protocol: open the destination directory beneath DST's root ([`crate::dst`]), create
//! `.stagefs-tmp.*` in it through that descriptor (`O_CREAT | O_EXCL | O_NOFOLLOW`), copy the
//! bytes (the kernel's `copy_file_range` via `std::io::copy`), set mode and mtime, fsync, and
//! `renameat` it over the final name from and to the same descriptor: a symlink swapped into
//! DST after planning can neither receive the temporary nor redirect the rename. The caller
//! fsyncs the directory once per pass (the rename is atomic without it; the directory fsync
//! only makes it durable, and one per directory instead of one per file keeps many small files
//! fast).
//!
//! Opening: the source is opened beneath the planned SRC root without following any symlink
//! ([`crate::beneath`]) and the descriptor is checked against the plan before a byte is
//! copied: it must be a regular file, and the same inode as planned. A symlink, FIFO, device
//! or directory swapped in after planning is skipped (the next pass plans it afresh: a link is
//! then copied as a link). A file replaced by another regular file — a checkpoint saved by
//! write-and-rename, the usual way — is copied as a new version only if it has the planned
//! file's owner, so a file of another user swapped in (a root-run sync, a shared SRC
//! directory) is never copied in its place; it must settle on its own (its planning stamp is
//! not its witness).
//!
//! Torn-write detection: the source is fstat'ed before and after the copy; size, mtime, ctime
//! and inode must not change and the byte count must equal the size. Two gaps remain, and both
//! are closed by copying a file only once its stamp has "settled": its mtime is more than
//! [`SETTLE`] in the past, or the same stamp was already seen at least [`SETTLE`] earlier (the
//! stamp from planning counts).
//! - Linux stamps mtime from a coarse clock (one tick, up to 10 ms), so a write in the same tick
//!   as our first fstat would not move mtime; after a settled stamp, any write lands in a later
//!   tick and changes it.
//! - A writer can pause in the middle of a file (page-cache throttling in the kernel sleeps
//!   writers up to 200 ms, and a loaded node deschedules them); a file whose stamp has not
//!   moved for 1 s is taken as finished, the same rule that makes a file "settled".
//!
//! A file that keeps changing is retried [`MAX_ATTEMPTS`] times, then reported as failed; the
//! destination keeps its old, complete version and the next pass tries again.

use crate::beneath;
use crate::dst;
use crate::error::FileError;
use crate::plan::DstKind;
use crate::stamp::Stamp;
use crate::temp;
use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;
use std::ffi::{OsStr, OsString};
use std::fs::{File, FileTimes, Permissions};
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

/// How long a stamp must stay unchanged before a copy trusts it (see the module note).
pub const SETTLE: Duration = Duration::from_secs(1);

/// Copy attempts for a file that keeps changing.
pub const MAX_ATTEMPTS: u32 = 3;

/// How long one attempt waits for a changing file to settle. With [`MAX_ATTEMPTS`] and the
/// backoff this bounds the time a file written without pause (a log) holds a copy thread to
/// about 8 s per pass.
const SETTLE_WAIT_MAX: Duration = Duration::from_millis(2500);

/// How often a settling file's stamp is looked at.
const POLL: Duration = Duration::from_millis(100);

/// Pause before the second attempt; doubles each time (0.25, 0.5 s).
const FIRST_BACKOFF: Duration = Duration::from_millis(250);

/// Bytes per `io::copy` call: large enough for full-speed `copy_file_range`, small enough for a
/// live progress bar on multi-GB checkpoints.
const CHUNK: u64 = 8 << 20;

/// What a successful file copy did.
#[derive(Debug, Clone, Copy)]
pub struct Copied {
    /// Bytes installed.
    pub bytes: u64,
    /// Attempts discarded because the source changed during them.
    pub retries: u32,
}

/// Result of one file copy that did not fail.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The new version is in place.
    Copied(Copied),
    /// The source disappeared before it could be copied (not an error: e.g. a rotated checkpoint).
    Vanished,
    /// The path no longer holds the planned file in a way that may be copied (why): a symlink,
    /// a FIFO or a file of another owner swapped in. Nothing was copied; the next pass plans it
    /// afresh.
    Skipped(String),
}

/// Attempts at an unused random temporary name (a collision means someone planted the name).
const CREATE_TRIES: u32 = 4;

/// A temporary of this process in an open destination directory: held (see [`temp::hold`])
/// until renamed into place, removed through the same descriptor on drop otherwise.
struct TempGuard<'d> {
    dir: BorrowedFd<'d>,
    name: OsString,
    /// Whether the temporary exists and is ours to remove.
    armed: bool,
}

impl<'d> TempGuard<'d> {
    fn new(dir: BorrowedFd<'d>, name: OsString) -> TempGuard<'d> {
        temp::hold(&name);
        TempGuard {
            dir,
            name,
            armed: false,
        }
    }
}

impl Drop for TempGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = rustix::fs::unlinkat(self.dir, self.name.as_os_str(), AtFlags::empty());
        }
        temp::release(&self.name);
    }
}

/// Creates a fresh temporary for `name` in the open directory `dir`.
fn create_temp<'d>(dir: BorrowedFd<'d>, name: &OsStr) -> Result<(File, TempGuard<'d>), FileError> {
    let mut tries = 0;
    loop {
        // Held before it exists, so that no concurrent pass of this process judges it stale.
        let mut guard = TempGuard::new(dir, temp::temp_name(name));
        // O_EXCL: never opens an existing file, nor follows a symlink planted under the name.
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        match rustix::fs::openat(
            dir,
            guard.name.as_os_str(),
            flags,
            Mode::from_raw_mode(0o600),
        ) {
            Ok(fd) => {
                guard.armed = true;
                return Ok((File::from(fd), guard));
            }
            // Not ours (someone planted the name): another random name.
            Err(Errno::EXIST) if tries + 1 < CREATE_TRIES => tries += 1,
            Err(e) => {
                return Err(FileError::io("create temporary in destination directory")(
                    e.into(),
                ))
            }
        }
    }
}

/// Moves the temporary over `name` in its directory (`renameat` within the one descriptor),
/// first removing a directory that occupies the name.
fn install(guard: &mut TempGuard<'_>, name: &OsStr, kind: DstKind) -> Result<(), FileError> {
    if kind == DstKind::Dir {
        dst::remove_tree(guard.dir, name).map_err(FileError::dst("remove directory in the way"))?;
    }
    // On failure the guard removes the temporary.
    rustix::fs::renameat(guard.dir, guard.name.as_os_str(), guard.dir, name)
        .map_err(|e| FileError::io("rename into place")(e.into()))?;
    guard.armed = false;
    Ok(())
}

/// Why an opened source may not be copied in place of the planned one, if it may not.
fn refuse(opened: &Stamp, is_file: bool, planned: &Stamp) -> Option<String> {
    if !is_file {
        return Some("is no longer a regular file (swapped after planning); not copied".into());
    }
    if !opened.same_inode(planned) && opened.uid != planned.uid {
        return Some(format!(
            "was replaced after planning by a file of another owner (uid {}, planned uid {}); \
             not copied",
            opened.uid, planned.uid
        ));
    }
    None
}

/// Copies the file `rel` beneath `root` (the source root opened for planning) to `rel`
/// beneath `dst_root` (the destination root opened for planning) atomically.
/// `planned`/`seen_at` are the stamp from planning and when it was taken; `progress` is called
/// with byte counts as they are copied.
pub fn copy_file(
    root: impl AsFd,
    rel: &Path,
    dst_root: impl AsFd,
    kind: DstKind,
    planned: Stamp,
    seen_at: Instant,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Outcome, FileError> {
    let (dir, name) =
        dst::open_parent(dst_root, rel).map_err(FileError::dst("open destination directory"))?;
    let mut witness = Some((planned, seen_at));
    let mut backoff = FIRST_BACKOFF;
    for attempt in 0..MAX_ATTEMPTS {
        if attempt > 0 {
            std::thread::sleep(backoff);
            backoff *= 2;
        }
        let mut source = match beneath::open_file_beneath(root.as_fd(), rel) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Outcome::Vanished),
            Err(e) if beneath::is_not_followed(&e) => {
                return Ok(Outcome::Skipped(
                    "a symlink is now on its path (swapped in after planning); not followed".into(),
                ))
            }
            Err(e) => return Err(FileError::io("open source")(e)),
        };
        let meta = source.metadata().map_err(FileError::io("stat source"))?;
        let opened = Stamp::of(&meta);
        if let Some(why) = refuse(&opened, meta.is_file(), &planned) {
            return Ok(Outcome::Skipped(why));
        }
        // A new version (write-and-rename) is not witnessed by the planned stamp (settle
        // compares whole stamps, inode included): it has to settle on its own.
        let Some(before) = settle(&source, &mut witness)? else {
            continue;
        };
        let (mut tmp, mut guard) = create_temp(dir.as_fd(), name)?;
        let mut copied = 0u64;
        loop {
            let n = io::copy(&mut (&mut source).take(CHUNK), &mut tmp)
                .map_err(FileError::io("copy data"))?;
            if n == 0 {
                break;
            }
            copied += n;
            progress(n);
        }
        let after = Stamp::of(&source.metadata().map_err(FileError::io("stat source"))?);
        if after != before || copied != before.size {
            // Torn: the source changed under us. Drop the temporary and try again; the
            // progress already reported is counted again, which only overstates the bar.
            witness = Some((after, Instant::now()));
            continue;
        }
        let times = FileTimes::new()
            .set_modified(before.mtime())
            .set_accessed(SystemTime::now());
        tmp.set_permissions(Permissions::from_mode(before.copy_mode()))
            .map_err(FileError::io("set mode"))?;
        tmp.set_times(times).map_err(FileError::io("set mtime"))?;
        tmp.sync_all().map_err(FileError::io("fsync"))?;
        drop(tmp);
        install(&mut guard, name, kind)?;
        return Ok(Outcome::Copied(Copied {
            bytes: copied,
            retries: attempt,
        }));
    }
    Err(FileError::KeptChanging {
        attempts: MAX_ATTEMPTS,
    })
}

/// Waits until the open source's stamp is settled (see the module note) and returns it; `None`
/// if it kept changing for [`SETTLE_WAIT_MAX`] (the attempt then counts as failed).
fn settle(
    source: &File,
    witness: &mut Option<(Stamp, Instant)>,
) -> Result<Option<Stamp>, FileError> {
    let deadline = Instant::now() + SETTLE_WAIT_MAX;
    loop {
        let now_wall = SystemTime::now();
        let now = Instant::now();
        let stamp = Stamp::of(&source.metadata().map_err(FileError::io("stat source"))?);
        let old_enough = now_wall
            .duration_since(stamp.mtime())
            .is_ok_and(|age| age >= SETTLE);
        let witnessed = witness
            .as_ref()
            .is_some_and(|(w, at)| *w == stamp && now.duration_since(*at) >= SETTLE);
        if old_enough || witnessed {
            return Ok(Some(stamp));
        }
        if !witness.as_ref().is_some_and(|(w, _)| *w == stamp) {
            *witness = Some((stamp, now));
        }
        if now >= deadline {
            return Ok(None);
        }
        std::thread::sleep(POLL);
    }
}

/// Makes `rel` beneath `dst_root` a symlink to `target` atomically (link under a temporary
/// name, then `renameat`, both in the one directory descriptor).
pub fn copy_symlink(
    target: &Path,
    dst_root: impl AsFd,
    rel: &Path,
    kind: DstKind,
) -> Result<(), FileError> {
    let (dir, name) =
        dst::open_parent(dst_root, rel).map_err(FileError::dst("open destination directory"))?;
    let mut guard = TempGuard::new(dir.as_fd(), temp::temp_name(name));
    // symlinkat(2) fails on an existing name: like O_EXCL.
    rustix::fs::symlinkat(target, &dir, guard.name.as_os_str())
        .map_err(|e| FileError::io("create symlink")(e.into()))?;
    guard.armed = true;
    install(&mut guard, name, kind)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};

    use std::os::fd::OwnedFd;
    use std::path::PathBuf;

    /// `t/s/f` (the source file, not yet written) and `t/d/f` (its destination), with the two
    /// roots opened.
    fn roots(t: &tempfile::TempDir) -> (PathBuf, PathBuf, OwnedFd, OwnedFd) {
        let (s, d) = (t.path().join("s"), t.path().join("d"));
        std::fs::create_dir_all(&s).unwrap();
        std::fs::create_dir_all(&d).unwrap();
        let (sr, dr) = (
            beneath::open_root(&s).unwrap(),
            beneath::open_root(&d).unwrap(),
        );
        (s.join("f"), d.join("f"), sr, dr)
    }

    fn dated(path: &Path, secs_ago: u64) -> Stamp {
        let f = File::options().write(true).open(path).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(secs_ago))
            .unwrap();
        Stamp::of(&f.metadata().unwrap())
    }

    /// A write that lands while the bytes are being copied (injected from the progress callback,
    /// so it is certain to fall inside the copy) discards the attempt; the retry installs the
    /// file as it is after the write.
    #[test]
    fn change_during_copy_is_retried_not_installed() {
        let t = tempfile::tempdir().unwrap();
        let (src, dst, sroot, droot) = roots(&t);
        std::fs::write(&src, vec![1u8; 3 * CHUNK as usize]).unwrap();
        let planned = dated(&src, 10);
        let appended = AtomicBool::new(false);
        let progress = |_n: u64| {
            if !appended.swap(true, Ordering::SeqCst) {
                let mut f = File::options().append(true).open(&src).unwrap();
                f.write_all(b"tail").unwrap();
            }
        };
        let out = copy_file(
            &sroot,
            Path::new("f"),
            &droot,
            DstKind::Missing,
            planned,
            Instant::now(),
            &progress,
        )
        .unwrap();
        let Outcome::Copied(c) = out else {
            panic!("expected a copy, got {out:?}")
        };
        assert_eq!(c.retries, 1);
        assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&src).unwrap());
        // No temporaries were left behind by the discarded attempt.
        let names: Vec<_> = std::fs::read_dir(dst.parent().unwrap()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    /// A file still changing through every attempt is reported, and nothing is installed.
    #[test]
    fn file_that_never_settles_fails_and_keeps_old_version() {
        let t = tempfile::tempdir().unwrap();
        let (src, dst, sroot, droot) = roots(&t);
        std::fs::write(&src, b"new").unwrap();
        std::fs::write(&dst, b"old").unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let writer = {
            let (stop, src) = (stop.clone(), src.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let mut f = File::options().append(true).open(&src).unwrap();
                    f.write_all(b".").unwrap();
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        let stamp = Stamp::of(&std::fs::metadata(&src).unwrap());
        let r = copy_file(
            &sroot,
            Path::new("f"),
            &droot,
            DstKind::Other,
            stamp,
            Instant::now(),
            &|_| {},
        );
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert!(matches!(r, Err(FileError::KeptChanging { .. })), "{r:?}");
        assert_eq!(std::fs::read(&dst).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dst.parent().unwrap()).unwrap().count(), 1);
    }

    #[test]
    fn mode_and_mtime_are_kept() {
        let t = tempfile::tempdir().unwrap();
        let (src, dst, sroot, droot) = roots(&t);
        std::fs::write(&src, b"x").unwrap();
        std::fs::set_permissions(&src, Permissions::from_mode(0o640)).unwrap();
        let stamp = dated(&src, 100);
        copy_file(
            &sroot,
            Path::new("f"),
            &droot,
            DstKind::Missing,
            stamp,
            Instant::now(),
            &|_| {},
        )
        .unwrap();
        let got = Stamp::of(&std::fs::metadata(&dst).unwrap());
        assert_eq!(got.mode, 0o640);
        assert!(stamp.same_version(&got));
    }
}
