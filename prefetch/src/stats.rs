//! Counters behind `MOUNTPOINT/.stagefs/stats`: cheap atomics bumped on the read path, turned
//! into a JSON snapshot on demand. The error list keeps the most recent [`MAX_ERRORS`] so a bad
//! dataset cannot grow it without bound.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

use crate::locks::lock;

/// Errors remembered for the stats file; older ones are counted but dropped.
pub const MAX_ERRORS: usize = 100;

/// Live counters, shared by the fetcher, the store and the filesystem.
pub struct Stats {
    /// When the counters started (the clock of the stall time).
    started: Instant,
    /// Readers waiting on the source right now.
    waiting: AtomicU64,
    /// When `waiting` last went from 0 to 1, in nanoseconds since `started`.
    stall_since_ns: AtomicU64,
    /// Nanoseconds during which at least one reader was waiting (closed intervals).
    stall_ns: AtomicU64,
    /// Bytes answered from the scratch cache.
    pub bytes_from_cache: AtomicU64,
    /// Bytes answered by reading the source on the reader's behalf.
    pub bytes_from_source: AtomicU64,
    /// Every byte read from the source for any reason (demand, read-ahead, staging, hints).
    pub source_bytes_read: AtomicU64,
    /// Opens served by kernel passthrough.
    pub passthrough_opens: AtomicU64,
    /// Bytes handed to readers by kernel passthrough, counted as the whole file's size at each
    /// passthrough open (the daemon does not see those reads).
    pub bytes_passthrough: AtomicU64,
    /// Descriptors of verified copies handed to readers over the control socket.
    pub direct_opens: AtomicU64,
    /// Refused direct opens (the reader falls back to the mount) by reason code; their sum
    /// is `direct_refused`. One lock per refusal: an open, not a read.
    direct_refused_by: Mutex<BTreeMap<&'static str, u64>>,
    /// Bytes of files handed out as direct descriptors (each file's size, per open).
    pub bytes_direct: AtomicU64,
    /// Copies trusted in this mount: read back whole and found intact, or written whole by it.
    pub copies_verified: AtomicU64,
    /// Copies trusted at a remount by their record alone (same inode and change time).
    pub copies_trusted: AtomicU64,
    /// Bytes handed to the kernel's page cache ahead of an in-order reader (pushed from the
    /// cache; the reader's reads of them never reach the daemon).
    pub bytes_pushed: AtomicU64,
    /// Files pushed ahead of an in-order reader.
    pub files_pushed: AtomicU64,
    /// Reads (FUSE read requests) on source files.
    pub reads: AtomicU64,
    /// Blocks found in the cache on a demand read.
    pub block_hits: AtomicU64,
    /// Blocks a demand read had to wait for.
    pub block_misses: AtomicU64,
    /// Bytes fetched ahead of readers (read-ahead and cross-file prefetch).
    pub bytes_prefetched: AtomicU64,
    /// Bytes fetched by background staging.
    pub bytes_staged: AtomicU64,
    /// Files whose every block is cached.
    pub files_staged: AtomicU64,
    /// Blocks evicted to respect the capacity.
    pub blocks_evicted: AtomicU64,
    /// Fetches running now.
    pub fetches_in_flight: AtomicU64,
    /// Nanoseconds readers spent waiting on the source (demand misses).
    pub reader_wait_ns: AtomicU64,
    /// Cached blocks whose checksum or header did not match (served from the source instead).
    pub corrupt_blocks: AtomicU64,
    /// Replies the FUSE layer could not send because the kernel had given up on the request
    /// (an interrupted reader); counted by the daemon's log layer.
    pub replies_dropped: AtomicU64,
    /// Times a cache write failed (scratch full or failing; reads went to the source).
    pub cache_full_events: AtomicU64,
    /// Tensor view chunks rendered.
    pub views_rendered: AtomicU64,
    /// Bytes of tensor views served.
    pub view_bytes: AtomicU64,
    /// Total errors, including those no longer listed.
    pub error_count: AtomicU64,
    /// Bytes background staging set out to cache (0 when the tree does not fit).
    pub staging_target: AtomicU64,
    /// Read-order hints accepted (lines on the hint socket).
    pub hints_accepted: AtomicU64,
    /// Read-order hints rejected (malformed, unknown path, out of range, over a bound).
    pub hints_rejected: AtomicU64,
    /// Bytes named by accepted hints.
    pub hint_bytes: AtomicU64,
    /// Clients connected to the control socket now.
    pub control_clients: AtomicU64,
    /// Bytes of request lines the control socket holds now (partial lines, queued hints).
    pub control_buffered: AtomicU64,
    /// The most `control_buffered` has been.
    pub control_buffered_peak: AtomicU64,
    /// Control-socket connections dropped by the daemon (over the memory budget, out of step).
    pub control_dropped: AtomicU64,
    errors: Mutex<VecDeque<String>>,
}

