//! Listing the tree: a pool of plain threads with one source request in flight each.
//!
//! Threads, not tokio: every source operation is a blocking POSIX call (`getdents`, `fstatat`,
//! `readlinkat`) with no asynchronous form, so an async runtime would only move the same
//! blocking calls onto its own blocking-thread pool, adding a hand-off per request. A pool of
//! `threads` threads puts exactly `threads` requests in flight, which is the knob a parallel
//! filesystem's metadata servers respond to.
//!
//! The work is two kinds of job, taken from a queue:
//! - `List(dir)` reads a directory's names, sorts them, gives them consecutive ids (so the
//!   directory's children are an id range in name order), and queues the entries' stats as
//!   chunks of at most [`MAX_CHUNK`] entries, split so a big directory spreads over the whole
//!   pool (a 200k-entry directory is statted by every thread, not one).
//! - `Stat(dir)` stats (and for symlinks, readlinks) the next chunk, fills in the attributes,
//!   and queues the listing of every subdirectory found. When a directory's last chunk lands
//!   it is *ready*: lookups and readdirs in it proceed.
//!
//! A listed directory's chunks go to the front of the queue and new directories to the back,
//! so directories complete one after another (breadth first) instead of all at the end. A
//! caller waiting for a directory moves its jobs to an urgent queue the threads serve first; it
//! waits only for that directory. Directories found after the scan (by revalidation, or left
//! unlisted in a saved file) are *lazy*: listed on the first caller's thread, with any other
//! waiting caller helping with the stat chunks.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime};

use stagefs_prefetch::locks;
use stagefs_prefetch::locks::lock;
use stagefs_prefetch::source::{DirName, FileKind, Meta, Source};
use stagefs_prefetch::SourceError;

use super::tree::{valid_name, DirState, Progress, Tree, PENDING};
use super::{Inner, Job, NodeId, Queue, ScanOptions, Snapshot, SnapshotError};

/// Most entries statted per job: 128 source round trips (~0.1 s on a parallel filesystem) is
/// long enough that taking the job costs nothing in comparison, and short enough that a waiting
/// lookup is never stuck behind a long chunk.
pub(crate) const MAX_CHUNK: usize = 128;
/// Fewest entries per job (unless the directory has fewer): below 8, the two lock round trips
/// per job start to matter on a fast local source.
const MIN_CHUNK: usize = 8;
/// Most listing threads: far beyond what any metadata server rewards, and a typo of
/// `--threads 100000` must not spawn 100,000 threads.
pub(crate) const MAX_THREADS: usize = 1024;
/// Stack of a listing thread: the jobs keep their data on the heap.
const STACK: usize = 256 << 10;

/// The result of statting one entry: its metadata and, for a symlink, its target.
pub(crate) type Statted = Result<(Meta, Option<Vec<u8>>), SourceError>;

/// Starts a scan (see [`Snapshot::scan`]).
pub(crate) fn start(
    source: Arc<dyn Source>,
    root: &Path,
    opts: ScanOptions,
) -> Result<Arc<Snapshot>, SnapshotError> {
    let meta = source
        .stat(Path::new(""))
        .map_err(|source| SnapshotError::Root {
            path: root.to_path_buf(),
            source,
        })?;
    if meta.kind != FileKind::Dir {
        return Err(SnapshotError::NotDir {
            path: root.to_path_buf(),
        });
    }
    let id = random_id().map_err(|source| SnapshotError::Io {
        path: root.to_path_buf(),
        source,
    })?;
    let threads = opts.threads.clamp(1, MAX_THREADS);
    let inner = Arc::new(Inner {
        tree: RwLock::new(Tree::with_root(&meta, DirState::Queued)),
        queue: Mutex::new(Queue::default()),
        work: Condvar::new(),
        done: Condvar::new(),
        source: OnceLock::from(source),
        opts,
        id,
        root: root.to_path_buf(),
        created: SystemTime::now(),
        started: Instant::now(),
        requests: 1.into(),
        loaded_requests: 0,
        unfinished: 1.into(),
        workers: threads.into(),
        complete: false.into(),
        broken: false.into(),
        cancel: false.into(),
        elapsed_ns: 0.into(),
        relist: Mutex::new(()),
    });
    lock(&inner.queue).normal.push_back(Job::List(0));
    let mut started = 0;
    for i in 0..threads {
        let shared = inner.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("stagefs-list-{i}"))
            .stack_size(STACK)
            .spawn(move || worker(shared));
        match spawned {
            Ok(_) => started += 1,
            Err(e) => {
                // Fewer threads only means fewer requests in flight.
                tracing::warn!("starting listing thread {i}: {e}");
                inner.workers.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
    if started == 0 {
        return Err(SnapshotError::ScanStopped);
    }
    Ok(Arc::new(Snapshot { inner }))
}

/// A random 128-bit id from the kernel.
fn random_id() -> std::io::Result<u128> {
    let hi = stagefs_prefetch::cachedir::random_u64()?;
    let lo = stagefs_prefetch::cachedir::random_u64()?;
    Ok((u128::from(hi) << 64) | u128::from(lo))
}

/// Counts a listing thread out, also when it unwinds.
struct WorkerGuard<'a>(&'a Inner);

impl Drop for WorkerGuard<'_> {
    fn drop(&mut self) {
        let inner = self.0;
        if inner.workers.fetch_sub(1, Ordering::SeqCst) == 1
            && inner.unfinished.load(Ordering::SeqCst) > 0
        {
            inner.broken.store(true, Ordering::SeqCst);
            let _q = lock(&inner.queue);
            inner.done.notify_all();
        }
    }
}

