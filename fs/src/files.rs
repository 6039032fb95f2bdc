//! Source files through the cache: which cache entry holds which snapshot node, the read path,
//! read-ahead, cross-file prefetch and the staging plan.
//!
//! Every regular file of the snapshot gets a cache entry the first time it is read (or staged),
//! keyed by its path and the version (size, mtime, inode) the snapshot recorded; the node → entry
//! table is a plain array of ids, so a read that hits the cache costs no path computation, no
//! hash lookup and no source metadata call. After a remount the entries the index lists are
//! bound back to their nodes by comparing the stored path and version with the snapshot — an
//! entry is served only for the path it was stored for.
//!
//! The read path is `FsCore → Files → Fetcher → CacheStore | Source`: a request inside one
//! cache block is answered with a slice of that block's `Bytes` (no copy until the kernel's);
//! each file remembers the last block it served, so the kernel's 128 KiB pieces of a 1 MiB
//! block cost one read and one checksum of scratch, not eight. What the remembered blocks hold
//! is bounded for the whole daemon ([`MEMO_BUDGET`]): without the bound, 4096 active files ×
//! 1 MiB could pin 4 GiB; past it a block is served without being remembered. So that the
//! budget goes to files being read, a block is remembered only while a later request can want
//! it: not when one request took all of it (a small file), and no longer once a reader reached
//! its end. (Before, 10,000 small files read once held the whole budget, and every 128 KiB
//! piece of a large file read afterwards re-read and re-checksummed its 1 MiB block: epochs
//! of large files 2.4× slower after a pass over small ones.)

use std::num::NonZeroUsize;
use std::ops::Range;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use lru::LruCache;
use stagefs_prefetch::locks;
use stagefs_prefetch::locks::lock;
use stagefs_prefetch::readahead::ReadAhead;
use stagefs_prefetch::SMALL_FILE;
use stagefs_prefetch::{
    block_count, CacheStore, EntryId, Fetcher, FileKind, KeyKind, Loaded, Priority, Stats, Version,
    Want, BLOCK_SIZE,
};
use tracing::{debug, info, warn};

use crate::error::FsError;
use crate::sink::PageSink;
use crate::snapshot::{NodeAttr, NodeId, Snapshot};

/// No entry bound.
const NONE: u32 = u32::MAX;
/// Files whose read state (path, entry, read-ahead window, last block) is kept: the files being
/// read now by a few dozen DataLoader workers, with room to spare.
const ACTIVE_FILES: usize = 4096;
/// Bytes all files' remembered blocks may hold together: 64 readers streaming 1 MiB blocks.
pub const MEMO_BUDGET: u64 = 64 << 20;

/// Whether a file of `size` bytes is *large*: over the staging threshold [`SMALL_FILE`]. Every
/// file has an exact copy of its own in the cache; a large one's is evicted block by block
/// (so a descriptor of it is pinned), read back with direct I/O, handed to kernel passthrough
/// and pushed block by block; a small one's is evicted whole and pushed whole (the walker).
pub fn is_large(size: u64) -> bool {
    size > SMALL_FILE
}

/// The last block a file served, counted against [`MEMO_BUDGET`] while it is held.
struct Memo {
    idx: u32,
    data: Bytes,
    held: Arc<AtomicU64>,
}

impl Memo {
    /// Remembers `data` if the budget has room.
    fn new(idx: u32, data: Bytes, held: &Arc<AtomicU64>) -> Option<Memo> {
        let len = data.len() as u64;
        held.fetch_update(Relaxed, Relaxed, |h| {
            (h + len <= MEMO_BUDGET).then_some(h + len)
        })
        .ok()?;
        Some(Memo {
            idx,
            data,
            held: held.clone(),
        })
    }
}

impl Drop for Memo {
    fn drop(&mut self) {
        self.held.fetch_sub(self.data.len() as u64, Relaxed);
    }
}

