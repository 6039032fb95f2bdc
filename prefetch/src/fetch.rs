//! The fetch scheduler: who reads which block from the source, when.
//!
//! - A *demand* read (a reader is waiting) hands a missing block to a small demand pool that
//!   never queues behind prefetch work, and waits for it at most [`FetchConfig::read_timeout`]:
//!   a source that hangs on one file fails that reader with `ETIMEDOUT` after a bounded time,
//!   while other files keep being served (the stuck thread stays stuck, the others do not).
//! - *Read-ahead*, cross-file prefetch and *staging* go to a pool of worker threads
//!   ([`FetchConfig::workers`], 32 by default) through bounded queues. Parallel filesystems
//!   serve many concurrent requests far faster than serial ones, and a small-file epoch needs
//!   dozens in flight to reach the backend's bandwidth. Read-ahead is taken before staging;
//!   while readers are waiting on the source, staging is held to half the pool so that their
//!   demand reads keep a share of the bandwidth — but it never stops, because on a shuffled
//!   epoch staging is what keeps the backend busy.
//! - Each block is fetched at most once at a time: a reader that needs a block already in
//!   flight waits for it instead of reading the source again. Rendered view units go through the
//!   same de-duplication ([`Fetcher::get_or_make`]).
//!
//! Threads rather than an async runtime: every source operation is a blocking POSIX call
//! (`pread`/`openat`/`fstat` on a kernel-mounted filesystem), which tokio would run on its own
//! blocking thread pool anyway; a fixed pool of N threads *is* "N requests in flight, N blocks
//! of memory", with no second scheduler in between.
//!
//! Memory is bounded by construction: a worker holds one block ([`crate::BLOCK_SIZE`]) at a
//! time, a demand read one per block it covers, and the queues hold block *names* only, at most
//! [`FetchConfig::max_queued`] of them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::{debug, debug_span, warn};

use crate::error::SourceError;
use crate::locks;
use crate::locks::lock;
use crate::source::{Source, Version};
use crate::stats::Stats;
use crate::store::cache_log::record::EntryId;
use crate::store::CacheStore;
use crate::{block_len, BLOCK_SIZE};

/// Why a block is fetched ahead of readers; earlier variants win.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// Read-ahead of an open file or the next files of a directory being walked.
    ReadAhead,
    /// Background staging of the whole tree.
    Staging,
}

/// Sizing of the worker pool and queue.
#[derive(Clone, Debug)]
pub struct FetchConfig {
    /// Worker threads for prefetch and staging: requests kept in flight against the source.
    /// 32 × 1 MiB in flight saturates ~200 MB/s of small-file reads at a few milliseconds of
    /// latency each, for 32 MiB of memory.
    pub workers: usize,
    /// Most blocks waiting in the prefetch queues; further read-ahead is dropped (and staging
    /// waits), which bounds memory whatever readers do.
    pub max_queued: usize,
    /// Longest a reader waits for one block from the source before its read fails with
    /// `ETIMEDOUT`. Five minutes outlasts the stalls of a healthy parallel filesystem (server
    /// failover, lock recovery) while a hung one still fails readers in bounded time.
    pub read_timeout: Duration,
}

/// Threads running demand fetches: one per concurrent waiting reader (FUSE threads, view
/// renders) with room for a few stuck on a hung source.
const DEMAND_THREADS: usize = 16;

impl FetchConfig {
    /// Default [`FetchConfig::workers`] (`stagefs mount --fetch-threads`).
    pub const DEFAULT_WORKERS: usize = 32;
    /// Default [`FetchConfig::read_timeout`] (`stagefs mount --read-timeout`).
    pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(300);
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            workers: Self::DEFAULT_WORKERS,
            max_queued: 4096,
            read_timeout: Self::DEFAULT_READ_TIMEOUT,
        }
    }
}

/// A block of a source file to bring into the cache: the entry slot it fills and where it is.
#[derive(Clone, Debug)]
pub struct Want {
    /// The cache entry of the file.
    pub entry: EntryId,
    /// The block index.
    pub slot: u32,
    /// The file, relative to the source root.
    pub rel: Arc<Path>,
    /// The version the snapshot recorded (every source read is checked against it).
    pub version: Version,
}

/// A block for a reader, and whether it came from the cache.
#[derive(Clone, Debug)]
pub struct Fetched {
    /// The block's bytes.
    pub data: Bytes,
    /// Served from scratch (true) or fetched now (false).
    pub hit: bool,
}

