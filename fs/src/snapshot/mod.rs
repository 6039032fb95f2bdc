//! The metadata snapshot: the source tree's names and attributes, listed once and served from
//! memory (docs/mount.md#snapshot-semantics).
//!
//! The mount presents the dataset as it was when its snapshot was taken. Attributes come from
//! here, never from a per-request `stat` of the source; data reads name the [`NodeAttr::version`]
//! recorded here and the source checks it on the open descriptor, so a file changed since the
//! snapshot fails its reads rather than serving other bytes.
//!
//! - [`Snapshot::scan`] stats the root, then lists the whole tree in the background on a pool
//!   of [`ScanOptions::threads`] plain threads ([`scan`]), each with one source request in
//!   flight: parallel filesystems answer concurrent metadata requests far faster than serial
//!   ones. A big directory's per-entry stats are split into chunks across the pool. It returns
//!   at once: [`Snapshot::lookup`] and [`Snapshot::read_dir`] wait only for the directory they
//!   need, which is moved to the front of the queue.
//! - The tree itself ([`tree`]) is ~52 bytes per node plus its name: names in one arena,
//!   children as id ranges, owners interned, no per-node heap allocation.
//! - [`Snapshot::save`] / [`Snapshot::load`] ([`persist`]) write and read a compact checksummed
//!   little-endian file: `stagefs index` output on persistent storage, or the copy in the cache
//!   that lets a remount skip the listing. Loading validates everything before use.
//! - [`Snapshot::revalidate`] (`--revalidate SECONDS`) re-checks one node against the source
//!   and re-lists a directory whose mtime changed ([`revalidate`]).
//!
//! Ids are dense `u32`s in the order entries were listed; the root is [`ROOT`]. An id stays valid
//! for the life of the snapshot (a re-listed directory keeps the ids of names that still exist).
//! A saved snapshot is renumbered breadth-first, so ids differ between a snapshot and the copy
//! loaded from its file.
//!
//! Callbacks ([`Snapshot::read_dir`], [`Snapshot::walk`]) run without any lock held: entries are
//! copied out in batches, so a callback may call back into the snapshot.

mod error;
mod persist;
mod revalidate;
mod scan;
mod tree;

use std::collections::{HashSet, VecDeque};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant, SystemTime};

use stagefs_prefetch::cachedir::CacheDir;
use stagefs_prefetch::locks;
use stagefs_prefetch::locks::lock;
use stagefs_prefetch::source::{check_rel, Meta, Source};

pub use error::SnapshotError;
use tree::{DirState, Tree, NO_PARENT};

/// A node's id: a dense index, the root is [`ROOT`] (the filesystem maps inode = id + 1).
pub type NodeId = u32;

/// The id of the source root.
pub const ROOT: NodeId = 0;

/// Entries copied out of the tree per lock hold in [`Snapshot::read_dir`]: about one FUSE
/// readdirplus reply's worth, so a reply costs one lock acquisition.
const READDIR_BATCH: usize = 256;
/// Nodes copied out per lock hold in [`Snapshot::walk`]: large enough that locking is noise,
/// small enough that a revalidation waiting for the write lock is not held up noticeably.
const WALK_BATCH: usize = 4096;

/// The attributes of one node, as `lstat` reported them when the snapshot was taken: the
/// source's [`Meta`] (one type, so nothing is copied field by field between the two). Its
/// [`Meta::version`] is what every data read from the source is checked against.
pub type NodeAttr = Meta;

/// How a scan runs.
#[derive(Clone, Debug)]
pub struct ScanOptions {
    /// Source requests in flight (listing threads, at most 1024). 64 keeps a parallel
    /// filesystem's metadata servers busy without flooding them; each thread costs a few KiB.
    pub threads: usize,
    /// How long a lookup or readdir waits for its directory's listing before failing.
    pub wait_timeout: Duration,
}

impl Default for ScanOptions {
    fn default() -> ScanOptions {
        ScanOptions {
            threads: 64,
            wait_timeout: Duration::from_secs(120),
        }
    }
}

/// How far a scan has come.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanStats {
    /// Directories listed.
    pub dirs: u64,
    /// Entries with attributes (including the root).
    pub entries: u64,
    /// Directories found but not listed yet.
    pub pending_dirs: u64,
    /// Source requests made (stat, read_dir, readlink).
    pub requests: u64,
    /// Time the listing took (so far, while it runs).
    pub elapsed: Duration,
    /// Directories and entries skipped.
    pub errors: u64,
    /// Whether the listing is complete.
    pub complete: bool,
}

