//! Following readers through directories: cross-file prefetch, and pushing cached files into
//! the kernel's page cache ahead of a reader walking a directory in order.
//!
//! Every first read of a small file (at offset 0) sends its node to one walker thread (a
//! bounded channel; a signal is dropped when the thread is busy, the next one asks again). The
//! walker finds the file's place in its directory from the snapshot (O(1): children are an id
//! range) and, per directory, remembers where the last reader was:
//!
//! - **Prefetch** (any reader): the next [`CROSS_FILE_COUNT`](crate::fscore::CROSS_FILE_COUNT)
//!   files of the directory that are not cached yet go to the fetcher's read-ahead queue; a
//!   window per directory means a reader costs one hand-out per half window, and files already
//!   cached cost one check each — no path is built, nothing is allocated per file.
//! - **Push** (a reader walking the directory in order — ImageFolder order, `tar`, `cp`, a
//!   sequential loader): once a reader reads the file right after the one it read last, the
//!   next [`PUSH_FILES`] cached files (at most [`PUSH_BYTES`]) are read from scratch, verified,
//!   and handed to the kernel as page-cache contents (`FUSE_NOTIFY_STORE`, allowed for an
//!   unprivileged daemon). The reader then finds them in the page cache: no request, no round
//!   trip, no wake-up of a daemon thread — on a warm epoch a sequential reader pays one round
//!   trip per window instead of one per file. The reader's next request is for the file after
//!   the window, which counts as in order and pushes the next window. A reader faster than the
//!   walker overtakes it; files it has already asked for are not pushed any more.
//!
//! Pushes need a [`PageSink`] (the fuser adapter's notifier; tests record them) and snapshot
//! semantics: with `--revalidate` a file may change, and pages pushed once would outlive it.

use std::collections::VecDeque;
use std::num::NonZeroUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::thread::JoinHandle;

use lru::LruCache;
use stagefs_prefetch::{block_count, FileKind, Priority, BLOCK_SIZE};
use tracing::{debug, debug_span};

use crate::files::{is_large, Files};
use crate::sink::PageSink;
use crate::snapshot::{NodeAttr, NodeId};

/// Files pushed ahead of an in-order reader per window: 64 ImageNet images are ~7 MB of page
/// cache and one round trip per 64 files, a fraction of the cost of one request per file.
pub const PUSH_FILES: usize = 64;
/// Most bytes pushed per window, so a directory of larger files does not flood the page cache.
pub const PUSH_BYTES: u64 = 32 << 20;
/// First opens waiting for the walker; more are dropped (the next open asks again).
const QUEUE: usize = 64;
/// Directories whose walk state is kept (readers walking many directories at once).
const WALKS: usize = 256;

/// What the walker knows of one directory.
#[derive(Clone, Copy, Default)]
struct Walk {
    /// Index of the file a reader read last.
    last: Option<usize>,
    /// Indexes handed to the prefetcher: `lo..hi`.
    fetched: (usize, usize),
    /// Indexes below this were pushed (or found not cacheable) by the last window.
    pushed_hi: usize,
}

/// Starts the walker over `files` (none when cross-file prefetch is off); it ends when
/// [`Files::stop`] drops its channel.
pub(crate) fn start(files: &Arc<Files>) -> std::io::Result<Option<JoinHandle<()>>> {
    let count = files.cross_file();
    if count == 0 {
        return Ok(None);
    }
    let (tx, rx) = std::sync::mpsc::sync_channel::<NodeId>(QUEUE);
    files.set_walker(tx);
    let files = files.clone();
    let t = std::thread::Builder::new()
        .name("stagefs-walk".into())
        .spawn(move || run(&files, rx, count))?;
    Ok(Some(t))
}