/// Data of a read reply: one slice of a cached block (no copy), or bytes gathered from several.
#[derive(Debug)]
pub enum ReadData {
    /// A slice of one block.
    Slice(Bytes),
    /// Gathered from several blocks.
    Gathered(Vec<u8>),
}

impl AsRef<[u8]> for ReadData {
    fn as_ref(&self) -> &[u8] {
        match self {
            ReadData::Slice(b) => b,
            ReadData::Gathered(v) => v,
        }
    }
}

impl ReadData {
    /// The bytes as a vector (tests).
    pub fn to_vec(&self) -> Vec<u8> {
        self.as_ref().to_vec()
    }
}

/// What a reader of one file needs, kept while the file is in use.
pub struct FileState {
    /// The node.
    pub node: NodeId,
    /// Its path relative to the source root.
    pub rel: Arc<Path>,
    /// The version the snapshot recorded.
    pub version: Version,
    /// Its cache entry.
    pub entry: EntryId,
    /// Sequential detection for readers without a handle of their own.
    pub ra: Mutex<ReadAhead>,
    memo: Mutex<Option<Memo>>,
    /// Pushes ahead of a sequential reader ([`crate::stream`]).
    stream: Mutex<crate::stream::Stream>,
    /// End of the last read request: a pusher skips the blocks a reader has asked for already.
    read_to: Arc<AtomicU64>,
}

/// Source files through the cache.
pub struct Files {
    snapshot: Arc<Snapshot>,
    fetcher: Fetcher,
    entries: RwLock<Vec<AtomicU32>>,
    active: Mutex<LruCache<NodeId, Arc<FileState>>>,
    cross_file: usize,
    xfile: Mutex<Option<SyncSender<NodeId>>>,
    sink: RwLock<Option<Arc<dyn PageSink>>>,
    /// The pusher threads' queue (none before they start and after [`Files::stop`]).
    pushers: Mutex<Option<SyncSender<crate::stream::Push>>>,
    /// Push large files ahead of streaming readers (a lever, off by default).
    push_ahead: AtomicBool,
    /// Bytes held by all files' remembered blocks.
    memo_held: Arc<AtomicU64>,
    /// This node's declared part: staging and speculation keep to it.
    scope: Arc<crate::scope::Scope>,
}

impl Files {
    /// Files of `snapshot` served through `fetcher`; `cross_file` files after an opened small
    /// file are fetched ahead (0: none).
    pub fn new(snapshot: Arc<Snapshot>, fetcher: Fetcher, cross_file: usize) -> Arc<Files> {
        let cap = NonZeroUsize::new(ACTIVE_FILES).unwrap_or(NonZeroUsize::MIN);
        Arc::new(Files {
            snapshot,
            fetcher,
            entries: RwLock::new(Vec::new()),
            active: Mutex::new(LruCache::new(cap)),
            cross_file,
            xfile: Mutex::new(None),
            sink: RwLock::new(None),
            pushers: Mutex::new(None),
            push_ahead: AtomicBool::new(false),
            memo_held: Arc::new(AtomicU64::new(0)),
            scope: Arc::default(),
        })
    }

    /// This node's declared part ([`crate::scope`]).
    pub fn scope(&self) -> &Arc<crate::scope::Scope> {
        &self.scope
    }

    /// The snapshot the files belong to.
    pub fn snapshot(&self) -> &Arc<Snapshot> {
        &self.snapshot
    }

    /// Lets the walker push cached files into the kernel's page cache through `sink` (the
    /// fuser adapter's notifier), or stops it (`None`).
    pub fn set_page_sink(&self, sink: Option<Arc<dyn PageSink>>) {
        *locks::write(&self.sink) = sink;
    }

    /// Whether streaming readers of large files get the file pushed ahead of them.
    pub fn set_push_ahead(&self, on: bool) {
        self.push_ahead.store(on, Relaxed);
    }

    /// The page sink, if pushing is on.
    pub fn page_sink(&self) -> Option<Arc<dyn PageSink>> {
        locks::read(&self.sink).clone()
    }

