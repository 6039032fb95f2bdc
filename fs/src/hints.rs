//! Read-order hints: a reader that knows which bytes it will read next (`stagefs.Loader` holds
//! its permutation of rows) tells the daemon, and the daemon fetches (source files), renders
//! (`.npy/` views) and pushes those bytes into the kernel's page cache ahead of the reader.
//!
//! **Channel.** The mount is read-only, so a control *file* cannot be written: hints go to a
//! Unix stream socket, `hints.sock` in the mount's cache directory. That directory is 0700 and
//! owned by the user who mounted (checked by [`stagefs_prefetch::cachedir`]), so only they can
//! reach the socket; the socket itself is made 0600. Its path is in the stats file
//! (`MOUNTPOINT/.stagefs/stats`, field `hint_socket`): a client finds the mount holding a file by
//! walking up from it to the first directory with a `.stagefs/stats`. A path longer than a
//! socket address can hold (108 bytes) is bound and reached through `/proc/self/fd/N/hints.sock`
//! with `N` a descriptor of the cache directory.
//!
//! **Protocol** ([`stagefs_protocol`], shared with the clients). One JSON object per line:
//! `{"path": "rel/path/under/the/mount", "ranges": [[offset, len], ...]}`; a path under
//! `.npy/` names a view. No reply. Each line is validated on its own: a malformed line, an
//! unknown path, a range outside the file, or a line over a bound is ignored with a logged reason
//! (at most one log line per [`LOG_EVERY`], the rest counted) and counted in `hints_rejected`;
//! an accepted one in `hints_accepted` and its bytes in `hint_bytes`. A hint never changes the
//! bytes a reader gets and never fails a read: it only warms the cache and the page cache.
//! `direct_open` / `direct_close` / `direct_table` lines are answered on the client's own
//! connection thread ([`crate::direct`]); that thread holds the connection's pins and releases
//! them when the connection ends. So is `stats_now`: the counters rendered at the request (the
//! stats file's rendering is shared for up to a second), so a client waits on an answer rather
//! than on time.
//!
//! **Bounds.** [`MAX_LINE`] bytes per line (64 KiB: [`MAX_RANGES`] ranges of two 20-digit
//! numbers need ~45 KiB), [`MAX_RANGES`] ranges (1024: a few batches of rows) and
//! [`MAX_HINT_BYTES`] bytes per line (256 MiB: the fetcher's queue holds 256 blocks of 1 MiB,
//! more would only be dropped), [`MAX_CONNECTIONS`] clients (256: a node's loaders and
//! preloaded processes, one per process), [`QUEUE`] lines waiting for the worker (then the client's writes wait:
//! back-pressure, not unbounded memory), [`CONTROL_BUDGET`] bytes of request lines held by all
//! connections together (read buffers, partial lines, queued lines; a connection that would
//! take more is dropped, counted in `control_dropped`; what is held is `control_buffered` in
//! the stats), [`PENDING`] source blocks waiting to be cached before
//! they are pushed (dropped after [`PENDING_AGE`]), [`RENDERS`] view renders on the view pool at
//! once, so hinted renders never fill the pool's queue ahead of readers' requests.
//!
//! **Work.** Threads of its own, never FUSE threads: a listener, one thread per client reading
//! lines, one worker applying them, one pushing rendered view pieces. Source ranges: the
//! blocks go to the fetcher's read-ahead queue; blocks cached already, and queued ones once
//! they are, go to the page-cache pushers
//! ([`crate::stream`]: read and checksummed as for a reader, only inodes the kernel holds).
//! View ranges (page-aligned, in pieces of at most 4 MiB so the jobs' buffers stay small) are
//! rendered on the view pool ([`crate::offload`]) so they are cached, then pushed by a pusher
//! thread of this module — never by a pool thread: a push waits for the page locks of reads in
//! flight, and the replies to view reads come from the pool. Everything stops with the mount.
//!
//! **Parts.** The service ([`HintService`]) is built with the mount, before the socket: lines
//! can be applied without it ([`HintService::hint`], on the caller's thread). It gets the
//! mount's [`MountHandle`], its views, its inode numbers (pushes to a view go to its inode)
//! and the direct service that answers `direct_open` lines, not the core. The socket, its
//! threads and where views render ([`Renderer`]) make up a [`HintServer`], started once the
//! kernel session runs and stopped with the mount.

use std::collections::{HashSet, VecDeque};
use std::io::{BufRead, BufReader, ErrorKind, Read};
use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lru::LruCache;
use stagefs_prefetch::{block_count, EntryId, FileKind, BLOCK_SIZE};
use tracing::{debug, warn};