/// A point-in-time copy of [`Stats`] plus cache occupancy, as written to the stats file.
#[derive(Debug, Clone, Serialize, serde::Deserialize, Default)]
pub struct StatsSnapshot {
    /// Seconds since the mount started.
    pub uptime_s: f64,
    /// Bytes of source files answered by the daemon from the cache.
    pub bytes_from_cache: u64,
    /// Bytes of source files answered by the daemon from the source (readers waited).
    pub bytes_from_source: u64,
    /// Every byte read from the source for any reason: demand, read-ahead, staging, hints.
    #[serde(default)]
    pub source_bytes_read: u64,
    /// `bytes_from_cache / (bytes_from_cache + bytes_from_source)`; `null` before any read.
    pub hit_ratio: Option<f64>,
    /// Opens served by kernel passthrough.
    pub passthrough_opens: u64,
    /// Bytes of files opened through passthrough (each file's size, per open): read by the
    /// kernel from scratch, unseen by the daemon.
    pub bytes_passthrough: u64,
    /// Direct opens: descriptors of trusted copies handed to readers over the control socket,
    /// and copies readers opened themselves through the direct table.
    #[serde(default)]
    pub direct_opens: u64,
    /// Of those, opens through the direct table (counted by the readers; docs/direct.md).
    #[serde(default)]
    pub direct_table_opens: u64,
    /// Direct opens refused (the reader read through the mount instead).
    #[serde(default)]
    pub direct_refused: u64,
    /// Refused direct opens by reason (`not_staged`, `verifying`, `small`, ...): why a job's
    /// reads went through the mount.
    #[serde(default)]
    pub direct_refused_by: BTreeMap<String, u64>,
    /// Bytes of files handed out as direct descriptors (each file's size, per open): read
    /// from scratch by the reader, unseen by the daemon.
    #[serde(default)]
    pub bytes_direct: u64,
    /// Direct descriptors pinned now (granted and not yet closed by their clients).
    #[serde(default)]
    pub direct_pins: u64,
    /// Copies trusted in this mount: read back whole and found intact, or written whole by it.
    #[serde(default)]
    pub copies_verified: u64,
    /// Copies trusted at this mount by an earlier mount's record alone (the same inode, size
    /// and change time: not read again).
    #[serde(default)]
    pub copies_trusted: u64,
    /// Seconds during which at least one reader was waiting on the source.
    pub stall_s: f64,
    /// Bytes pushed into the kernel's page cache ahead of in-order readers.
    pub bytes_pushed: u64,
    /// Files pushed ahead of in-order readers.
    pub files_pushed: u64,
    /// Read requests.
    pub reads: u64,
    /// Demand block hits.
    pub block_hits: u64,
    /// Demand block misses.
    pub block_misses: u64,
    /// Bytes prefetched.
    pub bytes_prefetched: u64,
    /// Bytes staged in the background.
    pub bytes_staged: u64,
    /// Files fully cached.
    pub files_staged: u64,
    /// Blocks evicted.
    pub blocks_evicted: u64,
    /// Fetches running now.
    pub fetches_in_flight: u64,
    /// Seconds readers waited on the source.
    pub reader_wait_s: f64,
    /// Corrupt cache blocks detected.
    pub corrupt_blocks: u64,
    /// Cache-full events.
    pub cache_full_events: u64,
    /// View chunks rendered.
    pub views_rendered: u64,
    /// View bytes served.
    pub view_bytes: u64,
    /// Bytes in the cache now.
    pub cache_used: u64,
    /// Cache capacity in bytes.
    pub cache_capacity: u64,
    /// Bytes of the source tree scheduled for staging (0 when the tree does not fit).
    pub staging_target: u64,
    /// Read-order hints accepted.
    #[serde(default)]
    pub hints_accepted: u64,
    /// Read-order hints rejected (each with a logged reason).
    #[serde(default)]
    pub hints_rejected: u64,
    /// Bytes named by accepted hints.
    #[serde(default)]
    pub hint_bytes: u64,
    /// The Unix socket taking read-order hints (`null` when there is none).
    #[serde(default)]
    pub hint_socket: Option<String>,
    /// Clients connected to the control socket now.
    #[serde(default)]
    pub control_clients: u64,
    /// Bytes of request lines the control socket holds now (within its budget).
    #[serde(default)]
    pub control_buffered: u64,
    /// The most bytes of request lines the control socket has held at once.
    #[serde(default)]
    pub control_buffered_peak: u64,
    /// Control-socket connections the daemon dropped (over its memory budget).
    #[serde(default)]
    pub control_dropped: u64,
    /// Number of errors seen.
    pub error_count: u64,
    /// The most recent errors.
    pub errors: Vec<String>,
    /// Where the metadata snapshot came from: `listed` (this mount listed the source), `cache`
    /// (kept by an earlier mount), or `index` (a `stagefs index` file).
    pub snapshot: String,
    /// Entries in the snapshot.
    pub snapshot_entries: u64,
    /// Metadata requests (stat, readdir, readlink) this mount sent to the source.
    pub metadata_requests: u64,
    /// Replies to requests the kernel had already given up on (readers interrupted mid-read).
    pub replies_dropped: u64,
    /// Process id of the mount daemon.
    pub pid: u32,
    /// The cache directory.
    pub cache_dir: String,
    /// The source directory.
    pub source: String,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            started: Instant::now(),
            waiting: AtomicU64::new(0),
            stall_since_ns: AtomicU64::new(0),
            stall_ns: AtomicU64::new(0),
            bytes_from_cache: AtomicU64::new(0),
            bytes_from_source: AtomicU64::new(0),
            source_bytes_read: AtomicU64::new(0),
            passthrough_opens: AtomicU64::new(0),
            bytes_passthrough: AtomicU64::new(0),
            direct_opens: AtomicU64::new(0),
            direct_refused_by: Mutex::new(BTreeMap::new()),
            bytes_direct: AtomicU64::new(0),
            copies_verified: AtomicU64::new(0),
            copies_trusted: AtomicU64::new(0),
            bytes_pushed: AtomicU64::new(0),
            files_pushed: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            block_hits: AtomicU64::new(0),
            block_misses: AtomicU64::new(0),
            bytes_prefetched: AtomicU64::new(0),
            bytes_staged: AtomicU64::new(0),
            files_staged: AtomicU64::new(0),
            blocks_evicted: AtomicU64::new(0),
            fetches_in_flight: AtomicU64::new(0),
            reader_wait_ns: AtomicU64::new(0),
            corrupt_blocks: AtomicU64::new(0),
            replies_dropped: AtomicU64::new(0),
            cache_full_events: AtomicU64::new(0),
            views_rendered: AtomicU64::new(0),
            view_bytes: AtomicU64::new(0),
            error_count: AtomicU64::new(0),
            staging_target: AtomicU64::new(0),
            hints_accepted: AtomicU64::new(0),
            hints_rejected: AtomicU64::new(0),
            hint_bytes: AtomicU64::new(0),
            control_clients: AtomicU64::new(0),
            control_buffered: AtomicU64::new(0),
            control_buffered_peak: AtomicU64::new(0),
            control_dropped: AtomicU64::new(0),
            errors: Mutex::new(VecDeque::new()),
        }
    }
}