type BlockId = (EntryId, u32);

#[derive(Default)]
struct Queues {
    readahead: VecDeque<(Want, Priority)>,
    staging: VecDeque<(Want, Priority)>,
    queued: HashSet<BlockId>,
    staging_running: usize,
}

/// Why a fetch failed, kept for every reader waiting on it (an `io::Error` is not `Clone`).
#[derive(Clone, Debug)]
enum Failure {
    Changed,
    Gone,
    Outside,
    Io(io::ErrorKind, Option<i32>, String),
}

impl Failure {
    fn of(e: &SourceError) -> Failure {
        match e {
            SourceError::Changed { .. } => Failure::Changed,
            SourceError::Gone { .. } => Failure::Gone,
            SourceError::Outside { .. } => Failure::Outside,
            SourceError::Io { source, .. } => {
                Failure::Io(source.kind(), source.raw_os_error(), source.to_string())
            }
        }
    }

    fn error(&self, rel: &Path) -> SourceError {
        let path = rel.to_path_buf();
        match self {
            Failure::Changed => SourceError::Changed { path },
            Failure::Gone => SourceError::Gone { path },
            Failure::Outside => SourceError::Outside { path },
            Failure::Io(_, Some(errno), _) => SourceError::Io {
                path,
                source: io::Error::from_raw_os_error(*errno),
            },
            Failure::Io(kind, None, msg) => SourceError::Io {
                path,
                source: io::Error::new(*kind, msg.clone()),
            },
        }
    }
}

type Outcome = Result<Bytes, Failure>;

/// A claimed block for the demand pool to fetch, and where to publish it.
type DemandJob = (Want, Arc<Slot>);

/// A block being fetched; waiters get its outcome.
#[derive(Default)]
struct Slot {
    done: Mutex<Option<Outcome>>,
    cv: Condvar,
}

struct Shared {
    store: Arc<CacheStore>,
    source: Arc<dyn Source>,
    stats: Arc<Stats>,
    cfg: FetchConfig,
    queues: Mutex<Queues>,
    work: Condvar,
    /// Notified (under `queues`) whenever blocks leave a queue: feeders waiting for room.
    room: Condvar,
    inflight: Mutex<HashMap<BlockId, Arc<Slot>>>,
    demand_active: AtomicUsize,
    demand: Mutex<Option<crossbeam_channel::Sender<DemandJob>>>,
    shutdown: AtomicBool,
}

/// Handle to the scheduler; cheap to clone. Workers stop when [`Fetcher::shutdown`] is called.
#[derive(Clone)]
pub struct Fetcher {
    shared: Arc<Shared>,
    workers: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

enum Claim {
    Mine(Arc<Slot>),
    Theirs(Arc<Slot>),
}

/// Publishes a fetch's outcome to its waiters and clears the in-flight mark, even if the
/// fetch panics (a waiter must never wait forever).
struct Publish<'a> {
    shared: &'a Shared,
    id: BlockId,
    slot: Arc<Slot>,
    result: Option<Outcome>,
}

impl Drop for Publish<'_> {
    fn drop(&mut self) {
        let outcome = self.result.take().unwrap_or_else(|| {
            Err(Failure::Io(
                io::ErrorKind::Other,
                None,
                "fetch aborted".into(),
            ))
        });
        // Unlisted before its outcome is published: a reader that sees the outcome (a failure,
        // say) and asks again must start a new fetch, not join this finished one and be handed
        // its stale error (regression_a_read_after_a_failed_fetch_is_not_given_its_stale_error).
        // Its waiters hold the slot and still get the outcome.
        lock(&self.shared.inflight).remove(&self.id);
        *lock(&self.slot.done) = Some(outcome);
        self.slot.cv.notify_all();
    }
}