/// The protocol's messages and bounds ([`stagefs_protocol`], shared with the clients).
pub use stagefs_protocol::{
    parse, Hint, Rejected, MAX_CONNECTIONS, MAX_HINT_BYTES, MAX_LINE, MAX_RANGES, SOCKET_NAME,
};
use stagefs_protocol::{parse_request, Reply, Request};

/// At most one log line per this interval about rejected hints.
pub use crate::handle::LOG_EVERY;

use crate::control::VIEW_DIR;
use crate::direct::{DirectPins, DirectService, Refusal};
use crate::files::is_large;
use crate::handle::MountHandle;
use crate::inode::{InodeTable, Virtual};
use crate::offload::Offload;
use crate::views::{MountViews, OpenView, Views};
use stagefs_prefetch::locks::lock;

/// Lines waiting for the worker.
pub const QUEUE: usize = 64;
/// Source blocks waiting to be cached before they are pushed.
pub const PENDING: usize = 4096;
/// How long a hinted block may take to be cached before its push is given up.
pub const PENDING_AGE: Duration = Duration::from_secs(30);
/// Hinted view renders on the view pool at once.
pub const RENDERS: usize = 8;
/// Bytes of request lines the control socket holds at once, all connections together: partial
/// lines in the connections' buffers, each connection's read buffer, and the lines queued for
/// the worker. 8 MiB: [`QUEUE`] full lines of [`MAX_LINE`] take 4 MiB, and 256 connections
/// each holding a line of almost [`MAX_LINE`] would take ~35 MiB. A connection whose buffer
/// would take the total past it is dropped (counted in `control_dropped`). The first
/// [`FREE_PER_CONNECTION`] bytes of each connection are always granted (counted, never
/// refused), so clients with short lines are served whatever others hold: the total stays under
/// `CONTROL_BUDGET + MAX_CONNECTIONS × FREE_PER_CONNECTION` (11 MiB).
pub const CONTROL_BUDGET: u64 = 8 << 20;
/// Bytes of one connection never refused: its read buffer and a partial line of 4 KiB (every
/// request but a long hint fits).
pub const FREE_PER_CONNECTION: u64 = READ_BUF as u64 + (4 << 10);
/// Each connection's read buffer: 8 KiB, what `BufReader` takes by default.
const READ_BUF: usize = 8 << 10;
/// Views kept open by the worker (one per file a loader reads).
const OPEN_VIEWS: usize = 64;
/// Blocks remembered as pushed, so a row range hinted twice is not pushed twice.
const PUSHED: usize = 4096;
/// Most bytes of a view one render job renders and pushes (whole pages): 4 MiB, so the jobs
/// on the pool hold at most [`RENDERS`] × 4 MiB.
const VIEW_PIECE: u64 = 4 << 20;
/// Rendered view pieces waiting for the view pusher (then dropped): 8 × 4 MiB at most.
const VIEW_PUSHES: usize = 8;
/// Page size for pushes: partial pages are not kept by the kernel.
const PAGE: u64 = 4096;
/// How often waiting threads look at the stop flag.
const TICK: Duration = Duration::from_millis(100);

/// A hinted source block waiting to be cached before it is pushed.
#[derive(Clone, Copy)]
struct Pending {
    ino: u64,
    entry: EntryId,
    size: u64,
    slot: u64,
    since: Instant,
}

/// Hinted source blocks waiting to be cached, in hint order, each once.
#[derive(Default)]
struct PendingBlocks {
    queue: VecDeque<Pending>,
    known: HashSet<(EntryId, u64)>,
}

/// The read-order hint service of a mount (see the module docs).
pub struct HintService {
    mount: MountHandle,
    /// The `.npy/` views, for hints naming one.
    views: Arc<MountViews>,
    /// Inode numbers, for pushes into a view's pages.
    inodes: Arc<InodeTable>,
    /// Answers the `direct_open` and `direct_close` lines of the socket's clients.
    direct: Arc<DirectService>,
    pending: Mutex<PendingBlocks>,
    pushed: Mutex<LruCache<(EntryId, u64), ()>>,
    /// Views opened for hints, by path under `.npy/`.
    open_views: Mutex<LruCache<PathBuf, Arc<OpenView>>>,
    /// Hinted renders on the view pool now, and the condition the worker waits on for room.
    renders: Arc<(Mutex<usize>, Condvar)>,
    last_log: Mutex<Option<Instant>>,
    unlogged: AtomicU64,
}

