//! Writing the `.npy/` tree as real files (`stagefs convert --to npy`): every byte comes from
//! the same [`View::read_at`] the mount serves, so the two are identical by construction.
//!
//! Each file is written to a hidden temporary name next to its destination and renamed into
//! place when complete, so an interrupted run never leaves a partial file under a final name.
//! Chunks of a file are rendered in parallel (rayon) and written with positioned writes.
//!
//! Every temporary that exists is listed in [`TEMPORARIES`] (created and removed under its
//! lock), so a process stopped by a signal can remove them all before it exits
//! ([`remove_temporaries_and_freeze`]): a `convert` stopped by SIGTERM leaves no hidden
//! `.NAME.stagefs-tmp` behind.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use rayon::prelude::*;

use crate::error::ViewError;
use crate::viewset::{ViewKind, ViewSet};

/// The temporaries this process has created and not yet renamed or removed.
static TEMPORARIES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn temporaries() -> MutexGuard<'static, Vec<PathBuf>> {
    // A panic elsewhere while holding the lock leaves the list itself intact.
    TEMPORARIES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes every temporary this process has open and keeps the list locked for good, so no
/// thread can create another: for a signal handler thread, just before the process exits.
pub fn remove_temporaries_and_freeze() {
    let guard = temporaries();
    for path in guard.iter() {
        let _ = fs::remove_file(path);
    }
    std::mem::forget(guard);
}

/// Smallest unit of parallel work (bytes): keeps per-task overhead small for column files.
const MIN_CHUNK: u64 = 1 << 20;

/// One output file.
#[derive(Clone, Debug)]
pub struct Planned {
    /// Path under `.npy/` (and under the output directory).
    pub rel: PathBuf,
    /// Size in bytes.
    pub len: u64,
}

/// What [`plan`] found: files to write, and inputs that cannot be viewed at all.
#[derive(Debug, Default)]
pub struct Plan {
    /// Directories to create (relative), parents first.
    pub dirs: Vec<PathBuf>,
    /// Files to write.
    pub files: Vec<Planned>,
    /// (source path, reason) of tables that could not be opened.
    pub bad: Vec<(PathBuf, String)>,
}

impl Plan {
    /// Total bytes of all files.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.len).sum()
    }
}

/// Which image views a plan includes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Levels {
    /// The image folder at the root only (the folder `convert` was given), tables anywhere:
    /// an ancestor's or a class folder's `images.npy` repeats the same pixels.
    Root,
    /// Every level, as the mount shows them.
    All,
}

/// Lists the directories and files of the `.npy/` tree to write (opens tables to learn their
/// columns). Directories with nothing to write are left out.
pub fn plan(set: &ViewSet, levels: Levels) -> Result<Plan, ViewError> {
    let mut plan = Plan::default();
    walk(set, PathBuf::new(), levels, &mut plan)?;
    Ok(plan)
}

fn walk(set: &ViewSet, rel: PathBuf, levels: Levels, plan: &mut Plan) -> Result<(), ViewError> {
    let entries = match set.read_dir(&rel) {
        Ok(e) => e,
        Err(ViewError::Corrupt { path, reason }) | Err(ViewError::Unsupported { path, reason }) => {
            plan.bad.push((path, reason));
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let (dirs_before, files_before) = (plan.dirs.len(), plan.files.len());
    plan.dirs.push(rel.clone());
    let is_table_dir = set.tree().dir(&rel).is_none();
    for e in entries {
        let child = rel.join(&e.name);
        match e.kind {
            ViewKind::Dir => walk(set, child, levels, plan)?,
            ViewKind::File(len) => {
                // Image-folder files sit in mirrored directories; a table's files in its own.
                let image_file = !is_table_dir;
                if image_file && levels == Levels::Root && !rel.as_os_str().is_empty() {
                    continue;
                }
                plan.files.push(Planned { rel: child, len })
            }
        }
    }
    if plan.files.len() == files_before && !rel.as_os_str().is_empty() {
        plan.dirs.truncate(dirs_before);
    }
    Ok(())
}

/// Writes `file` under `out`; `progress(bytes)` is called as chunks land. A corrupt input
/// (table, or image in strict mode) fails this file only and leaves no output for it.
pub fn write_file(
    set: &ViewSet,
    out: &Path,
    file: &Planned,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(), ViewError> {
    let view = set.open(&file.rel)?;
    let dest = out.join(&file.rel);
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dest.with_file_name(format!(".{name}.stagefs-tmp"));
    let result = (|| {
        let f = {
            let mut live = temporaries();
            let f = File::create(&tmp)?;
            live.push(tmp.clone());
            f
        };
        let len = view.len();
        f.set_len(len)?;
        let chunk = view.chunk_len().max(MIN_CHUNK);
        let chunks: Vec<u64> = (0..len.div_ceil(chunk)).collect();
        chunks
            .par_iter()
            .try_for_each(|&i| -> Result<(), ViewError> {
                let off = i * chunk;
                let mut buf = vec![0u8; chunk.min(len - off) as usize];
                let n = view.read_at(off, &mut buf)?;
                if n != buf.len() {
                    return Err(ViewError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "{} ended at {} of {len} bytes",
                            file.rel.display(),
                            off + n as u64
                        ),
                    )));
                }
                f.write_all_at(&buf, off)?;
                progress(n as u64);
                Ok(())
            })?;
        f.sync_all()?;
        let mut live = temporaries();
        fs::rename(&tmp, &dest)?;
        live.retain(|p| p != &tmp);
        Ok(())
    })();
    if result.is_err() {
        let mut live = temporaries();
        let _ = fs::remove_file(&tmp);
        live.retain(|p| p != &tmp);
    }
    result
}

/// Creates the plan's directories under `out`.
pub fn create_dirs(plan: &Plan, out: &Path) -> io::Result<()> {
    for d in &plan.dirs {
        fs::create_dir_all(out.join(d))?;
    }
    Ok(())
}