/// A job for the listing pool.
#[derive(Clone, Copy, Debug)]
enum Job {
    /// Read the names of directory record `.0`.
    List(u32),
    /// Stat the next chunk of directory record `.0`'s entries.
    Stat(u32),
}

/// The listing pool's queue.
#[derive(Default)]
struct Queue {
    /// Jobs for directories someone is waiting for.
    urgent: VecDeque<Job>,
    /// Everything else: listings in discovery order, a listed directory's stat chunks first.
    normal: VecDeque<Job>,
    /// Directories already moved to the front.
    boosted: HashSet<u32>,
}

/// The state shared by the snapshot and its listing threads.
struct Inner {
    tree: RwLock<Tree>,
    queue: Mutex<Queue>,
    /// Signalled when jobs are queued or the scan ends.
    work: Condvar,
    /// Signalled when a directory's listing is complete, or the scan ends.
    done: Condvar,
    source: OnceLock<Arc<dyn Source>>,
    opts: ScanOptions,
    id: u128,
    root: PathBuf,
    created: SystemTime,
    started: Instant,
    requests: AtomicU64,
    /// Source requests of the listing a loaded snapshot came from (0 for a scan).
    loaded_requests: u64,
    /// Directories queued to the pool or being listed by it.
    unfinished: AtomicUsize,
    /// Listing threads alive.
    workers: AtomicUsize,
    complete: AtomicBool,
    /// Set when the last listing thread exits with work left (only a panic does that).
    broken: AtomicBool,
    /// Set when the snapshot is dropped: the listing threads stop.
    cancel: AtomicBool,
    elapsed_ns: AtomicU64,
    /// Serialises re-listings, so two revalidations of one directory cannot both add a name.
    relist: Mutex<()>,
}

impl Inner {
    fn read(&self) -> RwLockReadGuard<'_, Tree> {
        // A panicked writer leaves a structurally valid tree (every mutation keeps the
        // invariants step by step), and the mount must keep serving.
        locks::read(&self.tree)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Tree> {
        locks::write(&self.tree)
    }

    fn source(&self) -> Result<&Arc<dyn Source>, SnapshotError> {
        self.source.get().ok_or(SnapshotError::NoSource)
    }

    /// Now, in tenths of a second since the snapshot was created (the unit of
    /// [`Tree::checked`]: 13 years fit in a `u32`).
    fn now_ds(&self) -> u32 {
        let ds = SystemTime::now()
            .duration_since(self.created)
            .unwrap_or_default()
            .as_millis()
            / 100;
        u32::try_from(ds).unwrap_or(u32::MAX)
    }

    /// The directory record of directory node `id`, once its listing is complete.
    fn ready_dir(&self, id: NodeId) -> Result<u32, SnapshotError> {
        self.settle(id)?;
        let d = {
            let t = self.read();
            let n = t.node(id).ok_or(SnapshotError::NoNode(id))?;
            if !n.visible() {
                return Err(SnapshotError::Source(stagefs_prefetch::SourceError::Gone {
                    path: t.path(id),
                }));
            }
            let Some(d) = t.dir_index(id) else {
                return Err(SnapshotError::NotDir { path: t.path(id) });
            };
            if t.dirs[d as usize].state == DirState::Ready {
                return Ok(d);
            }
            d
        };
        self.wait_listed(d)?;
        Ok(d)
    }
}

/// A metadata snapshot of a source tree. `Send + Sync`; share it as `Arc<Snapshot>`.
pub struct Snapshot {
    inner: Arc<Inner>,
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        // The listing threads hold the shared state, not the snapshot: tell them to stop after
        // their current request.
        self.inner.cancel.store(true, Ordering::SeqCst);
        let _q = lock(&self.inner.queue);
        self.inner.work.notify_all();
        self.inner.done.notify_all();
    }
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("id", &format_args!("{:032x}", self.inner.id))
            .field("root", &self.inner.root)
            .field("len", &self.len())
            .field("complete", &self.is_complete())
            .finish()
    }
}

impl Snapshot {
    /// Stats the root of `source` (which must be a directory), then lists the whole tree in the
    /// background with `opts.threads` requests in flight, and returns at once. `root` is the
    /// canonical path of the source, recorded in the snapshot.
    pub fn scan(
        source: Arc<dyn Source>,
        root: &Path,
        opts: ScanOptions,
    ) -> Result<Arc<Snapshot>, SnapshotError> {
        scan::start(source, root, opts)
    }

    /// Loads a snapshot written by [`Snapshot::save`] (`stagefs index` output): complete at once.
    pub fn load(path: &Path) -> Result<Arc<Snapshot>, SnapshotError> {
        persist::load(path)
    }