/// Where hinted view pieces are rendered and who pushes them. By default on the thread that
/// applies the hint, which pushes them too; a running [`HintServer`] renders on the view pool
/// and pushes from its pusher thread.
#[derive(Clone, Default)]
pub struct Renderer {
    /// Renders on the pool (`None`: on the thread applying the hint).
    pool: Option<Offload>,
    /// Rendered view pieces for the view pusher thread (`None`: pushed by the render job).
    pushes: Option<SyncSender<ViewPush>>,
}

/// Rendered bytes of view inode `ino` at `offset`, to push.
struct ViewPush {
    ino: u64,
    offset: u64,
    data: crate::files::ReadData,
}

/// The running socket server: stopped by [`HintServer::stop`].
pub struct HintServer {
    path: PathBuf,
    /// Where to connect to wake the listener (the path, or its `/proc/self/fd` form).
    addr: PathBuf,
    stop: Arc<AtomicBool>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// The listening socket, to shut down at stop: that wakes accept() even when the socket's
    /// path is gone (a connect to it would then fail and leave the listener, and the daemon's
    /// exit, waiting for ever).
    waker: UnixListener,
    /// Keeps the `/proc/self/fd/N` form of the address valid.
    _dir: Option<std::fs::File>,
    /// Where the worker renders views (for [`HintServer::renderer`]).
    renderer: Renderer,
}

impl HintService {
    /// The service of the mount `mount`, with its views, inode numbers and direct service.
    pub fn new(
        mount: MountHandle,
        views: Arc<MountViews>,
        inodes: Arc<InodeTable>,
        direct: Arc<DirectService>,
    ) -> HintService {
        let n = |k: usize| NonZeroUsize::new(k).unwrap_or(NonZeroUsize::MIN);
        HintService {
            mount,
            views,
            inodes,
            direct,
            pending: Mutex::new(PendingBlocks::default()),
            pushed: Mutex::new(LruCache::new(n(PUSHED))),
            open_views: Mutex::new(LruCache::new(n(OPEN_VIEWS))),
            renders: Arc::default(),
            last_log: Mutex::new(None),
            unlogged: AtomicU64::new(0),
        }
    }

    /// Applies one hint line (as the socket's worker does), rendering views as `on` says:
    /// the bytes it names, or why it was ignored. Counted in the stats either way; a rejection
    /// is logged (rate-limited).
    pub fn hint(&self, line: &[u8], on: &Renderer) -> Result<u64, Rejected> {
        let stats = self.mount.stats();
        match parse(line).and_then(|h| self.apply_hint(&h, on)) {
            Ok(bytes) => {
                stats.hints_accepted.fetch_add(1, Relaxed);
                stats.hint_bytes.fetch_add(bytes, Relaxed);
                Ok(bytes)
            }
            Err(e) => {
                stats.hints_rejected.fetch_add(1, Relaxed);
                self.log_rejected(&e);
                Err(e)
            }
        }
    }

    fn log_rejected(&self, e: &Rejected) {
        let mut last = lock(&self.last_log);
        if last.is_some_and(|t| t.elapsed() < LOG_EVERY) {
            self.unlogged.fetch_add(1, Relaxed);
            return;
        }
        *last = Some(Instant::now());
        let also = self.unlogged.swap(0, Relaxed);
        warn!(reason = %e, unlogged_since = also, "read-order hint ignored");
    }

    fn apply_hint(&self, h: &Hint, on: &Renderer) -> Result<u64, Rejected> {
        let rel = Path::new(&h.path);
        let mut parts = rel.components();
        let first = parts.next().map(|c| c.as_os_str());
        if first == Some(std::ffi::OsStr::new(VIEW_DIR)) {
            if let Some(generation) = h.scope {
                return self.scope_view(h, generation, parts.as_path());
            }
            return self.hint_view(h, parts.as_path(), on);
        }
        let unknown = || Rejected::Unknown(h.path.clone());
        let snap = self.mount.snapshot_ref();
        let node = snap.resolve(rel).ok().flatten().ok_or_else(unknown)?;
        let attr = snap.attr(node).ok_or_else(unknown)?;
        if attr.kind != FileKind::File {
            return Err(unknown());
        }
        let total = check_ranges(h, attr.size)?;
        let files = self.mount.files();
        if let Some(generation) = h.scope {
            if files.scope().add(node, generation, &h.ranges) {
                // The tree stager's queued blocks may lie outside the part: drop them (the
                // part's stager queues its own).
                files.fetcher().drop_staging();
            }
            return Ok(total);
        }
        let state = files.state(node, &attr).map_err(|_| unknown())?;
        let store = self.mount.store();
        let ino = crate::inode::source_ino(node);
        let sink = files.page_sink();
        let mut pending = lock(&self.pending);
        for &(offset, len) in &h.ranges {
            if len == 0 {
                continue;
            }
            files.prefetch_bytes(&state, offset..offset + len);
            // Pushed only when a kernel is there to take pages; small files go whole through
            // the walker, which pushes files, not blocks.
            if sink.is_none() || !is_large(attr.size) {
                continue;
            }
            let n = block_count(attr.size);
            for slot in offset / BLOCK_SIZE..((offset + len - 1) / BLOCK_SIZE + 1).min(n) {
                if store.contains(state.entry, slot as u32) {
                    self.push_block(ino, state.entry, attr.size, slot);
                } else if pending.queue.len() < PENDING && pending.known.insert((state.entry, slot))
                {
                    pending.queue.push_back(Pending {
                        ino,
                        entry: state.entry,
                        size: attr.size,
                        slot,
                        since: Instant::now(),
                    });
                }
            }
        }
        Ok(total)
    }