impl Stats {
    /// Counts a refused direct open with its reason `code` (the protocol's refusal code).
    pub fn count_refusal(&self, code: &'static str) {
        *lock(&self.direct_refused_by).entry(code).or_insert(0) += 1;
    }

    fn now_ns(&self) -> u64 {
        self.started.elapsed().as_nanos() as u64
    }

    /// A reader starts waiting on the source.
    pub fn wait_begin(&self) {
        if self.waiting.fetch_add(1, Relaxed) == 0 {
            self.stall_since_ns.store(self.now_ns(), Relaxed);
        }
    }

    /// A reader stops waiting on the source after `waited`.
    pub fn wait_end(&self, waited: std::time::Duration) {
        self.reader_wait_ns
            .fetch_add(waited.as_nanos() as u64, Relaxed);
        if self.waiting.fetch_sub(1, Relaxed) == 1 {
            let since = self.stall_since_ns.load(Relaxed);
            self.stall_ns
                .fetch_add(self.now_ns().saturating_sub(since), Relaxed);
        }
    }

    /// Records an error for the stats file (and the count).
    pub fn error(&self, msg: impl Into<String>) {
        self.error_count.fetch_add(1, Relaxed);
        let mut errors = lock(&self.errors);
        if errors.len() == MAX_ERRORS {
            errors.pop_front();
        }
        errors.push_back(msg.into());
    }

