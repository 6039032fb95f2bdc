//! Background staging: copy the whole tree into the cache while readers work, when it fits.
//!
//! The plan walks the source in directory order (names sorted, as `ls` shows them) and puts
//! small files first: a training job that starts by touching many small files benefits most,
//! and one large file cannot hold up thousands of small ones. The stager feeds the fetcher's
//! staging queue a little at a time ([`FEED_DEPTH`] blocks), so the queue stays bounded and the
//! fetcher, which runs staging only when no reader is waiting, is never flooded.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::info;

use crate::fetch::{Fetcher, Priority};
use crate::source::Signature;
use crate::{block_count, BLOCK_SIZE};

/// Files up to this size are staged in the first pass.
pub const SMALL_FILE: u64 = 4 * BLOCK_SIZE;
/// Staging blocks queued at once.
pub const FEED_DEPTH: usize = 64;

/// The files to stage, in order, and their total size.
#[derive(Debug, Default)]
pub struct StagingPlan {
    /// Paths relative to the source root with the signature seen while planning.
    pub files: Vec<(PathBuf, Signature)>,
    /// Sum of the files' sizes.
    pub total: u64,
}

/// Walks `root` (no symlinks followed) and orders its regular files for staging.
pub fn plan(root: &Path) -> StagingPlan {
    let mut all = Vec::new();
    walk(root, Path::new(""), &mut all);
    let total = all.iter().map(|(_, s)| s.size).sum();
    let (mut files, large): (Vec<_>, Vec<_>) =
        all.into_iter().partition(|(_, s)| s.size <= SMALL_FILE);
    files.extend(large);
    StagingPlan { files, total }
}

fn walk(root: &Path, rel: &Path, out: &mut Vec<(PathBuf, Signature)>) {
    let Ok(dir) = std::fs::read_dir(root.join(rel)) else {
        return;
    };
    let mut entries: Vec<_> = dir.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let Ok(meta) = e.metadata() else { continue };
        let child = rel.join(e.file_name());
        if meta.is_dir() {
            walk(root, &child, out);
        } else if meta.is_file() {
            out.push((child, Signature::of(&meta)));
        }
    }
}

/// Starts staging `root` into the cache if the whole tree fits in `capacity`. Returns the
/// thread and the number of bytes it will stage (0 if it does not fit).
pub fn spawn(
    fetcher: Fetcher,
    root: PathBuf,
    capacity: u64,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("stagefs-stage".into())
        .spawn(move || {
            let plan = plan(&root);
            if plan.total > capacity {
                info!(
                    total = plan.total,
                    capacity, "tree larger than the cache: no background staging"
                );
                return;
            }
            fetcher.stats().staging_target.store(plan.total, Relaxed);
            info!(
                files = plan.files.len(),
                bytes = plan.total,
                "staging the tree in the background"
            );
            for (rel, sig) in plan.files {
                let rel: Arc<Path> = rel.into();
                for idx in 0..block_count(sig.size) {
                    while fetcher.queued(Priority::Staging) >= FEED_DEPTH {
                        if stop.load(Relaxed) {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    if stop.load(Relaxed) {
                        return;
                    }
                    fetcher.prefetch(&rel, sig, idx..idx + 1, Priority::Staging);
                }
            }
        })
}