    /// Offers block `slot` to the pushers unless it was pushed lately.
    fn push_block(&self, ino: u64, entry: EntryId, size: u64, slot: u64) {
        if lock(&self.pushed).put((entry, slot), ()).is_some() {
            return;
        }
        self.mount.files().offer_push(crate::stream::Push::Blocks {
            ino,
            entry,
            size,
            blocks: slot..slot + 1,
            read_to: None,
        });
    }

    /// Pushes the pending hinted blocks that are cached now, drops those waited on too long;
    /// how many were pushed.
    pub fn push_hinted(&self) -> usize {
        let store = self.mount.store();
        let ready: Vec<Pending> = {
            let mut pending = lock(&self.pending);
            let mut ready = Vec::new();
            let PendingBlocks { queue, known } = &mut *pending;
            queue.retain(|p| {
                let cached = store.contains(p.entry, p.slot as u32);
                if cached {
                    ready.push(*p);
                }
                let keep = !cached && p.since.elapsed() < PENDING_AGE;
                if !keep {
                    known.remove(&(p.entry, p.slot));
                }
                keep
            });
            ready
        };
        for p in &ready {
            self.push_block(p.ino, p.entry, p.size, p.slot);
        }
        ready.len()
    }

    /// Whether hinted source blocks wait to be cached.
    fn hints_pending(&self) -> bool {
        !lock(&self.pending).queue.is_empty()
    }

    /// The view at `rel` (under the view directory), opened once and kept among the open ones.
    fn view(&self, h: &Hint, rel: &Path) -> Result<(Arc<Views>, Arc<OpenView>), Rejected> {
        let unknown = || Rejected::Unknown(h.path.clone());
        let views = self.views.get().map_err(|_| unknown())?;
        let known = lock(&self.open_views).get(rel).cloned();
        let v = match known {
            Some(v) => v,
            None => {
                match views.stat(rel) {
                    Ok(stagefs_views::ViewKind::File(_)) => {}
                    _ => return Err(unknown()),
                }
                let v = views.open(rel).map_err(|_| unknown())?;
                lock(&self.open_views).put(rel.to_path_buf(), v.clone());
                v
            }
        };
        Ok((views, v))
    }

    /// A node's part of a view: the source files its declared rows are rendered from (an image
    /// view's JPEGs) join the node's scope whole, so the part's stager fetches them before the
    /// loaders read those rows (views themselves are rendered on demand, never staged).
    fn scope_view(&self, h: &Hint, generation: u64, rel: &Path) -> Result<u64, Rejected> {
        let (_, v) = self.view(h, rel)?;
        let total = check_ranges(h, v.len())?;
        let snap = self.mount.snapshot_ref();
        let files = self.mount.files();
        let mut started = false;
        for &(offset, len) in &h.ranges {
            v.sources(offset..offset.saturating_add(len), &mut |src| {
                // A sample the snapshot does not hold (gone since) is read, and reported, by
                // the render as usual.
                let Some(node) = snap.resolve(src).ok().flatten() else {
                    return;
                };
                if let Some(attr) = snap.attr(node).filter(|a| a.kind == FileKind::File) {
                    started |= files.scope().add(node, generation, &[(0, attr.size)]);
                }
            });
        }
        if started {
            // As for a file's part: the tree stager's queued blocks may lie outside it.
            files.fetcher().drop_staging();
        }
        Ok(total)
    }