/// The walker thread's loop: runs until the channel closes (see [`Files::stop`]).
fn run(files: &Files, rx: Receiver<NodeId>, count: usize) {
    let cap = NonZeroUsize::new(WALKS).unwrap_or(NonZeroUsize::MIN);
    let mut walks: LruCache<NodeId, Walk> = LruCache::new(cap);
    let mut pending: VecDeque<NodeId> = VecDeque::new();
    loop {
        let node = match pending.pop_front() {
            Some(n) => n,
            None => match rx.recv() {
                Ok(n) => n,
                Err(_) => return,
            },
        };
        let Some((dir, pos)) = files.snapshot().position(node) else {
            continue;
        };
        let w = walks.get_or_insert_mut(dir, Walk::default);
        let in_order = w
            .last
            .is_some_and(|l| pos > l && pos <= (l + 1).max(w.pushed_hi));
        w.last = Some(pos);
        if in_order && files.page_sink().is_some() {
            let from = (pos + 1).max(w.pushed_hi);
            let to = pos + 1 + PUSH_FILES;
            w.pushed_hi = to;
            let walk = *w;
            push_window(files, &rx, &mut pending, &mut walks, dir, walk, from..to);
            continue;
        }
        let (lo, hi) = w.fetched;
        let inside = lo <= pos && pos < hi;
        if inside && hi - pos > count / 2 {
            continue;
        }
        let start = if inside { hi } else { pos + 1 };
        let end = pos + 1 + count;
        w.fetched = (if inside { lo } else { pos }, end);
        for (id, attr) in files.snapshot().children(dir, start..end) {
            prefetch(files, id, &attr);
        }
    }
}

/// Small regular files only: large ones have their own read-ahead.
fn small_file(attr: &NodeAttr) -> bool {
    attr.kind == FileKind::File && attr.size > 0 && !is_large(attr.size)
}

fn prefetch(files: &Files, id: NodeId, attr: &NodeAttr) {
    if small_file(attr) {
        let wants = files.missing_blocks(id);
        if !wants.is_empty() {
            files.fetcher().prefetch(wants, Priority::ReadAhead);
        }
    }
}

/// Pushes the cached files at indexes `range` of `dir` (prefetching the others), stopping
/// early at the byte budget, and skipping files a reader has asked for meanwhile (signals
/// that arrive while pushing are noted and queued in `pending` for the main loop).
fn push_window(
    files: &Files,
    rx: &Receiver<NodeId>,
    pending: &mut VecDeque<NodeId>,
    walks: &mut LruCache<NodeId, Walk>,
    dir: NodeId,
    walk: Walk,
    range: std::ops::Range<usize>,
) {
    let _span = debug_span!("push", dir, from = range.start, to = range.end).entered();
    let Some(sink) = files.page_sink() else {
        return;
    };
    let first = range.start;
    let mut reader_at = walk.last.unwrap_or(0);
    let mut bytes = 0u64;
    for (k, (id, attr)) in files
        .snapshot()
        .children(dir, range)
        .into_iter()
        .enumerate()
    {
        // Has a reader of this directory got past this file already?
        while let Ok(n) = rx.try_recv() {
            if let Some((d, p)) = files.snapshot().position(n) {
                if d == dir {
                    reader_at = reader_at.max(p);
                }
            }
            pending.push_back(n);
        }
        if first + k <= reader_at || !small_file(&attr) {
            continue;
        }
        if bytes >= PUSH_BYTES {
            // Out of budget: the reader's request for this file starts the next window.
            if let Some(w) = walks.get_mut(&dir) {
                w.pushed_hi = w.pushed_hi.min(first + k);
            }
            return;
        }
        match push_file(files, &*sink, id, &attr) {
            Some(n) => bytes += n,
            None => prefetch(files, id, &attr),
        }
    }
    debug!(bytes, "pushed");
}

/// Hands file `id`'s cached, verified blocks to the kernel; the bytes pushed, or `None` if it
/// is not fully cached (or the kernel refused it).
fn push_file(files: &Files, sink: &dyn PageSink, id: NodeId, attr: &NodeAttr) -> Option<u64> {
    let entry = files.bound(id)?;
    if !files.is_cached(entry) {
        return None;
    }
    let ino = crate::inode::source_ino(id);
    if !sink.holds(ino) {
        return None;
    }
    let mut n = 0u64;
    for slot in 0..block_count(attr.size) {
        // Read and checksummed as for a reader: a corrupt block is dropped, never pushed.
        let data = files.cached_block(entry, slot as u32)?;
        if !sink.store(ino, slot * BLOCK_SIZE, &data) {
            return None;
        }
        n += data.len() as u64;
    }
    let stats = files.fetcher().stats();
    stats.files_pushed.fetch_add(1, Relaxed);
    stats.bytes_pushed.fetch_add(n, Relaxed);
    Some(n)
}
