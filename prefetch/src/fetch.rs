//! The fetch scheduler: who reads which block from the source, when.
//!
//! - A *demand* read (a reader is waiting) fetches its missing blocks on the caller's own thread
//!   (a FUSE session thread; there are several), so it never queues behind prefetch work.
//! - *Read-ahead* and cross-file prefetch go to a fixed pool of worker threads through a bounded
//!   queue; *staging* runs only when that queue is empty and no demand read is in progress, so
//!   background copying never starves a reader.
//! - Each block is fetched at most once at a time: a reader that needs a block already in
//!   flight waits for it instead of reading the source again.
//!
//! Memory is bounded by construction: a worker holds one block ([`crate::BLOCK_SIZE`]) at a
//! time, a demand read one per block it covers, and the queues hold block *names* only, at most
//! [`FetchConfig::max_queued`] of them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, debug_span, warn};

use crate::error::SourceError;
use crate::meta::path_key;
use crate::source::{lock, Signature, Source};
use crate::stats::Stats;
use crate::store::CacheStore;
use crate::{block_count, block_len, BLOCK_SIZE};

/// Why a block is fetched; earlier variants win.
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
    /// Worker threads for prefetch and staging. Parallel filesystems answer many small
    /// requests in parallel much faster than one by one; 8 saturates ~200 MB/s of 1 MiB reads
    /// at a few milliseconds of latency each.
    pub workers: usize,
    /// Most blocks waiting in the prefetch queue; further read-ahead is dropped (and staging
    /// waits), which bounds memory whatever readers do.
    pub max_queued: usize,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            workers: 8,
            max_queued: 4096,
        }
    }
}

type BlockId = (u64, u64);

/// The last verified block a handle read (index, bytes), reused while reads stay inside it.
pub type BlockMemo = Mutex<Option<(u64, Arc<Vec<u8>>)>>;

struct Task {
    rel: Arc<Path>,
    sig: Signature,
    idx: u64,
    prio: Priority,
}

#[derive(Default)]
struct Queues {
    readahead: VecDeque<Task>,
    staging: VecDeque<Task>,
    queued: HashSet<BlockId>,
}

/// A block being fetched; waiters get the bytes or the error text.
#[derive(Default)]
struct Slot {
    done: Mutex<Option<Result<Arc<Vec<u8>>, String>>>,
    cv: Condvar,
}