/// A listing thread: takes jobs until the tree is listed or the snapshot dropped.
fn worker(inner: Arc<Inner>) {
    let _guard = WorkerGuard(&inner);
    loop {
        let job = {
            let mut q = lock(&inner.queue);
            loop {
                if inner.cancel.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(j) = q.urgent.pop_front().or_else(|| q.normal.pop_front()) {
                    break j;
                }
                if inner.unfinished.load(Ordering::SeqCst) == 0 {
                    return;
                }
                q = locks::wait(&inner.work, q);
            }
        };
        match job {
            Job::List(d) => {
                inner.list_dir(d, false);
            }
            Job::Stat(d) => {
                inner.stat_chunk(d);
            }
        }
    }
}

impl Inner {
    /// Reads the names of directory record `d` if it is `Queued` (pool) or `Lazy` (`inline`),
    /// allocating its children and their stat chunks. Returns whether it claimed the directory.
    pub(crate) fn list_dir(&self, d: u32, inline: bool) -> bool {
        let Ok(source) = self.source() else {
            return false;
        };
        let want = if inline {
            DirState::Lazy
        } else {
            DirState::Queued
        };
        let path = {
            let mut t = self.write();
            let Some(dir) = t.dirs.get_mut(d as usize) else {
                return false;
            };
            if dir.state != want {
                return false;
            }
            dir.state = DirState::Listing;
            let node = dir.node;
            t.path(node)
        };
        let _span = tracing::trace_span!("list", path = %path.display()).entered();
        self.requests.fetch_add(1, Ordering::Relaxed);
        let names = match source.read_dir(&path) {
            Ok(names) => names,
            Err(e) => {
                self.write().dir_failed(d, &e);
                self.dir_finished(d, inline);
                return true;
            }
        };
        // Sorted before taking the write lock: readers are not held up by it.
        let (names, rejected) = clean(&path, names);
        let mut t = self.write();
        for e in rejected {
            t.record_error(e);
        }
        let node = t.dirs[d as usize].node;
        let first = t.nodes.len() as u32;
        let mut count = 0u32;
        for name in &names {
            if let Err(e) = t.push_placeholder(node, name.as_bytes()) {
                t.record_error(format!(
                    "{}: {e}; the rest of the directory is skipped",
                    path.display()
                ));
                break;
            }
            count += 1;
        }
        let dir = &mut t.dirs[d as usize];
        dir.first = first;
        dir.count = count;
        if count == 0 {
            dir.state = DirState::Ready;
            t.dirs_listed += 1;
            drop(t);
            self.dir_finished(d, inline);
            return true;
        }
        let chunk_len = (count as usize)
            .div_ceil(self.opts.threads.clamp(1, MAX_THREADS))
            .clamp(MIN_CHUNK, MAX_CHUNK) as u32;
        let chunks = count.div_ceil(chunk_len);
        t.progress.insert(
            d,
            Progress {
                next: 0,
                chunks,
                left: chunks,
                chunk_len,
                inline,
            },
        );
        drop(t);
        if !inline {
            let mut q = lock(&self.queue);
            if q.boosted.contains(&d) {
                q.urgent.extend((0..chunks).map(|_| Job::Stat(d)));
            } else {
                for _ in 0..chunks {
                    q.normal.push_front(Job::Stat(d));
                }
            }
            self.work.notify_all();
        }
        true
    }

