//! What the control socket's services get of a mount. Read-order hints ([`crate::hints`]) and
//! direct descriptors ([`crate::direct`]) run on threads of their own, beside the request path;
//! each gets a [`MountHandle`] (the files through the cache, the cache store, the counters,
//! whether the mount is stopping) and the few other parts it uses, never the core: they cannot
//! reach its handles, its stats file or its start and stop, and the core builds them in order
//! from its parts, before it exists itself.
//!
//! [`VerifyQueue`]: complete copies waiting for verification in the background. Opens that
//! find a copy complete but not trusted in this mount queue it (passthrough and direct reads
//! are only for trusted copies), and so does the cache as each copy completes; the mount's
//! verifier thread works through it (a `Trusted` record of an earlier mount first, then the
//! copy's bytes).

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use stagefs_prefetch::locks::lock;
use stagefs_prefetch::{CacheStore, EntryId, Stats};

use crate::files::Files;
use crate::snapshot::Snapshot;

/// At most one log line per this interval about a client's rejected lines (hints ignored,
/// direct opens refused): a broken client sends many, and one line a second says enough.
pub const LOG_EVERY: Duration = Duration::from_secs(1);

/// The part of a mount the control socket's services may use.
#[derive(Clone)]
pub struct MountHandle {
    files: Arc<Files>,
    stop: Arc<AtomicBool>,
}

impl MountHandle {
    /// A handle of the mount serving `files`, stopping once `stop` is set.
    pub fn new(files: Arc<Files>, stop: Arc<AtomicBool>) -> MountHandle {
        MountHandle { files, stop }
    }

    /// The source files through the cache (read state, prefetch, pushes, the declared part).
    pub fn files(&self) -> &Arc<Files> {
        &self.files
    }

    /// The metadata snapshot being served (paths to nodes, attributes).
    pub fn snapshot_ref(&self) -> &Arc<Snapshot> {
        self.files.snapshot()
    }

    /// The cache store (what is cached, pins, verification).
    pub fn store(&self) -> &Arc<CacheStore> {
        self.files.fetcher().store()
    }

    /// The live counters.
    pub fn stats(&self) -> &Arc<Stats> {
        self.files.fetcher().stats()
    }

    /// Whether the mount has begun to stop.
    pub fn stopped(&self) -> bool {
        self.stop.load(Relaxed)
    }
}

/// Complete copies queued for verification in the background (see the module docs). Nothing
/// queued is lost: a copy whose verification was dropped would never be trusted in this mount
/// (the direct table would never list it, and a complete table sends its reader through the
/// mount without asking). Each entry is queued once (4 bytes; bounded by the cache's entries).
pub struct VerifyQueue {
    state: Mutex<Queued>,
    ready: Condvar,
}

#[derive(Default)]
struct Queued {
    order: VecDeque<EntryId>,
    queued: HashSet<EntryId>,
    closed: bool,
}

impl VerifyQueue {
    /// An open, empty queue.
    pub fn new() -> VerifyQueue {
        VerifyQueue {
            state: Mutex::new(Queued::default()),
            ready: Condvar::new(),
        }
    }

    /// Queues complete entry `id` for verification (once; not after [`close`](Self::close)).
    pub fn queue(&self, id: EntryId) {
        let mut q = lock(&self.state);
        if !q.closed && q.queued.insert(id) {
            q.order.push_back(id);
            drop(q);
            self.ready.notify_one();
        }
    }

    /// The next entry to verify, waiting for one; `None` once closed.
    pub fn next(&self) -> Option<EntryId> {
        let mut q = lock(&self.state);
        loop {
            if q.closed {
                return None;
            }
            if let Some(id) = q.order.pop_front() {
                q.queued.remove(&id);
                return Some(id);
            }
            q = self.ready.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Entries waiting now.
    pub fn len(&self) -> usize {
        lock(&self.state).order.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes the queue: later copies are dropped, and the verifier ends.
    pub fn close(&self) {
        lock(&self.state).closed = true;
        self.ready.notify_all();
    }
}

impl Default for VerifyQueue {
    fn default() -> Self {
        VerifyQueue::new()
    }
}