    /// Bytes held by the files' remembered blocks (at most [`MEMO_BUDGET`]).
    pub fn memo_bytes(&self) -> u64 {
        self.memo_held.load(Relaxed)
    }

    /// The fetcher.
    pub fn fetcher(&self) -> &Fetcher {
        &self.fetcher
    }

    fn store(&self) -> &Arc<CacheStore> {
        self.fetcher.store()
    }

    /// Whether every block of cache entry `entry` is cached.
    pub(crate) fn is_cached(&self, entry: EntryId) -> bool {
        self.store().is_complete(entry)
    }

    /// Block `slot` of cache entry `entry` if it is cached and intact: read from scratch and
    /// verified, as for a reader (a corrupt block is dropped, a miss). What the walker and the
    /// pushers hand the kernel; they never reach the store themselves.
    pub(crate) fn cached_block(&self, entry: EntryId, slot: u32) -> Option<Bytes> {
        self.store().read(entry, slot)
    }

    fn stats(&self) -> &Arc<Stats> {
        self.fetcher.stats()
    }

    /// The entry bound to `node`, if any.
    pub fn bound(&self, node: NodeId) -> Option<EntryId> {
        let t = locks::read(&self.entries);
        let id = t.get(node as usize)?.load(Relaxed);
        (id != NONE).then_some(id)
    }

    /// Binds `node` to `entry` unless it already has one; returns the entry it has now.
    fn bind(&self, node: NodeId, entry: EntryId) -> EntryId {
        {
            let t = locks::read(&self.entries);
            if let Some(slot) = t.get(node as usize) {
                return match slot.compare_exchange(NONE, entry, Relaxed, Relaxed) {
                    Ok(_) => entry,
                    Err(other) => other,
                };
            }
        }
        let mut t = locks::write(&self.entries);
        let want = (self.snapshot.len().max(node as usize + 1) + 1024).next_power_of_two();
        while t.len() < want {
            t.push(AtomicU32::new(NONE));
        }
        match t[node as usize].compare_exchange(NONE, entry, Relaxed, Relaxed) {
            Ok(_) => entry,
            Err(other) => other,
        }
    }

    /// Forgets the entry of `node` (its source changed): a later read caches the new version.
    pub fn unbind(&self, node: NodeId) {
        let t = locks::read(&self.entries);
        if let Some(slot) = t.get(node as usize) {
            let old = slot.swap(NONE, Relaxed);
            if old != NONE {
                self.store().forget(old);
            }
        }
        drop(t);
        lock(&self.active).pop(&node);
    }

    /// The cache entry of file `node` (version `version`, path `rel`), created if it has none.
    fn entry_of(&self, node: NodeId, version: Version, rel: &Path) -> EntryId {
        if let Some(id) = self.bound(node) {
            return id;
        }
        let id = self.store().create(
            KeyKind::Raw,
            rel.as_os_str().as_bytes(),
            version,
            block_count(version.size) as u32,
            // Every file an exact copy of its own, small ones too: a reader is handed the
            // copy itself (docs/direct.md), which a file packed in a segment could not be.
            true,
            node,
        );
        let got = self.bind(node, id);
        if got != id {
            // Another reader created one at the same time: keep theirs.
            self.store().forget(id);
        }
        got
    }

    /// The read state of file `node` (attributes `attr`).
    pub fn state(&self, node: NodeId, attr: &NodeAttr) -> Result<Arc<FileState>, FsError> {
        if let Some(s) = lock(&self.active).get(&node) {
            return Ok(s.clone());
        }
        let rel: Arc<Path> = self.snapshot.path(node).ok_or(FsError::NotFound)?.into();
        let version = attr.version();
        let entry = self.entry_of(node, version, &rel);
        let s = Arc::new(FileState {
            node,
            rel,
            version,
            entry,
            ra: Mutex::new(ReadAhead::default()),
            memo: Mutex::new(None),
            stream: Mutex::new(crate::stream::Stream::default()),
            read_to: Arc::new(AtomicU64::new(0)),
        });
        lock(&self.active).put(node, s.clone());
        Ok(s)
    }