    /// Loads the copy persisted in the cache directory by [`Snapshot::save_to`].
    pub fn load_from(dir: &CacheDir, name: &str) -> Result<Arc<Snapshot>, SnapshotError> {
        persist::load_from(dir, name)
    }

    /// Parses a snapshot file's contents already in memory (validated as [`Snapshot::load`]
    /// does); `origin` names them in errors.
    pub fn from_bytes(bytes: &[u8], origin: &Path) -> Result<Arc<Snapshot>, SnapshotError> {
        persist::parse(bytes, origin)
    }

    /// Waits for the listing to complete, then writes the snapshot file's contents to `w`
    /// (for storing it somewhere other than a file of its own).
    pub fn write_to(&self, w: &mut impl std::io::Write) -> Result<(), SnapshotError> {
        self.wait_complete()?;
        persist::write_all(self, w).map_err(|source| SnapshotError::Io {
            path: PathBuf::from("<snapshot stream>"),
            source,
        })
    }

    /// Waits for the listing to complete, then writes the snapshot to `path` atomically (a new
    /// `0600` temporary with a random name in the same directory, fsynced, renamed over `path`).
    pub fn save(&self, path: &Path) -> Result<(), SnapshotError> {
        self.wait_complete()?;
        persist::save(self, path)
    }

    /// As [`Snapshot::save`], as file `name` of the private cache directory.
    pub fn save_to(&self, dir: &CacheDir, name: &str) -> Result<(), SnapshotError> {
        self.wait_complete()?;
        persist::save_to(self, dir, name)
    }

    /// Gives a loaded snapshot the source to re-read metadata from ([`Snapshot::revalidate`],
    /// directories not listed when it was saved). Returns `false` if it already has one (a
    /// scanned snapshot keeps the source it listed).
    pub fn attach_source(&self, source: Arc<dyn Source>) -> bool {
        self.inner.source.set(source).is_ok()
    }

    /// A random id, assigned when the tree was listed and kept in its files.
    pub fn id(&self) -> u128 {
        self.inner.id
    }

    /// The source root, as recorded when the tree was listed.
    pub fn source_root(&self) -> &Path {
        &self.inner.root
    }

    /// Whether the source root is still the directory this snapshot was taken of: the same
    /// inode, ctime, mtime and size as recorded. A tree regenerated at the same path (removed
    /// and recreated, or its entries replaced) changes at least the root's ctime, which no user
    /// can set back; a kept snapshot that fails this must not be served (the caller lists the
    /// source again). One `stat` of the root (counted in [`ScanStats::requests`]); false if it
    /// fails.
    pub fn root_unchanged(&self, source: &dyn Source) -> bool {
        let Some(kept) = self.attr(ROOT) else {
            return false;
        };
        self.inner.requests.fetch_add(1, Ordering::Relaxed);
        match source.stat(Path::new("")) {
            Ok(now) => now.kind == kept.kind && now.version() == kept.version(),
            Err(_) => false,
        }
    }

    /// When the listing started.
    pub fn created(&self) -> SystemTime {
        self.inner.created
    }

    /// Whether the whole tree is listed.
    pub fn is_complete(&self) -> bool {
        self.inner.complete.load(Ordering::SeqCst)
    }

    /// Waits until the whole tree is listed.
    pub fn wait_complete(&self) -> Result<(), SnapshotError> {
        self.inner.wait_complete()
    }

    /// Nodes so far (including entries whose attributes are still being read).
    pub fn len(&self) -> usize {
        self.inner.read().nodes.len()
    }

    /// Whether the snapshot has no nodes (never: the root is always there).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The attributes of node `id` (`None` for an unknown id, or an entry that was skipped or
    /// found gone).
    pub fn attr(&self, id: NodeId) -> Option<NodeAttr> {
        self.inner.read().attr(id)
    }

    /// The directory holding node `id` (`None` for the root and unknown ids).
    pub fn parent(&self, id: NodeId) -> Option<NodeId> {
        let t = self.inner.read();
        t.node(id).map(|n| n.parent).filter(|&p| p != NO_PARENT)
    }

    /// The path of node `id` relative to the source root (`""` for the root).
    pub fn path(&self, id: NodeId) -> Option<PathBuf> {
        let t = self.inner.read();
        t.node(id)?;
        Some(t.path(id))
    }