impl Fetcher {
    /// Starts the worker pool.
    pub fn new(
        store: Arc<CacheStore>,
        source: Arc<dyn Source>,
        stats: Arc<Stats>,
        cfg: FetchConfig,
    ) -> std::io::Result<Fetcher> {
        let shared = Arc::new(Shared {
            store,
            source,
            stats,
            cfg: cfg.clone(),
            queues: Mutex::new(Queues::default()),
            work: Condvar::new(),
            room: Condvar::new(),
            inflight: Mutex::new(HashMap::new()),
            demand_active: AtomicUsize::new(0),
            demand: Mutex::new(None),
            shutdown: AtomicBool::new(false),
        });
        let mut workers = Vec::new();
        let (tx, rx) = crossbeam_channel::unbounded::<DemandJob>();
        *lock(&shared.demand) = Some(tx);
        for i in 0..DEMAND_THREADS {
            let s = shared.clone();
            let rx = rx.clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("stagefs-demand-{i}"))
                    .spawn(move || {
                        // Ends when the fetcher shuts down (the sender is dropped).
                        for (w, slot) in rx {
                            run_fetch(&s, &w, slot, None);
                        }
                    })?,
            );
        }
        for i in 0..cfg.workers.max(1) {
            let s = shared.clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("stagefs-fetch-{i}"))
                    .spawn(move || worker(&s))?,
            );
        }
        Ok(Fetcher {
            shared,
            workers: Arc::new(Mutex::new(workers)),
        })
    }

    /// The shared counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.shared.stats
    }

    /// The cache this fetcher fills.
    pub fn store(&self) -> &Arc<CacheStore> {
        &self.shared.store
    }

    /// The source this fetcher reads.
    pub fn source(&self) -> &Arc<dyn Source> {
        &self.shared.source
    }

    /// Blocks waiting in the queue of `prio`.
    pub fn queued(&self, prio: Priority) -> usize {
        let q = lock(&self.shared.queues);
        match prio {
            Priority::ReadAhead => q.readahead.len(),
            Priority::Staging => q.staging.len(),
        }
    }

    /// Block `w` for a waiting reader: from the cache where possible, else from the source on
    /// this thread (and cached).
    pub fn block(&self, w: &Want) -> Result<Fetched, SourceError> {
        if let Some(data) = self.shared.store.read(w.entry, w.slot) {
            self.shared.stats.block_hits.fetch_add(1, Relaxed);
            return Ok(Fetched { data, hit: true });
        }
        let shared = &self.shared;
        shared.stats.block_misses.fetch_add(1, Relaxed);
        shared.demand_active.fetch_add(1, Relaxed);
        shared.stats.wait_begin();
        let started = Instant::now();
        let slot = match claim(shared, (w.entry, w.slot)) {
            Claim::Theirs(slot) => slot,
            Claim::Mine(slot) => {
                let sent = lock(&shared.demand)
                    .as_ref()
                    .map(|tx| tx.send((w.clone(), slot.clone())).is_ok());
                if sent != Some(true) {
                    // Shutting down: fetch here rather than leave the slot unpublished.
                    run_fetch(shared, w, slot.clone(), None);
                }
                slot
            }
        };
        let outcome = wait_for(&slot, shared.cfg.read_timeout);
        shared.stats.wait_end(started.elapsed());
        shared.demand_active.fetch_sub(1, Relaxed);
        match outcome {
            Some(Ok(data)) => Ok(Fetched { data, hit: false }),
            Some(Err(f)) => Err(f.error(&w.rel)),
            None => {
                shared.stats.error(format!(
                    "reading {} from the source took longer than {:?}: the read failed with ETIMEDOUT",
                    w.rel.display(),
                    shared.cfg.read_timeout
                ));
                Err(SourceError::Io {
                    path: w.rel.to_path_buf(),
                    source: io::Error::from_raw_os_error(libc::ETIMEDOUT),
                })
            }
        }
    }

    /// Slot `slot` of entry `entry`: from the cache, else made by `make` on this thread and
    /// cached — with the same in-flight de-duplication as source blocks, so concurrent readers
    /// of one rendered view unit render it once. `make` also says whether its bytes are worth
    /// storing (a unit of zeros, say, is kept elsewhere compactly).
    pub fn get_or_make<E>(
        &self,
        entry: EntryId,
        slot: u32,
        make: impl FnOnce() -> Result<(Bytes, bool), E>,
    ) -> Result<Fetched, E> {
        let shared = &self.shared;
        if let Some(data) = shared.store.read(entry, slot) {
            return Ok(Fetched { data, hit: true });
        }
        let id = (entry, slot);
        let slot_ = match claim(shared, id) {
            Claim::Theirs(s) => {
                if let Some(Ok(data)) = wait_for(&s, Duration::MAX) {
                    return Ok(Fetched { data, hit: true });
                }
                // Their attempt failed (or kept nothing): try once ourselves.
                let (data, keep) = make()?;
                if keep {
                    shared.store.insert(entry, slot, &data);
                }
                return Ok(Fetched { data, hit: false });
            }
            Claim::Mine(s) => s,
        };
        let mut publish = Publish {
            shared,
            id,
            slot: slot_,
            result: None,
        };
        if let Some(data) = shared.store.read(entry, slot) {
            publish.result = Some(Ok(data.clone()));
            return Ok(Fetched { data, hit: true });
        }
        let (data, keep) = make()?;
        if keep {
            shared.store.insert(entry, slot, &data);
        }
        publish.result = Some(Ok(data.clone()));
        Ok(Fetched { data, hit: false })
    }

    /// Waits until fewer than `depth` blocks wait in the queue of `prio`, the fetcher shuts
    /// down, or `timeout` passes; whether there is room. Woken by the workers as they take
    /// blocks, so a feeder (background staging) keeps the queue full without polling.
    pub fn wait_for_room(&self, prio: Priority, depth: usize, timeout: Duration) -> bool {
        let len = |q: &Queues| match prio {
            Priority::ReadAhead => q.readahead.len(),
            Priority::Staging => q.staging.len(),
        };
        let q = lock(&self.shared.queues);
        let (q, _) = self
            .shared
            .room
            .wait_timeout_while(q, timeout, |q| {
                len(q) >= depth && !self.shared.shutdown.load(Relaxed)
            })
            .unwrap_or_else(PoisonError::into_inner);
        len(&q) < depth
    }

    /// Queues blocks for fetching ahead of readers. Blocks already cached, queued or in flight
    /// are skipped; when the queue is full the rest is dropped.
    pub fn prefetch(&self, wants: impl IntoIterator<Item = Want>, prio: Priority) {
        let mut added = false;
        for w in wants {
            let id = (w.entry, w.slot);
            if self.shared.store.contains(w.entry, w.slot)
                || lock(&self.shared.inflight).contains_key(&id)
            {
                continue;
            }
            let mut q = lock(&self.shared.queues);
            if q.readahead.len() + q.staging.len() >= self.shared.cfg.max_queued {
                break;
            }
            if !q.queued.insert(id) {
                continue;
            }
            match prio {
                Priority::ReadAhead => q.readahead.push_back((w, prio)),
                Priority::Staging => q.staging.push_back((w, prio)),
            }
            added = true;
        }
        if added {
            self.shared.work.notify_all();
        }
    }

    /// Drops the staging blocks queued and not started (staging changed its plan).
    pub fn drop_staging(&self) {
        let mut q = lock(&self.shared.queues);
        let Queues {
            staging, queued, ..
        } = &mut *q;
        for (w, _) in staging.drain(..) {
            queued.remove(&(w.entry, w.slot));
        }
        self.shared.room.notify_all();
    }

    /// Stops the workers (queued work is dropped) and waits for them.
    pub fn shutdown(&self) {
        {
            // Set under the queue lock: a worker checks the flag under it and then waits, so
            // the notification below cannot fall between its check and its wait.
            let _q = lock(&self.shared.queues);
            self.shared.shutdown.store(true, Relaxed);
        }
        lock(&self.shared.demand).take();
        self.shared.work.notify_all();
        self.shared.room.notify_all();
        let handles: Vec<_> = lock(&self.workers).drain(..).collect();
        for h in handles {
            let _ = h.join();
        }
    }
}