    fn want(s: &FileState, slot: u64) -> Want {
        Want {
            entry: s.entry,
            slot: slot as u32,
            rel: s.rel.clone(),
            version: s.version,
        }
    }

    /// Block `idx` of `s` for a reader, counting bytes `lo..hi` of it as served.
    fn block(&self, s: &FileState, idx: u64, served: Range<usize>) -> Result<Bytes, FsError> {
        let stats = self.stats();
        let remembered = {
            let mut memo = lock(&s.memo);
            match memo.as_ref() {
                Some(m) if u64::from(m.idx) == idx => {
                    let data = m.data.clone();
                    // A reader that has reached the block's end is done with it: its bytes go
                    // back to the budget now, not when the next block or another file comes.
                    if served.end >= data.len() {
                        *memo = None;
                    }
                    Some(data)
                }
                _ => None,
            }
        };
        let (data, hit) = match remembered {
            Some(b) => (b, true),
            None => {
                let f = self.fetcher.block(&Self::want(s, idx)).map_err(|e| {
                    let e = FsError::from(e);
                    if let FsError::Stale(_) = e {
                        self.report_stale(s);
                    } else {
                        stats.error(e.to_string());
                    }
                    e
                })?;
                {
                    let mut memo = lock(&s.memo);
                    // The old block's bytes go back to the budget before the new one asks.
                    *memo = None;
                    // Only a block with bytes left for a later request is worth holding: a
                    // request for the whole block (a small file read at once, a direct-I/O
                    // read) leaves nothing to remember.
                    if served.start > 0 || served.end < f.data.len() {
                        *memo = Memo::new(idx as u32, f.data.clone(), &self.memo_held);
                    }
                }
                if is_large(s.version.size) {
                    self.push_rest(s, idx, &f.data, served.clone());
                }
                (f.data, f.hit)
            }
        };
        let n = served.end.min(data.len()).saturating_sub(served.start) as u64;
        if hit {
            stats.bytes_from_cache.fetch_add(n, Relaxed);
        } else {
            stats.bytes_from_source.fetch_add(n, Relaxed);
        }
        Ok(data)
    }

    fn report_stale(&self, s: &FileState) {
        let msg = format!(
            "{} changed on the source since the snapshot was taken: reads fail with ESTALE \
             (remount with --rescan, or use --revalidate, to see the new version)",
            s.rel.display()
        );
        if !self.stats().has_error(&msg) {
            warn!("{msg}");
            self.stats().error(msg);
        }
    }

    /// Reads up to `size` bytes at `offset` of `s` (read-ahead state `ra`).
    pub fn read(
        &self,
        s: &FileState,
        ra: &Mutex<ReadAhead>,
        offset: u64,
        size: u32,
    ) -> Result<ReadData, FsError> {
        let fsize = s.version.size;
        let end = offset.saturating_add(u64::from(size)).min(fsize);
        if offset >= end {
            return Ok(ReadData::Gathered(Vec::new()));
        }
        self.stats().reads.fetch_add(1, Relaxed);
        if let Some(ahead) = lock(ra).on_read(offset, u64::from(size), fsize) {
            // Inside the declared part only: never into other nodes' rows.
            match self.scope.clip(s.node, ahead.clone()) {
                None => self.prefetch_bytes(s, ahead),
                Some(parts) => parts.into_iter().for_each(|r| self.prefetch_bytes(s, r)),
            }
        }
        if is_large(fsize) {
            s.read_to.store(end, Relaxed);
            self.push_ahead(s, offset, end);
        }
        let first = offset / BLOCK_SIZE;
        let last = (end - 1) / BLOCK_SIZE;
        let piece = |idx: u64| {
            let bstart = idx * BLOCK_SIZE;
            let lo = (offset.max(bstart) - bstart) as usize;
            let hi = (end.min(bstart + BLOCK_SIZE) - bstart) as usize;
            lo..hi
        };
        if first == last {
            let r = piece(first);
            let b = self.block(s, first, r.clone())?;
            let hi = r.end.min(b.len());
            return Ok(ReadData::Slice(b.slice(r.start.min(hi)..hi)));
        }
        let mut out = Vec::with_capacity((end - offset) as usize);
        for idx in first..=last {
            let r = piece(idx);
            let b = self.block(s, idx, r.clone())?;
            let hi = r.end.min(b.len());
            out.extend_from_slice(&b[r.start.min(hi)..hi]);
        }
        Ok(ReadData::Gathered(out))
    }