    fn hint_view(&self, h: &Hint, rel: &Path, on: &Renderer) -> Result<u64, Rejected> {
        let (views, v) = self.view(h, rel)?;
        let total = check_ranges(h, v.len())?;
        let ino = self.inodes.ino(Virtual::ViewFile(rel.to_path_buf()));
        // Whole pages, so the kernel keeps every page pushed (the last may end the file), in
        // pieces of at most VIEW_PIECE so a job's buffer stays small.
        let pieces = h
            .ranges
            .iter()
            .filter(|r| r.1 > 0)
            .flat_map(|&(offset, len)| {
                let lo = offset / PAGE * PAGE;
                let hi = (offset + len)
                    .div_ceil(PAGE)
                    .saturating_mul(PAGE)
                    .min(v.len());
                (lo..hi)
                    .step_by(VIEW_PIECE as usize)
                    .map(move |at| (at, (at + VIEW_PIECE).min(hi)))
            });
        for (lo, hi) in pieces {
            let (views, v, sink) = (views.clone(), v.clone(), self.mount.files().page_sink());
            let stats = self.mount.stats().clone();
            let pushes = on.pushes.clone();
            let job = move || {
                // Errors reach readers of those bytes through their own reads.
                let Ok(data) = views.render(&v, lo, (hi - lo) as usize) else {
                    return;
                };
                let Some(sink) = sink.filter(|s| s.holds(ino)) else {
                    return;
                };
                match pushes {
                    // Never from a view pool thread: a push waits for the page locks of reads
                    // in flight, whose replies may need a pool thread (a deadlock). A full
                    // queue drops the push.
                    Some(tx) => {
                        let _ = tx.try_send(ViewPush {
                            ino,
                            offset: lo,
                            data,
                        });
                    }
                    None => {
                        if sink.store(ino, lo, data.as_ref()) {
                            stats.bytes_pushed.fetch_add(hi - lo, Relaxed);
                        }
                    }
                }
            };
            match &on.pool {
                Some(pool) => {
                    // At most RENDERS on the pool: the worker waits (its client with it), woken
                    // by the render that ends (or after TICK, to see the mount stop).
                    let renders = self.renders.clone();
                    {
                        let (count, room) = &*renders;
                        let mut n = lock(count);
                        while *n >= RENDERS && !self.mount.stopped() {
                            n = room
                                .wait_timeout(n, TICK)
                                .map(|(g, _)| g)
                                .unwrap_or_else(|p| p.into_inner().0);
                        }
                        *n += 1;
                    }
                    pool.run(move || {
                        /// Gives the render's place back even if the render panics.
                        struct Done(Arc<(Mutex<usize>, Condvar)>);
                        impl Drop for Done {
                            fn drop(&mut self) {
                                let (count, room) = &*self.0;
                                let mut n = lock(count);
                                *n = n.saturating_sub(1);
                                room.notify_one();
                            }
                        }
                        let _done = Done(renders);
                        job();
                    });
                }
                None => job(),
            }
        }
        Ok(total)
    }