    /// Stats the next chunk of directory record `d`'s entries. Returns whether there was one.
    pub(crate) fn stat_chunk(&self, d: u32) -> bool {
        let Ok(source) = self.source() else {
            return false;
        };
        let (ids, paths, inline) = {
            let mut t = self.write();
            let Some(p) = t.progress.get_mut(&d) else {
                return false;
            };
            if p.next >= p.chunks {
                return false;
            }
            let (c, chunk_len, inline) = (p.next, p.chunk_len, p.inline);
            p.next += 1;
            let dir = t.dirs[d as usize];
            let lo = dir.first + c * chunk_len;
            let hi = (lo + chunk_len).min(dir.first + dir.count);
            let base = t.path(dir.node);
            let paths: Vec<_> = (lo..hi)
                .map(|id| base.join(std::ffi::OsStr::from_bytes(t.name(id))))
                .collect();
            (lo..hi, paths, inline)
        };
        let mut results: Vec<Statted> = Vec::with_capacity(paths.len());
        for p in &paths {
            // A dropped snapshot stops within one request, not one chunk.
            if self.cancel.load(Ordering::Relaxed) {
                return true;
            }
            results.push(self.stat_one(&**source, p));
        }
        let state = if inline {
            DirState::Lazy
        } else {
            DirState::Queued
        };
        let mut new_dirs = Vec::new();
        let finished = {
            let mut t = self.write();
            for ((id, r), path) in ids.zip(results).zip(&paths) {
                match r {
                    Ok((meta, link)) => {
                        if let Some(nd) = t.fill(id, &meta, link.as_deref(), state) {
                            new_dirs.push(nd);
                        }
                    }
                    Err(e) => {
                        t.mark_missing(id);
                        t.record_error(format!("{e}; {} skipped", path.display()));
                    }
                }
            }
            if !inline {
                // Counted before this directory is counted out, so the total never touches
                // zero while work remains.
                self.unfinished.fetch_add(new_dirs.len(), Ordering::SeqCst);
            }
            let finished = match t.progress.get_mut(&d) {
                Some(p) => {
                    p.left -= 1;
                    p.left == 0
                }
                None => false,
            };
            if finished {
                t.progress.remove(&d);
                t.dirs[d as usize].state = DirState::Ready;
                t.dirs_listed += 1;
            }
            finished
        };
        if !inline && !new_dirs.is_empty() {
            let mut q = lock(&self.queue);
            q.normal.extend(new_dirs.into_iter().map(Job::List));
            self.work.notify_all();
        }
        if finished {
            self.dir_finished(d, inline);
        }
        true
    }

    /// Stats one entry, and reads its target if it is a symlink.
    pub(crate) fn stat_one(&self, source: &dyn Source, path: &Path) -> Statted {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let meta = source.stat(path)?;
        let link = if meta.kind == FileKind::Symlink {
            self.requests.fetch_add(1, Ordering::Relaxed);
            Some(source.readlink(path)?)
        } else {
            None
        };
        Ok((meta, link))
    }