    /// Offers the pushers cached blocks to hand to the kernel: dropped when their queue is full
    /// or closed (a push is a hint, never a wait).
    pub(crate) fn offer_push(&self, push: crate::stream::Push) {
        if let Some(tx) = lock(&self.pushers).as_ref() {
            let _ = tx.try_send(push);
        }
    }

    /// Offers the pushers the pages of block `idx` of large file `s` that the request reading
    /// it (`served`) did not ask for: the block is in memory and verified (see
    /// [`crate::stream`]).
    fn push_rest(&self, s: &FileState, idx: u64, data: &Bytes, served: Range<usize>) {
        if lock(&s.stream).streaming() || self.page_sink().is_none() {
            return;
        }
        let ino = crate::inode::source_ino(s.node);
        for r in crate::stream::rest_of_block(data.len(), served) {
            if !r.is_empty() {
                self.offer_push(crate::stream::Push::Bytes {
                    ino,
                    offset: idx * BLOCK_SIZE + r.start as u64,
                    data: data.slice(r),
                });
            }
        }
    }

    /// Offers the pushers the cached blocks ahead of a sequential reader of a large file.
    fn push_ahead(&self, s: &FileState, offset: u64, end: u64) {
        // The file's own lock on every read; the shared one only once per push window.
        let Some(blocks) = lock(&s.stream).on_read(offset, end, s.version.size) else {
            return;
        };
        if !self.push_ahead.load(Relaxed) {
            return;
        }
        self.offer_push(crate::stream::Push::Blocks {
            ino: crate::inode::source_ino(s.node),
            entry: s.entry,
            size: s.version.size,
            blocks,
            read_to: Some(s.read_to.clone()),
        });
    }

    /// Queues the blocks of bytes `range` of `s` for fetching ahead (read-ahead priority).
    pub(crate) fn prefetch_bytes(&self, s: &FileState, range: Range<u64>) {
        if range.start >= range.end {
            return;
        }
        let blocks = range.start / BLOCK_SIZE..(range.end - 1) / BLOCK_SIZE + 1;
        let n = block_count(s.version.size);
        self.fetcher.prefetch(
            blocks.filter(|b| *b < n).map(|b| Self::want(s, b)),
            Priority::ReadAhead,
        );
    }

    /// Every block of file `node` not cached yet, as fetch requests (staging, cross-file).
    pub fn missing_blocks(&self, node: NodeId) -> Vec<Want> {
        let Some(attr) = self.snapshot.attr(node) else {
            return Vec::new();
        };
        if attr.kind != FileKind::File || attr.size == 0 {
            return Vec::new();
        }
        // Cached already: one check, no read state built.
        if self.bound(node).is_some_and(|e| self.is_cached(e)) {
            return Vec::new();
        }
        let Ok(s) = self.state(node, &attr) else {
            return Vec::new();
        };
        if self.is_cached(s.entry) {
            return Vec::new();
        }
        (0..block_count(attr.size))
            .filter(|b| !self.store().contains(s.entry, *b as u32))
            .filter(|b| {
                let start = b * BLOCK_SIZE;
                self.scope
                    .allows(node, start..(start + BLOCK_SIZE).min(attr.size))
            })
            .map(|b| Self::want(&s, b))
            .collect()
    }