    /// Starts the hint socket in `cache_dir` (the mount's cache directory, private to the
    /// user); view renders go to `pool` (the mount's view pool; `None`: on the hint worker
    /// itself); `stats_now` renders the counters for `stats_now` requests. The server runs
    /// until [`HintServer::stop`].
    pub fn start(
        self: &Arc<Self>,
        cache_dir: &Path,
        pool: Option<Offload>,
        stats_now: StatsNow,
    ) -> std::io::Result<HintServer> {
        let path = cache_dir.join(SOCKET_NAME);
        if let Ok(m) = std::fs::symlink_metadata(&path) {
            if !m.file_type().is_socket() {
                return Err(std::io::Error::new(
                    ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            // A socket left by an earlier daemon of this cache (one daemon per cache at once).
            std::fs::remove_file(&path)?;
        }
        // sockaddr_un holds 108 bytes: longer paths go through a descriptor of the directory.
        let (addr, dir) = if path.as_os_str().len() < 100 {
            (path.clone(), None)
        } else {
            let d = std::fs::File::open(cache_dir)?;
            let fd = std::os::fd::AsRawFd::as_raw_fd(&d);
            (
                PathBuf::from(format!("/proc/self/fd/{fd}/{SOCKET_NAME}")),
                Some(d),
            )
        };
        let listener = UnixListener::bind(&addr)?;
        let waker = listener.try_clone()?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (tx, rx) = sync_channel::<Held>(QUEUE);
        let me = Arc::downgrade(self);
        let (ptx, prx) = sync_channel::<ViewPush>(VIEW_PUSHES);
        let (files, stats) = (self.mount.files().clone(), self.mount.stats().clone());
        let pusher = std::thread::Builder::new()
            .name("stagefs-hint-push".into())
            .spawn(move || {
                // Ends when the last sender goes (the server's and the worker's at stop, then
                // the render jobs in flight).
                for p in prx {
                    let Some(sink) = files.page_sink() else {
                        continue;
                    };
                    if sink.store(p.ino, p.offset, p.data.as_ref()) {
                        let n = p.data.as_ref().len() as u64;
                        stats.bytes_pushed.fetch_add(n, Relaxed);
                    }
                }
            })?;
        lock(&threads).push(pusher);
        let renderer = Renderer {
            pool,
            pushes: Some(ptx),
        };
        let on = renderer.clone();
        let worker = std::thread::Builder::new()
            .name("stagefs-hints".into())
            .spawn(move || work(&me, &rx, &on))?;
        lock(&threads).push(worker);
        let (stop2, threads2) = (stop.clone(), threads.clone());
        let ctx = Conn {
            direct: Arc::downgrade(&self.direct),
            tx,
            stop: stop.clone(),
            stats_now,
            budget: Arc::new(Budget {
                stats: self.mount.stats().clone(),
            }),
        };
        let listen = std::thread::Builder::new()
            .name("stagefs-hint-listen".into())
            .spawn(move || listen(listener, &ctx, &stop2, &threads2))?;
        lock(&threads).push(listen);
        Ok(HintServer {
            path,
            addr,
            stop,
            threads,
            waker,
            _dir: dir,
            renderer,
        })
    }
}

impl HintServer {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the server's worker renders views: lines applied elsewhere while it runs render
    /// there too.
    pub fn renderer(&self) -> Renderer {
        self.renderer.clone()
    }

    /// Stops the server and removes its socket; called once the mount is stopping (a worker
    /// waiting for room on the view pool gives up then).
    pub fn stop(self) {
        let HintServer {
            path,
            addr,
            stop,
            threads,
            waker,
            _dir,
            renderer,
        } = self;
        stop.store(true, Relaxed);
        // The view pusher ends once this, the worker's and the render jobs' senders are gone.
        drop(renderer);
        // Wakes the listener out of accept(): shutdown makes a blocked accept() fail at once,
        // whatever became of the socket's path; the connect is for kernels that would not.
        // SAFETY: shutdown on a descriptor the listener owns (kept open by `waker`).
        unsafe {
            libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&waker), libc::SHUT_RDWR);
        }
        let _ = UnixStream::connect(&addr);
        let joining: Vec<_> = lock(&threads).drain(..).collect();
        for t in joining {
            let _ = t.join();
        }
        // Threads of clients that connected while we joined.
        let late: Vec<_> = lock(&threads).drain(..).collect();
        for t in late {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&path);
    }
}

/// The total bytes of `h`'s ranges, if every one lies inside a file of `size` bytes.
fn check_ranges(h: &Hint, size: u64) -> Result<u64, Rejected> {
    let mut total = 0u64;
    for &(offset, len) in &h.ranges {
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Rejected::OutOfRange {
                path: h.path.clone(),
                offset,
                len,
                size,
            });
        }
        total += len;
    }
    Ok(total)
}

/// The worker: applies lines in order (views rendered as `on` says), and pushes hinted blocks
/// as they get cached.
fn work(core: &Weak<HintService>, rx: &Receiver<Held>, on: &Renderer) {
    loop {
        let wait = match core.upgrade() {
            Some(c) if c.hints_pending() => Duration::from_millis(2),
            Some(_) => TICK,
            None => return,
        };
        let got = rx.recv_timeout(wait);
        let Some(c) = core.upgrade() else { return };
        match got {
            Ok(held) => {
                let _ = c.hint(&held.line, on);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        c.push_hinted();
    }
}

/// Renders the mount's counters now, as one compact JSON line without its newline (`None`
/// once the mount is gone): the answer to `stats_now`.
pub type StatsNow = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// The control socket's byte budget ([`CONTROL_BUDGET`]), counted in the mount's stats
/// (`control_buffered`, `control_buffered_peak`).
struct Budget {
    stats: Arc<stagefs_prefetch::Stats>,
}

impl Budget {
    /// Takes `n` bytes of the budget, if that leaves the total within it (`always`: even if
    /// not).
    fn take(&self, n: u64, always: bool) -> bool {
        let held = &self.stats.control_buffered;
        let got = held.fetch_update(Relaxed, Relaxed, |h| {
            h.checked_add(n).filter(|&t| always || t <= CONTROL_BUDGET)
        });
        match got {
            Ok(before) => {
                self.stats
                    .control_buffered_peak
                    .fetch_max(before + n, Relaxed);
                true
            }
            Err(_) => false,
        }
    }

    /// Gives `n` bytes back.
    fn give(&self, n: u64) {
        let _ = self
            .stats
            .control_buffered
            .fetch_update(Relaxed, Relaxed, |h| Some(h.saturating_sub(n)));
    }
}

/// A request line on its way to the worker, with the budget it holds (given back on drop).
struct Held {
    line: Vec<u8>,
    bytes: u64,
    budget: Arc<Budget>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.give(self.bytes);
    }
}

/// What every connection's thread shares.
#[derive(Clone)]
struct Conn {
    direct: Weak<DirectService>,
    tx: SyncSender<Held>,
    stop: Arc<AtomicBool>,
    stats_now: StatsNow,
    budget: Arc<Budget>,
}

fn listen(
    listener: UnixListener,
    ctx: &Conn,
    stop: &Arc<AtomicBool>,
    threads: &Arc<Mutex<Vec<JoinHandle<()>>>>,
) {
    let clients = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Relaxed) {
            return;
        }
        let Ok(conn) = conn else { continue };
        if clients.load(Relaxed) >= MAX_CONNECTIONS {
            warn!("read-order hints: {MAX_CONNECTIONS} clients connected already, refusing one");
            ctx.budget.stats.control_dropped.fetch_add(1, Relaxed);
            continue;
        }
        clients.fetch_add(1, Relaxed);
        let (ctx, n) = (ctx.clone(), clients.clone());
        let spawned = std::thread::Builder::new()
            .name("stagefs-hint-conn".into())
            .spawn(move || {
                let stats = ctx.budget.stats.clone();
                stats.control_clients.fetch_add(1, Relaxed);
                if !client(conn, &ctx) {
                    stats.control_dropped.fetch_add(1, Relaxed);
                }
                stats.control_clients.fetch_sub(1, Relaxed);
                n.fetch_sub(1, Relaxed);
            });
        match spawned {
            Ok(t) => {
                let mut ts = lock(threads);
                ts.retain(|t| !t.is_finished());
                ts.push(t);
            }
            Err(e) => {
                clients.fetch_sub(1, Relaxed);
                warn!(error = %e, "read-order hints: no thread for a client");
            }
        }
    }
}