struct Shared {
    store: Arc<CacheStore>,
    source: Arc<dyn Source>,
    stats: Arc<Stats>,
    cfg: FetchConfig,
    queues: Mutex<Queues>,
    work: Condvar,
    inflight: Mutex<HashMap<BlockId, Arc<Slot>>>,
    demand_active: AtomicUsize,
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
            inflight: Mutex::new(HashMap::new()),
            demand_active: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
        });
        let mut workers = Vec::new();
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

    /// Blocks waiting in the queue of `prio`.
    pub fn queued(&self, prio: Priority) -> usize {
        let q = lock(&self.shared.queues);
        match prio {
            Priority::ReadAhead => q.readahead.len(),
            Priority::Staging => q.staging.len(),
        }
    }

    /// Reads `len` bytes at `offset` of `rel` for a waiting reader: from the cache where
    /// possible, else from the source on this thread (caching what it fetched).
    pub fn read(
        &self,
        rel: &Path,
        sig: Signature,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, SourceError> {
        self.read_with_memo(rel, sig, offset, len, None)
    }

    /// [`read`](Self::read) with a per-handle memo of the last block served: the kernel often
    /// asks for 128 KiB at a time, and re-reading and re-checksumming the same 1 MiB block for
    /// each of its eight pieces would cost eight times the bytes served.
    pub fn read_with_memo(
        &self,
        rel: &Path,
        sig: Signature,
        offset: u64,
        len: usize,
        memo: Option<&BlockMemo>,
    ) -> Result<Vec<u8>, SourceError> {
        let end = (offset + len as u64).min(sig.size);
        if offset >= end {
            return Ok(Vec::new());
        }
        let _span = debug_span!("read", path = %rel.display(), offset, len).entered();
        let stats = &self.shared.stats;
        let mut out = Vec::with_capacity((end - offset) as usize);
        let first = offset / BLOCK_SIZE;
        let last = (end - 1) / BLOCK_SIZE;
        for idx in first..=last {
            let bstart = idx * BLOCK_SIZE;
            let lo = (offset.max(bstart) - bstart) as usize;
            let hi = (end.min(bstart + BLOCK_SIZE) - bstart) as usize;
            let remembered = memo.and_then(|m| {
                lock(m)
                    .as_ref()
                    .filter(|(i, _)| *i == idx)
                    .map(|(_, d)| d.clone())
            });
            let cached = remembered.or_else(|| {
                let mut buf = vec![0u8; block_len(sig.size, idx) as usize];
                self.shared
                    .store
                    .read_block(rel, sig, idx, &mut buf)
                    .map(|n| {
                        buf.truncate(n);
                        Arc::new(buf)
                    })
            });
            let data = match cached {
                Some(data) => {
                    stats.block_hits.fetch_add(1, Relaxed);
                    stats
                        .bytes_from_cache
                        .fetch_add((hi.min(data.len()) - lo.min(data.len())) as u64, Relaxed);
                    data
                }
                None => {
                    stats.block_misses.fetch_add(1, Relaxed);
                    self.shared.demand_active.fetch_add(1, Relaxed);
                    let started = Instant::now();
                    let data = fetch_block(&self.shared, rel, sig, idx, None);
                    self.shared.demand_active.fetch_sub(1, Relaxed);
                    stats
                        .reader_wait_ns
                        .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
                    let data = data?;
                    stats
                        .bytes_from_source
                        .fetch_add((hi.min(data.len()) - lo.min(data.len())) as u64, Relaxed);
                    data
                }
            };
            let hi = hi.min(data.len());
            out.extend_from_slice(&data[lo.min(hi)..hi]);
            if let Some(m) = memo {
                *lock(m) = Some((idx, data));
            }
        }
        Ok(out)
    }

    /// Queues blocks `blocks` of `rel` for fetching ahead of readers. Blocks already cached,
    /// queued or in flight are skipped; when the queue is full the rest is dropped.
    pub fn prefetch(&self, rel: &Arc<Path>, sig: Signature, blocks: Range<u64>, prio: Priority) {
        let key = path_key(rel);
        let blocks = blocks.start..blocks.end.min(block_count(sig.size));
        let mut added = false;
        for idx in blocks {
            if self.shared.store.contains(rel, sig, idx)
                || lock(&self.shared.inflight).contains_key(&(key, idx))
            {
                continue;
            }
            let mut q = lock(&self.shared.queues);
            if q.readahead.len() + q.staging.len() >= self.shared.cfg.max_queued {
                break;
            }
            if !q.queued.insert((key, idx)) {
                continue;
            }
            let task = Task {
                rel: rel.clone(),
                sig,
                idx,
                prio,
            };
            match prio {
                Priority::ReadAhead => q.readahead.push_back(task),
                Priority::Staging => q.staging.push_back(task),
            }
            added = true;
        }
        if added {
            self.shared.work.notify_all();
        }
    }

    /// Queues the byte range `range` of `rel` for read-ahead.
    pub fn prefetch_bytes(&self, rel: &Arc<Path>, sig: Signature, range: Range<u64>) {
        if range.start >= range.end {
            return;
        }
        let blocks = range.start / BLOCK_SIZE..(range.end - 1) / BLOCK_SIZE + 1;
        self.prefetch(rel, sig, blocks, Priority::ReadAhead);
    }

    /// Stops the workers (queued work is dropped) and waits for them.
    pub fn shutdown(&self) {
        self.shared.shutdown.store(true, Relaxed);
        self.shared.work.notify_all();
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

fn fetch_block(
    shared: &Shared,
    rel: &Path,
    sig: Signature,
    idx: u64,
    prio: Option<Priority>,
) -> Result<Arc<Vec<u8>>, SourceError> {
    let id = (path_key(rel), idx);
    let slot = match claim(shared, id) {
        Claim::Theirs(slot) => {
            let mut done = lock(&slot.done);
            while done.is_none() {
                done = slot.cv.wait(done).unwrap_or_else(|p| p.into_inner());
            }
            return match done.as_ref() {
                Some(Ok(data)) => Ok(data.clone()),
                // The other fetch failed; try once ourselves for a precise error.
                _ => {
                    drop(done);
                    read_source(shared, rel, sig, idx).map(Arc::new)
                }
            };
        }
        Claim::Mine(slot) => slot,
    };
    // Someone may have cached the block between our miss and our claim.
    let mut buf = vec![0u8; block_len(sig.size, idx) as usize];
    let result = match shared.store.read_block(rel, sig, idx, &mut buf) {
        Some(n) => {
            buf.truncate(n);
            Ok(buf)
        }
        None => {
            let _span = debug_span!("fetch", path = %rel.display(), block = idx).entered();
            shared.stats.fetches_in_flight.fetch_add(1, Relaxed);
            let r = read_source(shared, rel, sig, idx);
            shared.stats.fetches_in_flight.fetch_sub(1, Relaxed);
            if let Ok(data) = &r {
                shared.store.insert_block(rel, sig, idx, data);
                let n = data.len() as u64;
                match prio {
                    Some(Priority::ReadAhead) => {
                        shared.stats.bytes_prefetched.fetch_add(n, Relaxed)
                    }
                    Some(Priority::Staging) => shared.stats.bytes_staged.fetch_add(n, Relaxed),
                    None => 0,
                };
            }
            r
        }
    };
    let result = result.map(Arc::new);
    *lock(&slot.done) = Some(match &result {
        Ok(d) => Ok(d.clone()),
        Err(e) => Err(e.to_string()),
    });
    slot.cv.notify_all();
    lock(&shared.inflight).remove(&id);
    result
}

fn read_source(
    shared: &Shared,
    rel: &Path,
    sig: Signature,
    idx: u64,
) -> Result<Vec<u8>, SourceError> {
    let len = block_len(sig.size, idx) as usize;
    let buf = shared
        .source
        .read_at(rel, sig, idx * BLOCK_SIZE, len)
        .inspect_err(|e| {
            if matches!(e, SourceError::Changed { .. } | SourceError::Gone { .. }) {
                shared.store.invalidate(rel);
            }
        })?;
    let n = buf.len();
    let buf = buf.to_vec();
    if n < len {
        // Shorter than its size said: the file shrank under us.
        shared.store.invalidate(rel);
        return Err(SourceError::Changed {
            path: rel.to_path_buf(),
        });
    }
    Ok(buf)
}

fn worker(shared: &Shared) {
    loop {
        let task = {
            let mut q = lock(&shared.queues);
            loop {
                if shared.shutdown.load(Relaxed) {
                    return;
                }
                if let Some(t) = q.readahead.pop_front() {
                    break t;
                }
                // Staging yields to readers: wait while any demand read is in progress.
                if shared.demand_active.load(Relaxed) == 0 {
                    if let Some(t) = q.staging.pop_front() {
                        break t;
                    }
                }
                q = shared
                    .work
                    .wait_timeout(q, Duration::from_millis(20))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
        };
        lock(&shared.queues)
            .queued
            .remove(&(path_key(&task.rel), task.idx));
        if shared.store.contains(&task.rel, task.sig, task.idx) {
            continue;
        }
        if let Err(e) = fetch_block(shared, &task.rel, task.sig, task.idx, Some(task.prio)) {
            // A file changed or removed under a prefetch is routine; anything else is worth a line.
            if matches!(e, SourceError::Changed { .. } | SourceError::Gone { .. }) {
                debug!(error = %e, "prefetch skipped");
            } else {
                warn!(error = %e, "prefetch failed");
            }
        }
    }
}