    /// Notes that small file `node` was opened: the files after it in its directory are
    /// fetched ahead by the cross-file thread (dropped if it is busy; the next open asks again).
    pub fn opened(&self, node: NodeId, size: u64) {
        if is_large(size) {
            return;
        }
        if let Some(tx) = lock(&self.xfile).as_ref() {
            if let Err(TrySendError::Disconnected(_)) = tx.try_send(node) {
                warn!("cross-file prefetch thread is gone");
            }
        }
    }

    /// Hands first opens of small files to the walker through `tx` ([`crate::walk::start`]).
    pub(crate) fn set_walker(&self, tx: SyncSender<NodeId>) {
        *lock(&self.xfile) = Some(tx);
    }

    /// The cross-file prefetch depth (0: no walker).
    pub(crate) fn cross_file(&self) -> usize {
        self.cross_file
    }

    /// Hands pushes to the pusher threads ([`crate::pushers::start`]).
    pub(crate) fn set_pushers(&self, tx: SyncSender<crate::stream::Push>) {
        *lock(&self.pushers) = Some(tx);
    }

    /// Ends the cross-file thread and the pushers (they exit when their channels close).
    pub fn stop(&self) {
        lock(&self.xfile).take();
        // Dropping the sender closes the queue: the threads end after the push in hand.
        lock(&self.pushers).take();
    }

    /// Binds the entries a previous mount left in the cache to the snapshot's nodes (same path
    /// and same version), forgetting the rest. Returns the view entries, for the views.
    pub fn bind_loaded(&self, mut loaded: Loaded) -> Vec<(stagefs_prefetch::LoadedEntry, Vec<u8>)> {
        let same = loaded.snapshot == self.snapshot.id();
        let (mut bound, mut dropped) = (0usize, 0usize);
        let views = loaded.take_kind(KeyKind::View);
        // Entries were cached roughly directory by directory: remember the last directory
        // resolved, so most keys cost one name lookup rather than a walk from the root.
        let mut last_dir: Option<(PathBuf, NodeId)> = None;
        for le in &loaded.entries {
            let key = Path::new(std::ffi::OsStr::from_bytes(loaded.key(le)));
            let hinted = (same && (le.owner as usize) < self.snapshot.len())
                .then_some(le.owner)
                .filter(|n| self.snapshot.is_at(*n, key));
            let node = hinted.or_else(|| {
                let (parent, name) = (key.parent()?, key.file_name()?);
                let dir = match &last_dir {
                    Some((p, d)) if p == parent => *d,
                    _ => {
                        let d = self.snapshot.resolve(parent).ok().flatten()?;
                        last_dir = Some((parent.to_path_buf(), d));
                        d
                    }
                };
                self.snapshot.lookup(dir, name).ok().flatten()
            });
            let ok = node
                .and_then(|n| self.snapshot.attr(n).map(|a| (n, a)))
                .filter(|(_, a)| a.kind == FileKind::File && a.version() == le.version);
            match ok {
                Some((n, _)) if self.bind(n, le.id) == le.id => {
                    if le.owner != n {
                        self.store().bind(le.id, n);
                    }
                    bound += 1;
                }
                _ => {
                    self.store().forget(le.id);
                    dropped += 1;
                }
            }
        }
        if let Err(e) = self.store().set_snapshot(self.snapshot.id()) {
            warn!(error = %e, "could not record the snapshot in the cache log");
        }
        info!(bound, dropped, "cache entries bound to the snapshot");
        views
    }

    /// The staging plan: every regular file in directory order, small files first, and their
    /// total size.
    pub fn staging_plan(&self) -> (Vec<NodeId>, u64) {
        let mut files = Vec::new();
        let mut total = 0u64;
        self.snapshot.walk(|id, attr| {
            if attr.kind == FileKind::File && attr.size > 0 {
                files.push((id, attr.size));
                total = total.saturating_add(attr.size);
            }
        });
        debug!(files = files.len(), total, "staging plan");
        (stagefs_prefetch::staging::order(files), total)
    }
}