/// The budget one connection holds: its read buffer and its partial line's capacity. Given
/// back on drop, when the connection ends.
struct ConnBudget {
    budget: Arc<Budget>,
    held: u64,
}

impl ConnBudget {
    /// Holds `want` bytes in all (more or fewer than now); false if the budget has no room.
    fn hold(&mut self, want: u64) -> bool {
        if want > self.held {
            if !self
                .budget
                .take(want - self.held, want <= FREE_PER_CONNECTION)
            {
                return false;
            }
        } else {
            self.budget.give(self.held - want);
        }
        self.held = want;
        true
    }
}

impl Drop for ConnBudget {
    fn drop(&mut self) {
        self.budget.give(self.held);
    }
}

/// Reads one client's lines (each at most [`MAX_LINE`]): answers direct opens, closes, table
/// and stats requests on this thread, queues hints for the worker. The connection's pins go
/// with it. False if the daemon dropped the connection (over the budget, or a client that does
/// not take its replies), true if the client closed it or the mount stopped.
fn client(conn: UnixStream, ctx: &Conn) -> bool {
    // Short timeouts so the thread sees the stop flag; a partial line survives them. A client
    // that does not read its replies holds only this thread, for at most REPLY_TIMEOUT a reply.
    if conn.set_read_timeout(Some(TICK)).is_err()
        || conn
            .set_write_timeout(Some(stagefs_protocol::REPLY_TIMEOUT))
            .is_err()
    {
        return true;
    }
    let Ok(out) = conn.try_clone() else {
        return true;
    };
    let mut held = ConnBudget {
        budget: ctx.budget.clone(),
        held: 0,
    };
    if !held.hold(READ_BUF as u64) {
        warn!("control socket: over its memory budget, refusing a client");
        return false;
    }
    let mut pins = DirectPins::new(ctx.direct.clone());
    let mut r = BufReader::with_capacity(READ_BUF, conn);
    let mut line = Vec::new();
    let mut skipping = false;
    while !ctx.stop.load(Relaxed) {
        let room = (MAX_LINE + 1).saturating_sub(line.len()) as u64;
        let got = r.by_ref().take(room).read_until(b'\n', &mut line);
        // The partial line's buffer counts against the budget as soon as it grows.
        if !held.hold((READ_BUF + line.capacity()) as u64) {
            warn!(
                buffered = line.len(),
                "control socket: over its memory budget ({CONTROL_BUDGET} bytes), dropping a client"
            );
            return false;
        }
        match got {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => return true,
        }
        let ended = line.last() == Some(&b'\n');
        if ended {
            line.pop();
        }
        if !ended && line.len() <= MAX_LINE {
            continue;
        }
        if skipping {
            // The rest of an over-long line.
            skipping = !ended;
            line.clear();
            continue;
        }
        if !ended {
            // Over MAX_LINE: handed on (rejected and counted there), the rest skipped.
            skipping = true;
        }
        let msg = std::mem::take(&mut line);
        // The line's bytes go with it to the worker; this connection holds its read buffer.
        let bytes = msg.capacity() as u64;
        held.held = held.held.saturating_sub(bytes);
        let msg = Held {
            line: msg,
            bytes,
            budget: ctx.budget.clone(),
        };
        if msg.line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if !skipping {
            match answer_direct(&msg.line, ctx, &mut pins, &out) {
                Direct::Done => continue,
                Direct::Hint => {}
                Direct::Gone => return false,
            }
        }
        // Waits while the worker is QUEUE lines behind: back-pressure on the client. The
        // worker takes lines until every sender is gone, so this wait ends.
        if ctx.tx.send(msg).is_err() {
            return true;
        }
    }
    debug!("read-order hint client stopped with the mount");
    true
}