    /// Whether an identical message is already listed (to log a bad file once, not per read).
    pub fn has_error(&self, msg: &str) -> bool {
        lock(&self.errors).iter().any(|e| e == msg)
    }

    /// A snapshot of the counters; occupancy and identity fields are filled by the caller.
    pub fn snapshot(&self) -> StatsSnapshot {
        let from_cache = self.bytes_from_cache.load(Relaxed);
        let from_source = self.bytes_from_source.load(Relaxed);
        let total = from_cache + from_source;
        let mut stall = self.stall_ns.load(Relaxed);
        if self.waiting.load(Relaxed) > 0 {
            stall += self
                .now_ns()
                .saturating_sub(self.stall_since_ns.load(Relaxed));
        }
        let refused_by = lock(&self.direct_refused_by).clone();
        StatsSnapshot {
            uptime_s: self.started.elapsed().as_secs_f64(),
            bytes_from_cache: from_cache,
            bytes_from_source: from_source,
            source_bytes_read: self.source_bytes_read.load(Relaxed),
            hit_ratio: (total > 0).then(|| from_cache as f64 / total as f64),
            passthrough_opens: self.passthrough_opens.load(Relaxed),
            bytes_passthrough: self.bytes_passthrough.load(Relaxed),
            direct_opens: self.direct_opens.load(Relaxed),
            direct_table_opens: 0,
            direct_refused: refused_by.values().sum(),
            direct_refused_by: refused_by
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect(),
            bytes_direct: self.bytes_direct.load(Relaxed),
            copies_verified: self.copies_verified.load(Relaxed),
            copies_trusted: self.copies_trusted.load(Relaxed),
            stall_s: stall as f64 / 1e9,
            bytes_pushed: self.bytes_pushed.load(Relaxed),
            files_pushed: self.files_pushed.load(Relaxed),
            reads: self.reads.load(Relaxed),
            block_hits: self.block_hits.load(Relaxed),
            block_misses: self.block_misses.load(Relaxed),
            bytes_prefetched: self.bytes_prefetched.load(Relaxed),
            bytes_staged: self.bytes_staged.load(Relaxed),
            files_staged: self.files_staged.load(Relaxed),
            blocks_evicted: self.blocks_evicted.load(Relaxed),
            fetches_in_flight: self.fetches_in_flight.load(Relaxed),
            reader_wait_s: self.reader_wait_ns.load(Relaxed) as f64 / 1e9,
            corrupt_blocks: self.corrupt_blocks.load(Relaxed),
            replies_dropped: self.replies_dropped.load(Relaxed),
            cache_full_events: self.cache_full_events.load(Relaxed),
            views_rendered: self.views_rendered.load(Relaxed),
            view_bytes: self.view_bytes.load(Relaxed),
            error_count: self.error_count.load(Relaxed),
            staging_target: self.staging_target.load(Relaxed),
            hints_accepted: self.hints_accepted.load(Relaxed),
            hints_rejected: self.hints_rejected.load(Relaxed),
            hint_bytes: self.hint_bytes.load(Relaxed),
            control_clients: self.control_clients.load(Relaxed),
            control_buffered: self.control_buffered.load(Relaxed),
            control_buffered_peak: self.control_buffered_peak.load(Relaxed),
            control_dropped: self.control_dropped.load(Relaxed),
            errors: lock(&self.errors).iter().cloned().collect(),
            ..StatsSnapshot::default()
        }
    }
}
