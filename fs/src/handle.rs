//! What the control socket's services get of a mount. Read-order hints ([`crate::hints`]) and
//! direct descriptors ([`crate::direct`]) run on threads of their own, beside the request path;
//! each gets a [`MountHandle`] (the files through the cache, the cache store, the counters,
//! whether the mount is stopping) and the few other parts it uses, never the core: they cannot
//! reach its handles, its stats file or its start and stop, and the core builds them in order
//! from its parts, before it exists itself.
//!
//! [`VerifyQueue`]: complete copies waiting for verification in the background. Opens that
//! find a copy complete but not verified in this mount queue it (passthrough and direct
//! descriptors are only handed out for verified copies), and so does the cache as each copy
//! completes; the mount's verifier thread works through it.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stagefs_prefetch::locks::lock;
use stagefs_prefetch::{CacheStore, EntryId, Stats};

use crate::files::Files;
use crate::snapshot::Snapshot;

/// At most one log line per this interval about a client's rejected lines (hints ignored,
/// direct opens refused): a broken client sends many, and one line a second says enough.
pub const LOG_EVERY: Duration = Duration::from_secs(1);

/// Complete large files waiting for background verification before passthrough: an epoch's
/// opens find many at once, and one dropped is queued again by its next open.
pub const VERIFY_QUEUE: usize = 64;

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

/// Complete copies queued for verification in the background (see the module docs).
pub struct VerifyQueue {
    /// `None` once closed: the verifier ends when the cache's sender is gone too.
    tx: Mutex<Option<SyncSender<EntryId>>>,
}

impl VerifyQueue {
    /// An open queue of [`VERIFY_QUEUE`] copies and its receiving end, for the verifier.
    pub fn new() -> (VerifyQueue, Receiver<EntryId>) {
        let (tx, rx) = sync_channel(VERIFY_QUEUE);
        let q = VerifyQueue {
            tx: Mutex::new(Some(tx)),
        };
        (q, rx)
    }

    /// Queues complete entry `id` for verification (dropped if the queue is full: a later
    /// open queues it again; or closed).
    pub fn queue(&self, id: EntryId) {
        if let Some(tx) = lock(&self.tx).as_ref() {
            let _ = tx.try_send(id);
        }
    }

    /// Another sender into the queue (for the cache's completion callback), while it is open.
    pub fn sender(&self) -> Option<SyncSender<EntryId>> {
        lock(&self.tx).clone()
    }

    /// Closes the queue: later copies are dropped, and the verifier ends.
    pub fn close(&self) {
        lock(&self.tx).take();
    }
}