fn claim(shared: &Shared, id: BlockId) -> Claim {
    let mut inflight = lock(&shared.inflight);
    if let Some(slot) = inflight.get(&id) {
        return Claim::Theirs(slot.clone());
    }
    let slot = Arc::new(Slot::default());
    inflight.insert(id, slot.clone());
    Claim::Mine(slot)
}

/// The outcome of `slot`, waiting at most `timeout` (`None`: still running).
fn wait_for(slot: &Slot, timeout: Duration) -> Option<Outcome> {
    let deadline = Instant::now().checked_add(timeout);
    let mut done = lock(&slot.done);
    while done.is_none() {
        done = match deadline {
            None => locks::wait(&slot.cv, done),
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return None;
                }
                slot.cv
                    .wait_timeout(done, left)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0)
            }
        };
    }
    done.clone()
}

/// Fetches block `w` from the source (once, however many ask at the same time) and caches it;
/// used by prefetch workers, which wait as long as it takes.
fn fetch(shared: &Shared, w: &Want, prio: Option<Priority>) -> Result<Bytes, SourceError> {
    let slot = match claim(shared, (w.entry, w.slot)) {
        Claim::Theirs(slot) => slot,
        Claim::Mine(slot) => {
            run_fetch(shared, w, slot.clone(), prio);
            slot
        }
    };
    match wait_for(&slot, Duration::MAX) {
        Some(Ok(data)) => Ok(data),
        Some(Err(f)) => Err(f.error(&w.rel)),
        None => Err(SourceError::Changed {
            path: w.rel.to_path_buf(),
        }),
    }
}

