//! The atomic copy of one file or symlink, with torn-write detection.
//!
//! Install protocol: create `DIR/.stagefs-tmp.*` exclusively, copy the bytes (the kernel's
//! `copy_file_range` via `std::io::copy`), set mode and mtime, fsync, rename over the final name.
//! The caller fsyncs the directory once per pass (the rename is atomic without it; the directory
//! fsync only makes it durable, and one per directory instead of one per file keeps many small
//! files fast).
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
use crate::error::FileError;
use crate::plan::DstKind;
use crate::stamp::Stamp;
use crate::temp;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, FileTimes, OpenOptions, Permissions};
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
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

/// A temporary of this process: held (see [`temp::hold`]) until renamed into place, removed on
/// drop otherwise.
struct TempGuard {
    path: Option<PathBuf>,
    name: OsString,
}

impl TempGuard {
    fn new(dir: &Path, name: OsString) -> TempGuard {
        temp::hold(&name);
        TempGuard {
            path: Some(dir.join(&name)),
            name,
        }
    }
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = fs::remove_file(p);
        }
        temp::release(&self.name);
    }
}

fn split(dst: &Path) -> io::Result<(&Path, &std::ffi::OsStr)> {
    match (dst.parent(), dst.file_name()) {
        (Some(dir), Some(name)) => Ok((dir, name)),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "destination has no parent directory",
        )),
    }
}

fn create_temp(dir: &Path, name: &OsStr) -> Result<(File, TempGuard), FileError> {
    let mut tries = 0;
    loop {
        let tmp = temp::temp_name(name);
        // Held before it exists, so that no concurrent pass of this process judges it stale.
        let guard = TempGuard::new(dir, tmp);
        let path = dir.join(&guard.name);
        // create_new is O_CREAT | O_EXCL: never opens an existing file or follows a symlink.
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .mode(0o600)
            .open(&path)
        {
            Ok(file) => return Ok((file, guard)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries + 1 < CREATE_TRIES => {
                // Not ours: keep the guard from removing it.
                let mut guard = guard;
                guard.path = None;
                tries += 1;
            }
            Err(e) => {
                let mut guard = guard;
                guard.path = None;
                return Err(FileError::io("create temporary in destination directory")(
                    e,
                ));
            }
        }
    }
}

/// Moves the temporary over `dst`, first removing a directory that occupies the name.
fn install(guard: &mut TempGuard, dst: &Path, kind: DstKind) -> Result<(), FileError> {
    if kind == DstKind::Dir {
        fs::remove_dir_all(dst).map_err(FileError::io("remove directory in the way"))?;
    }
    let tmp = guard.path.take().ok_or(FileError::Io {
        op: "rename into place",
        source: io::Error::other("temporary already consumed"),
    })?;
    if let Err(e) = fs::rename(&tmp, dst) {
        let _ = fs::remove_file(&tmp);
        return Err(FileError::io("rename into place")(e));
    }
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

/// Copies the file `rel` beneath `root` (the source root opened for planning) to `dst`
/// atomically. `planned`/`seen_at` are the stamp from planning and when it was taken;
/// `progress` is called with byte counts as they are copied.
pub fn copy_file(
    root: impl AsFd,
    rel: &Path,
    dst: &Path,
    kind: DstKind,
    planned: Stamp,
    seen_at: Instant,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Outcome, FileError> {
    let (dir, name) = split(dst).map_err(FileError::io("destination path"))?;
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
        let (mut tmp, mut guard) = create_temp(dir, name)?;
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
        install(&mut guard, dst, kind)?;
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

/// Makes `dst` a symlink to `target` atomically (link under a temporary name, then rename).
pub fn copy_symlink(target: &Path, dst: &Path, kind: DstKind) -> Result<(), FileError> {
    let (dir, name) = split(dst).map_err(FileError::io("destination path"))?;
    let mut guard = TempGuard::new(dir, temp::temp_name(name));
    let tmp = dir.join(&guard.name);
    // symlink(2) fails on an existing name: like O_EXCL.
    if let Err(e) = std::os::unix::fs::symlink(target, &tmp) {
        guard.path = None;
        return Err(FileError::io("create symlink")(e));
    }
    install(&mut guard, dst, kind)
}

/// Fsyncs a directory so that renames and creations in it are durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn root(t: &tempfile::TempDir) -> std::os::fd::OwnedFd {
        beneath::open_root(t.path()).unwrap()
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
        let (src, dst) = (t.path().join("src"), t.path().join("dst"));
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
            root(&t),
            Path::new("src"),
            &dst,
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
        let names: Vec<_> = std::fs::read_dir(t.path()).unwrap().collect();
        assert_eq!(names.len(), 2);
    }

    /// A file still changing through every attempt is reported, and nothing is installed.
    #[test]
    fn file_that_never_settles_fails_and_keeps_old_version() {
        let t = tempfile::tempdir().unwrap();
        let (src, dst) = (t.path().join("src"), t.path().join("dst"));
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
            root(&t),
            Path::new("src"),
            &dst,
            DstKind::Other,
            stamp,
            Instant::now(),
            &|_| {},
        );
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert!(matches!(r, Err(FileError::KeptChanging { .. })), "{r:?}");
        assert_eq!(std::fs::read(&dst).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 2);
    }

    #[test]
    fn mode_and_mtime_are_kept() {
        let t = tempfile::tempdir().unwrap();
        let (src, dst) = (t.path().join("src"), t.path().join("dst"));
        std::fs::write(&src, b"x").unwrap();
        std::fs::set_permissions(&src, Permissions::from_mode(0o640)).unwrap();
        let stamp = dated(&src, 100);
        copy_file(
            root(&t),
            Path::new("src"),
            &dst,
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