    /// Directory record `d` is ready or failed: wakes its waiters, and ends the scan after the
    /// last pool directory.
    fn dir_finished(&self, d: u32, inline: bool) {
        {
            let mut q = lock(&self.queue);
            q.boosted.remove(&d);
            self.done.notify_all();
        }
        if !inline && self.unfinished.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.elapsed_ns.store(
                u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX),
                Ordering::SeqCst,
            );
            self.write().shrink();
            self.complete.store(true, Ordering::SeqCst);
            let _q = lock(&self.queue);
            self.work.notify_all();
            self.done.notify_all();
            tracing::debug!(
                "listed {} in {:?}",
                self.root.display(),
                self.started.elapsed()
            );
        }
    }

    /// Moves directory record `d`'s jobs to the urgent queue (once).
    fn boost(&self, q: &mut Queue, d: u32, state: DirState, progress: Option<Progress>) {
        if !q.boosted.insert(d) {
            return;
        }
        match (state, progress) {
            (DirState::Queued, _) => q.urgent.push_back(Job::List(d)),
            (DirState::Listing, Some(p)) => {
                q.urgent.extend((p.next..p.chunks).map(|_| Job::Stat(d)));
            }
            // Names being read: `list_dir` sees the boost when it queues the chunks.
            _ => return,
        }
        self.work.notify_all();
    }

    /// Waits until directory record `d` is ready (or fails), at most the wait timeout. A lazy
    /// directory is listed on this thread.
    pub(crate) fn wait_listed(&self, d: u32) -> Result<(), SnapshotError> {
        let timeout = self.opts.wait_timeout;
        let deadline = Instant::now() + timeout;
        loop {
            let mut q = lock(&self.queue);
            loop {
                let (state, progress, errno) = {
                    let t = self.read();
                    let dir = t.dirs[d as usize];
                    (dir.state, t.progress.get(&d).copied(), dir.errno)
                };
                match (state, progress) {
                    (DirState::Ready, _) => return Ok(()),
                    (DirState::Failed, _) => {
                        return Err(SnapshotError::Unlisted {
                            path: self.dir_path(d),
                            errno,
                        })
                    }
                    (DirState::Lazy, _) => {
                        self.source()?;
                        break;
                    }
                    (DirState::Listing, Some(p)) if p.inline && p.next < p.chunks => break,
                    (DirState::Listing, Some(p)) if p.inline => {}
                    _ => {
                        if self.broken.load(Ordering::SeqCst) || self.cancel.load(Ordering::SeqCst)
                        {
                            return Err(SnapshotError::ScanStopped);
                        }
                        self.boost(&mut q, d, state, progress);
                    }
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(SnapshotError::TimedOut {
                        path: self.dir_path(d),
                        waited: timeout,
                    });
                }
                q = locks::wait_timeout(&self.done, q, deadline - now);
            }
            drop(q);
            // Lazy, or listed inline by another caller with chunks left: do the work here.
            self.list_dir(d, true);
            while self.stat_chunk(d) {}
        }
    }

    /// Waits until the whole tree is listed.
    pub(crate) fn wait_complete(&self) -> Result<(), SnapshotError> {
        let mut q = lock(&self.queue);
        loop {
            if self.complete.load(Ordering::SeqCst) {
                return Ok(());
            }
            if self.broken.load(Ordering::SeqCst) || self.cancel.load(Ordering::SeqCst) {
                return Err(SnapshotError::ScanStopped);
            }
            // Timed, so a missed wake-up could only delay, never hang.
            q = locks::wait_timeout(&self.done, q, Duration::from_secs(1));
        }
    }

    /// Waits until node `id` has attributes (its directory's stats are in), if it has none yet.
    pub(crate) fn settle(&self, id: NodeId) -> Result<(), SnapshotError> {
        let parent = {
            let t = self.read();
            let n = t.node(id).ok_or(SnapshotError::NoNode(id))?;
            if n.flags & PENDING == 0 {
                return Ok(());
            }
            t.dir_index(n.parent)
        };
        match parent {
            Some(pd) => self.wait_listed(pd),
            None => Ok(()),
        }
    }

    fn dir_path(&self, d: u32) -> std::path::PathBuf {
        let t = self.read();
        t.path(t.dirs[d as usize].node)
    }
}

/// Valid names of a listing, sorted and de-duplicated, and messages for the rest. A source
/// (a buggy network filesystem, a test) could return names that would lead outside the
/// directory, or one name twice; neither may reach the tree.
pub(crate) fn clean(dir: &Path, names: Vec<DirName>) -> (Vec<OsString>, Vec<String>) {
    let mut rejected = Vec::new();
    let mut out: Vec<OsString> = names
        .into_iter()
        .filter_map(|n| {
            if valid_name(n.name.as_bytes()) {
                Some(n.name)
            } else {
                rejected.push(format!(
                    "{}: invalid entry name {:?} skipped",
                    dir.display(),
                    n.name
                ));
                None
            }
        })
        .collect();
    out.sort_unstable_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    let before = out.len();
    out.dedup();
    if out.len() != before {
        rejected.push(format!(
            "{}: {} duplicate names in the listing skipped",
            dir.display(),
            before - out.len()
        ));
    }
    (out, rejected)
}