/// Does the fetch of a claimed block and publishes its outcome to `slot`'s waiters.
fn run_fetch(shared: &Shared, w: &Want, slot: Arc<Slot>, prio: Option<Priority>) {
    let mut publish = Publish {
        shared,
        id: (w.entry, w.slot),
        slot,
        result: None,
    };
    // Someone may have cached the block between our miss and our claim.
    if let Some(data) = shared.store.read(w.entry, w.slot) {
        publish.result = Some(Ok(data));
        return;
    }
    let _span = debug_span!("fetch", path = %w.rel.display(), block = w.slot).entered();
    shared.stats.fetches_in_flight.fetch_add(1, Relaxed);
    let r = read_source(shared, w);
    shared.stats.fetches_in_flight.fetch_sub(1, Relaxed);
    publish.result = Some(match r {
        Ok(data) => {
            shared.store.insert(w.entry, w.slot, &data);
            let n = data.len() as u64;
            match prio {
                Some(Priority::ReadAhead) => shared.stats.bytes_prefetched.fetch_add(n, Relaxed),
                Some(Priority::Staging) => shared.stats.bytes_staged.fetch_add(n, Relaxed),
                None => 0,
            };
            Ok(data)
        }
        Err(e) => Err(Failure::of(&e)),
    });
}

fn read_source(shared: &Shared, w: &Want) -> Result<Bytes, SourceError> {
    let len = block_len(w.version.size, u64::from(w.slot)) as usize;
    let data = shared
        .source
        .read_at(&w.rel, w.version, u64::from(w.slot) * BLOCK_SIZE, len)?;
    // Every byte read from the source, whoever asked (demand, read-ahead, staging, hints).
    shared
        .stats
        .source_bytes_read
        .fetch_add(data.len() as u64, Relaxed);
    if data.len() < len {
        // Shorter than its size said: the file shrank since the snapshot.
        return Err(SourceError::Changed {
            path: w.rel.to_path_buf(),
        });
    }
    Ok(data)
}

fn worker(shared: &Shared) {
    loop {
        let (w, prio) = {
            let mut q = lock(&shared.queues);
            loop {
                if shared.shutdown.load(Relaxed) {
                    return;
                }
                if let Some(t) = q.readahead.pop_front() {
                    shared.room.notify_all();
                    break t;
                }
                // While readers wait on the source, staging keeps half the pool.
                let limit = if shared.demand_active.load(Relaxed) > 0 {
                    (shared.cfg.workers / 2).max(1)
                } else {
                    shared.cfg.workers
                };
                if q.staging_running < limit {
                    if let Some(t) = q.staging.pop_front() {
                        q.staging_running += 1;
                        shared.room.notify_all();
                        break t;
                    }
                }
                // Staging held back by the demand limit is freed by `demand_active` falling,
                // which notifies nobody: look again in 20 ms. Otherwise sleep until work is
                // queued or the fetcher shuts down (both notify, under this lock): 32 idle
                // workers waking every 20 ms cost an idle daemon 2 % of a core.
                q = if q.staging.is_empty() {
                    shared.work.wait(q).unwrap_or_else(PoisonError::into_inner)
                } else {
                    shared
                        .work
                        .wait_timeout(q, Duration::from_millis(20))
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0)
                };
            }
        };
        lock(&shared.queues).queued.remove(&(w.entry, w.slot));
        if !shared.store.contains(w.entry, w.slot) {
            if let Err(e) = fetch(shared, &w, Some(prio)) {
                // A file changed or removed under a prefetch is routine; anything else is
                // worth a line.
                if matches!(e, SourceError::Changed { .. } | SourceError::Gone { .. }) {
                    debug!(error = %e, "prefetch skipped");
                } else {
                    warn!(error = %e, "prefetch failed");
                }
            }
        }
        if prio == Priority::Staging {
            lock(&shared.queues).staging_running -= 1;
            shared.work.notify_one();
        }
    }
}