/// Answers a `stats_now` request: the counters rendered now, on one line.
fn answer_stats(ctx: &Conn, out: &UnixStream) -> Direct {
    let line = match (ctx.stats_now)() {
        Some(mut json) if json.len() < stagefs_protocol::MAX_STATS_REPLY => {
            json.push('\n');
            json
        }
        Some(_) => Reply::Refused(Refusal::Malformed).line(),
        None => Reply::Refused(Refusal::Stopping).line(),
    };
    if let Err(e) = stagefs_protocol::send(out.as_fd(), line.as_bytes(), None) {
        debug!(error = %e, "stats: the client did not take its reply");
        return Direct::Gone;
    }
    Direct::Done
}

/// Answers a `direct_table` request: the table's descriptors, or why there are none.
fn answer_table(direct: &Weak<DirectService>, out: &UnixStream) -> Direct {
    let Some(c) = direct.upgrade() else {
        return Direct::Gone;
    };
    let sent = match c.with_table(|fds| {
        stagefs_protocol::send_fds(out.as_fd(), Reply::Table.line().as_bytes(), &fds)
    }) {
        Ok(sent) => sent,
        Err(r) => stagefs_protocol::send(out.as_fd(), Reply::Refused(r).line().as_bytes(), None),
    };
    if let Err(e) = sent {
        debug!(error = %e, "direct table: the client did not take its reply");
        return Direct::Gone;
    }
    Direct::Done
}

/// What [`answer_direct`] made of a line.
enum Direct {
    /// A direct open or close, answered.
    Done,
    /// Not one: a hint (or a bad line) for the worker.
    Hint,
    /// The client or the mount is gone.
    Gone,
}

/// Answers `line` if it is a direct open or close; a malformed direct open gets a refusal, so
/// its client does not wait for a reply that never comes.
fn answer_direct(line: &[u8], ctx: &Conn, pins: &mut DirectPins, out: &UnixStream) -> Direct {
    let direct = &ctx.direct;
    // Hints (the bulk of the lines) have no "op": parsed once, by the worker.
    if !line.windows(4).any(|w| w == b"\"op\"") {
        return Direct::Hint;
    }
    let req = parse_request(line);
    let open = match req {
        Ok(Request::DirectTable) => return answer_table(direct, out),
        Ok(Request::StatsNow) => return answer_stats(ctx, out),
        Ok(Request::DirectOpen(path)) => Some(path),
        Ok(Request::DirectClose(pin)) => {
            if !pins.release(pin) {
                debug!(pin, "direct close of a pin this connection does not hold");
            }
            return Direct::Done;
        }
        Ok(Request::Hint(_)) => return Direct::Hint,
        Err(_) if stagefs_protocol::is_direct_open(line) => None,
        Err(_) => return Direct::Hint,
    };
    let Some(c) = direct.upgrade() else {
        return Direct::Gone;
    };
    let (reply, fd) = match open {
        Some(path) => match c.direct_open(&path, pins) {
            Ok((fd, g)) => (Reply::Granted(g), Some(fd)),
            Err(r) => (Reply::Refused(r), None),
        },
        None => {
            c.refused("", Refusal::BadPath);
            (Reply::Refused(Refusal::BadPath), None)
        }
    };
    let sent = stagefs_protocol::send(
        out.as_fd(),
        reply.line().as_bytes(),
        fd.as_ref().map(|f| f.as_fd()),
    );
    // The daemon's copy of the descriptor closes here; the client's stays open.
    drop(fd);
    if let Err(e) = sent {
        debug!(error = %e, "direct open: the client did not take its reply");
        if let Reply::Granted(g) = reply {
            pins.release(g.pin);
        }
        return Direct::Gone;
    }
    Direct::Done
}