    /// Whether node `id` is at `rel` (relative to the source root), compared component by
    /// component from the end without building the node's path: how a remount checks, for a
    /// million cached entries, that each is bound to the node of the path it was stored for.
    pub fn is_at(&self, id: NodeId, rel: &Path) -> bool {
        use std::os::unix::ffi::OsStrExt;
        let t = self.inner.read();
        let mut node = id;
        let mut comps = rel.iter().rev();
        loop {
            let Some(n) = t.node(node) else {
                return false;
            };
            if n.parent == NO_PARENT {
                // The root: the path must be used up.
                return comps.next().is_none();
            }
            match comps.next() {
                Some(c) if c.as_bytes() == t.name(node) => node = n.parent,
                _ => return false,
            }
        }
    }

    /// The directory holding node `id` and `id`'s index in its listing (name order): O(1) for
    /// a directory as listed (children are an id range), a binary search by name after a
    /// revalidation re-listed it. How the cross-file walker follows a reader through a
    /// directory without copying names.
    pub fn position(&self, id: NodeId) -> Option<(NodeId, usize)> {
        let t = self.inner.read();
        let parent = t.node(id).map(|n| n.parent).filter(|&p| p != NO_PARENT)?;
        let d = t.dir_index(parent)?;
        let kids = t.kids(d);
        let i = match kids {
            tree::Kids::Range(first, count) => {
                let i = id.checked_sub(first)?;
                (i < count).then_some(i as usize)?
            }
            tree::Kids::List(l) => {
                let name = t.name(id);
                l.binary_search_by(|k| t.name(*k).cmp(name)).ok()?
            }
        };
        Some((parent, i))
    }

    /// The children of directory `dir` at listing indexes `range` (clamped), with their
    /// attributes; entries skipped or gone are left out. No names are copied.
    pub fn children(&self, dir: NodeId, range: std::ops::Range<usize>) -> Vec<(NodeId, NodeAttr)> {
        let t = self.inner.read();
        let Some(d) = t.dir_index(dir) else {
            return Vec::new();
        };
        let kids = t.kids(d);
        (range.start..range.end.min(kids.len()))
            .filter_map(|i| {
                let id = kids.get(i);
                t.attr(id).map(|a| (id, a))
            })
            .collect()
    }

    /// The name of node `id` (empty for the root).
    pub fn name(&self, id: NodeId) -> Option<Vec<u8>> {
        let t = self.inner.read();
        t.node(id)?;
        Some(t.name(id).to_vec())
    }

    /// The target of symlink `id`, exactly as stored.
    pub fn link_target(&self, id: NodeId) -> Option<Vec<u8>> {
        self.inner.read().link(id).map(<[u8]>::to_vec)
    }

    /// The entry `name` of directory `dir`. Waits only for that directory's listing (moving it
    /// to the front of the queue), at most [`ScanOptions::wait_timeout`].
    pub fn lookup(&self, dir: NodeId, name: &OsStr) -> Result<Option<NodeId>, SnapshotError> {
        let d = self.inner.ready_dir(dir)?;
        if !tree::valid_name(name.as_bytes()) {
            return Ok(None);
        }
        Ok(self.inner.read().find(d, name.as_bytes()))
    }

    /// Calls `f(index, id, name, attr)` for the entries of directory `dir` in name order, from
    /// index `start`, until `f` returns `false`. Indexes are stable positions in the listing
    /// (skipped entries leave gaps), so `index + 1` resumes after an entry: a readdir offset.
    pub fn read_dir(
        &self,
        dir: NodeId,
        start: usize,
        mut f: impl FnMut(usize, NodeId, &OsStr, &NodeAttr) -> bool,
    ) -> Result<(), SnapshotError> {
        let d = self.inner.ready_dir(dir)?;
        let mut next = start;
        let mut batch: Vec<(usize, NodeId, NodeAttr, usize, usize)> =
            Vec::with_capacity(READDIR_BATCH);
        let mut names: Vec<u8> = Vec::new();
        loop {
            batch.clear();
            names.clear();
            let more = {
                let t = self.inner.read();
                let kids = t.kids(d);
                while batch.len() < READDIR_BATCH && next < kids.len() {
                    let id = kids.get(next);
                    if let Some(a) = t.attr(id) {
                        let name = t.name(id);
                        batch.push((next, id, a, names.len(), name.len()));
                        names.extend_from_slice(name);
                    }
                    next += 1;
                }
                next < kids.len()
            };
            for (i, id, a, off, len) in &batch {
                if !f(*i, *id, OsStr::from_bytes(&names[*off..*off + *len]), a) {
                    return Ok(());
                }
            }
            if !more {
                return Ok(());
            }
        }
    }

