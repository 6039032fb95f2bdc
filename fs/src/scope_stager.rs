//! The thread that stages a node's declared part ([`crate::scope`]) into the cache whenever it
//! changes: the declared blocks of each file, fed to the fetcher's staging queue as it drains.
//! Apart from the scope itself so that the scope (which [`Files`] holds, to keep speculation
//! inside it) does not depend on `Files`.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use stagefs_prefetch::fetch::Priority;
use stagefs_prefetch::staging::FEED_DEPTH;
use tracing::info;

use crate::files::Files;

/// How often the stager looks for a changed scope or the stop flag: 50 ms, so a new epoch's
/// part starts staging at once and declarations sent as many lines are taken as one.
const TICK: Duration = Duration::from_millis(50);

/// Starts the thread that stages the declared scope into the cache whenever it changes (until
/// `stop`), if the declared bytes fit in `capacity`.
pub fn spawn_stager(
    files: Arc<Files>,
    capacity: u64,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("stagefs-stage-scope".into())
        .spawn(move || {
            let scope = files.scope();
            let mut done = 0u64;
            loop {
                if stop.load(Relaxed) {
                    return;
                }
                let v = scope.version();
                if v == done || !scope.is_active() {
                    std::thread::sleep(TICK);
                    continue;
                }
                // Declarations come as many lines (a line per file from a Sampler, from every
                // rank): start once they have stopped changing for a tick, not once per line.
                std::thread::sleep(TICK);
                if scope.version() != v {
                    continue;
                }
                done = v;
                let list = scope.files();
                let total: u64 = list.iter().map(|(_, b)| b).sum();
                if total > capacity {
                    info!(
                        total,
                        capacity, "declared part larger than the cache: not staged"
                    );
                    continue;
                }
                info!(
                    files = list.len(),
                    bytes = total,
                    "staging this node's part"
                );
                'files: for (node, _) in list {
                    for w in files.missing_blocks(node) {
                        // Woken as the workers take blocks; TICK is for the stop flag.
                        while !files
                            .fetcher()
                            .wait_for_room(Priority::Staging, FEED_DEPTH, TICK)
                        {
                            if stop.load(Relaxed) {
                                return;
                            }
                        }
                        if stop.load(Relaxed) {
                            return;
                        }
                        if scope.version() != done {
                            break 'files; // Changed: start over with the new scope.
                        }
                        files.fetcher().prefetch([w], Priority::Staging);
                    }
                }
            }
        })
}
