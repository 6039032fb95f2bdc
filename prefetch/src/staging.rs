//! Background staging: copy the whole tree into the cache while readers work, when it fits.
//!
//! The plan comes from the filesystem's metadata snapshot in directory order (names sorted, as
//! `ls` and ImageFolder walk them) and puts small files first: a training job that starts by
//! touching many small files benefits most, and one large file cannot hold up thousands of small
//! ones. The stager feeds the fetcher's staging queue a little at a time ([`FEED_DEPTH`]
//! blocks), so the queue stays bounded; the fetcher runs staging on its worker pool beside
//! read-ahead. The stager waits for room on the fetcher's condition variable (woken as workers
//! take blocks), not in a sleep loop.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::info;

use crate::fetch::{Fetcher, Priority, Want};
use crate::SMALL_FILE;

/// Staging blocks queued at once: four per default worker, so the pool never runs dry between
/// two feeds while the queue stays small.
pub const FEED_DEPTH: usize = 128;
/// How long the stager waits for room in the queue before it looks at the stop flag: the
/// workers wake it as they take blocks, so this only bounds how late it sees a stop.
const STOP_CHECK: Duration = Duration::from_millis(100);

/// Orders `(item, size)` pairs given in directory order for staging: small files first, each
/// group keeping the directory order.
pub fn order<T>(files: Vec<(T, u64)>) -> Vec<T> {
    let (small, large): (Vec<_>, Vec<_>) = files.into_iter().partition(|(_, s)| *s <= SMALL_FILE);
    small.into_iter().chain(large).map(|(t, _)| t).collect()
}

/// The blocks to fetch for one planned item (computed when the stager reaches it, so entries
/// are created as staging goes rather than all at once).
pub type WantsOf<T> = Arc<dyn Fn(&T) -> Vec<Want> + Send + Sync>;

/// Starts staging into the cache: `plan` (run on the staging thread, since ordering a
/// million-file tree takes a while and the mount need not wait for it) gives the items in
/// order and their total bytes, or `None` when there is nothing to stage.
pub fn spawn<T: Send + 'static>(
    fetcher: Fetcher,
    plan: impl FnOnce() -> Option<(Vec<T>, u64)> + Send + 'static,
    wants: WantsOf<T>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("stagefs-stage".into())
        .spawn(move || {
            let Some((plan, total)) = plan() else { return };
            fetcher.stats().staging_target.store(total, Relaxed);
            info!(
                files = plan.len(),
                bytes = total,
                "staging the tree in the background"
            );
            for item in plan {
                for w in wants(&item) {
                    // Woken as the workers take blocks; the timeout is for the stop flag.
                    while !fetcher.wait_for_room(Priority::Staging, FEED_DEPTH, STOP_CHECK) {
                        if stop.load(Relaxed) {
                            return;
                        }
                    }
                    if stop.load(Relaxed) {
                        return;
                    }
                    fetcher.prefetch([w], Priority::Staging);
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BLOCK_SIZE;

    #[test]
    fn small_files_first_in_directory_order() {
        let plan = order(vec![
            ("a/big", 10 * BLOCK_SIZE),
            ("a/x", 10),
            ("b/big", 5 * BLOCK_SIZE),
            ("b/y", 20),
        ]);
        assert_eq!(plan, vec!["a/x", "b/y", "a/big", "b/big"]);
    }
}