    /// The node at `rel` (relative to the source root, normal components only), waiting for
    /// each directory on the way as [`Snapshot::lookup`] does.
    pub fn resolve(&self, rel: &Path) -> Result<Option<NodeId>, SnapshotError> {
        check_rel(rel)?;
        let mut cur = ROOT;
        for part in rel.iter() {
            match self.lookup(cur, part)? {
                Some(id) => cur = id,
                None => return Ok(None),
            }
        }
        Ok(Some(cur))
    }

    /// Calls `f` for every node of the tree, depth first in name order, parents before their
    /// entries, starting with the root. Waits for the listing to complete first (a directory
    /// not listed, such as one revalidation found, is listed on the way).
    pub fn walk(&self, mut f: impl FnMut(NodeId, &NodeAttr)) {
        // A stopped listing still walks what it has.
        let _ = self.wait_complete();
        let mut stack: Vec<(Vec<NodeId>, usize)> = vec![(vec![ROOT], 0)];
        let mut batch: Vec<(NodeId, NodeAttr)> = Vec::with_capacity(WALK_BATCH);
        while !stack.is_empty() {
            let mut unlisted = None;
            {
                let t = self.inner.read();
                while batch.len() < WALK_BATCH {
                    let Some((ids, pos)) = stack.last_mut() else {
                        break;
                    };
                    let Some(&id) = ids.get(*pos) else {
                        stack.pop();
                        continue;
                    };
                    *pos += 1;
                    let Some(a) = t.attr(id) else { continue };
                    let dir = t.dir_index(id);
                    batch.push((id, a));
                    if let Some(d) = dir {
                        if t.dirs[d as usize].state == DirState::Ready {
                            stack.push((visible_kids(&t, d), 0));
                        } else {
                            unlisted = Some(d);
                            break;
                        }
                    }
                }
            }
            for (id, a) in batch.drain(..) {
                f(id, &a);
            }
            if let Some(d) = unlisted {
                // A failed or unlistable directory walks as empty (its error is in `errors`).
                if self.inner.wait_listed(d).is_ok() {
                    stack.push((visible_kids(&self.inner.read(), d), 0));
                }
            }
        }
    }

    /// Directories and entries skipped while listing (e.g. unreadable ones), with their paths:
    /// at most 1000, then a line with the number left out.
    pub fn errors(&self) -> Vec<String> {
        let t = self.inner.read();
        let mut out = t.errors.clone();
        let left = t.errors_total.saturating_sub(out.len() as u64);
        if left > 0 {
            out.push(format!("... and {left} more"));
        }
        out
    }

    /// Re-stats node `id` on the source if it was last checked more than `max_age` ago, and
    /// returns its (possibly new) attributes. A directory whose mtime changed is re-listed:
    /// names that still exist keep their ids, new names get new ids, removed names disappear
    /// from listings. A node found gone is removed and reported as [`SourceError::Gone`].
    ///
    /// [`SourceError::Gone`]: stagefs_prefetch::SourceError::Gone
    pub fn revalidate(&self, id: NodeId, max_age: Duration) -> Result<NodeAttr, SnapshotError> {
        self.inner.revalidate(id, max_age)
    }

    /// Bytes the snapshot holds in memory (by allocated capacity).
    pub fn memory_bytes(&self) -> usize {
        let q = lock(&self.inner.queue);
        let queue = (q.urgent.capacity() + q.normal.capacity()) * std::mem::size_of::<Job>()
            + q.boosted.capacity() * (std::mem::size_of::<u32>() + 1);
        drop(q);
        self.inner.read().memory_bytes() + queue + std::mem::size_of::<Inner>()
    }

    /// How far the listing has come.
    pub fn scan_stats(&self) -> ScanStats {
        let complete = self.is_complete();
        let elapsed = if complete {
            Duration::from_nanos(self.inner.elapsed_ns.load(Ordering::SeqCst))
        } else {
            self.inner.started.elapsed()
        };
        let t = self.inner.read();
        ScanStats {
            dirs: t.dirs_listed,
            entries: t.entries,
            pending_dirs: self.inner.unfinished.load(Ordering::SeqCst) as u64,
            requests: self.inner.requests.load(Ordering::SeqCst),
            elapsed,
            errors: t.errors_total,
            complete,
        }
    }
}

/// The listed entries of ready directory record `d`, in name order.
fn visible_kids(t: &Tree, d: u32) -> Vec<NodeId> {
    let kids = t.kids(d);
    (0..kids.len())
        .map(|i| kids.get(i))
        .filter(|&id| t.node(id).is_some_and(|n| n.visible()))
        .collect()
}

// The filesystem shares one snapshot across its request threads.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Snapshot>();
};
