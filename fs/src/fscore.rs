//! The filesystem core: every request as a plain method, so tests drive it without a kernel.
//!
//! The tree is served from the metadata snapshot ([`crate::snapshot`]): lookups, attributes and
//! listings never touch the source (on a parallel filesystem each would be a round trip to the
//! metadata server, every epoch). The snapshot is taken at mount with many requests in flight,
//! streamed (a lookup waits only for the directory it needs), persisted in the cache so a
//! remount lists nothing, or loaded from `stagefs index` output (`--index`) so N training nodes
//! list nothing at all. *Snapshot semantics*: the mount presents the dataset as it was then;
//! every read from the source is checked against the snapshot on the open descriptor, and a
//! file changed since fails with `ESTALE` (and a log line) rather than serving other bytes.
//! `--revalidate SECONDS` opts into re-checking metadata at most that often.
//!
//! Data goes through [`Files`] (the cache, then the source) and [`Views`] (`.npy/`). Fully cached
//! large files can be handed to the kernel for passthrough once verified in this mount (the
//! verification runs in the background, off the read path).
//!
//! This module holds the requests and the types they answer with; the core's parts are built,
//! and its background work started and stopped, in [`crate::session`]; the stats file is
//! rendered by [`crate::control`]. Read-order hints and direct descriptors are services of
//! their own ([`crate::hints`], [`crate::direct`]) that the core holds and delegates to.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use stagefs_prefetch::locks::lock;
use stagefs_prefetch::readahead::ReadAhead;
use stagefs_prefetch::{CacheStore, EntryId, FetchConfig, Fetcher, FileKind, Stats, StatsSnapshot};
use stagefs_views::ViewKind;
use tracing::{info, warn};

use crate::control::{StatsFile, StatsLook, CONTROL_DIR, STATS_FILE, VIEW_DIR};
use crate::direct::DirectService;
use crate::error::FsError;
use crate::files::{is_large, FileState, Files, ReadData};
use crate::handle::VerifyQueue;
use crate::hints::{HintServer, HintService, Rejected};
use crate::inode::{source_ino, InodeTable, Node, Virtual, ROOT_INO};
use crate::snapshot::{NodeAttr, NodeId, Snapshot, ROOT};
use crate::views::{MountViews, OpenView, Views};

/// Files after an opened small file that are fetched ahead (about 3 MB of 100 KB images: a
/// DataLoader batch or two, enough to hide per-file latency without flooding the queue).
pub const CROSS_FILE_COUNT: usize = 32;
/// Views kept open for reads without a handle: 256 covers the files every worker of a job
/// reads at once; an evicted one is opened again (from the view set's parsed metadata) by its
/// next read.
pub(crate) const VIEWS_BY_INO: std::num::NonZeroUsize = match std::num::NonZeroUsize::new(256) {
    Some(n) => n,
    None => panic!("256 is not zero"),
};

/// Metadata requests in flight while listing the source (`stagefs mount --scan-threads`):
/// parallel filesystems answer concurrent requests far faster than serial ones, and 64 keeps
/// one node's listing from crowding out the others'.
pub const DEFAULT_SCAN_THREADS: usize = 64;

/// How to run the filesystem.
#[derive(Clone, Debug)]
pub struct FsConfig {
    /// The source directory (canonical).
    pub source: PathBuf,
    /// The cache directory on scratch.
    pub cache_dir: PathBuf,
    /// Cache capacity in bytes.
    pub cache_size: u64,
    /// Read scratch with `O_DIRECT` (see `prefetch::store::scratch`); off: through the page
    /// cache.
    pub direct_scratch: bool,
    /// Worker pool sizing.
    pub fetch: FetchConfig,
    /// Stage the whole tree in the background when it fits.
    pub stage: bool,
    /// Stage only what loaders declare as this node's part ([`crate::scope`]): no tree
    /// staging before (or without) a declaration. Needs `stage`.
    pub stage_hinted: bool,
    /// Cross-file prefetch depth (0 disables).
    pub cross_file: usize,
    /// Side S of images in `.npy/` views.
    pub image_size: u32,
    /// A corrupt image fails view reads with EIO instead of reading as zeros.
    pub strict_views: bool,
    /// Start from this `stagefs index` snapshot instead of listing the source.
    pub index: Option<PathBuf>,
    /// List the source again even if the cache holds a snapshot of it.
    pub rescan: bool,
    /// Re-check metadata at most this often (snapshot semantics otherwise).
    pub revalidate: Option<Duration>,
    /// Requests in flight while listing the source.
    pub scan_threads: usize,
    /// Image views decode JPEGs at a reduced DCT scale (fast mode) instead of exactly.
    pub fast_decode: bool,
    /// Largest image (width × height) the views decode; larger ones are bad inputs.
    pub max_image_pixels: u64,
    /// Pixels all image decodes of the daemon (FUSE reads and background rendering) may hold
    /// at once.
    pub decode_budget: u64,
}

impl FsConfig {
    /// The configuration `stagefs mount` uses unless told otherwise, for `source` cached in
    /// `cache_dir`: 90 % of the free space on the cache's filesystem, 32 fetch workers,
    /// staging on, 224-pixel views decoded exactly, 64 metadata requests in flight, snapshot
    /// semantics (no revalidation), direct reads of scratch. The rules between settings are
    /// the mount's ([`crate::mount::MountOptions::settled`]).
    pub fn new(source: PathBuf, cache_dir: PathBuf) -> FsConfig {
        FsConfig {
            cache_size: default_cache_size(&cache_dir),
            source,
            cache_dir,
            direct_scratch: true,
            fetch: FetchConfig::default(),
            stage: true,
            stage_hinted: false,
            cross_file: CROSS_FILE_COUNT,
            image_size: stagefs_views::view::DEFAULT_IMAGE_SIZE,
            strict_views: false,
            index: None,
            rescan: false,
            revalidate: None,
            scan_threads: DEFAULT_SCAN_THREADS,
            fast_decode: false,
            max_image_pixels: stagefs_views::image::decode::DEFAULT_MAX_PIXELS,
            decode_budget: stagefs_views::image::budget::DEFAULT_BUDGET_PIXELS,
        }
    }
}

/// 90 % of the space free to this user on `dir`'s filesystem plus what the cache in `dir`
/// already holds there (10 GiB if it cannot be asked): the cache then never takes the last of
/// scratch, and a full scratch caps it anyway. Counting its own files matters at a remount: a
/// cache that filled most of scratch would otherwise be given only the little space left and
/// evict itself.
pub fn default_cache_size(dir: &Path) -> u64 {
    match rustix::fs::statvfs(dir) {
        Ok(s) => {
            let free = s.f_bavail.saturating_mul(s.f_frsize);
            free.saturating_add(bytes_held(dir, 3)) / 10 * 9
        }
        Err(_) => 10 << 30,
    }
}

/// Bytes allocated on disk to the regular files under `dir`, `depth` levels down (the cache's
/// data files are two below it), never following a symlink.
fn bytes_held(dir: &Path, depth: u32) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut sum = 0u64;
    for entry in entries.flatten() {
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        if meta.is_file() {
            sum = sum.saturating_add(meta.blocks().saturating_mul(512));
        } else if meta.is_dir() && depth > 1 {
            sum = sum.saturating_add(bytes_held(&entry.path(), depth - 1));
        }
    }
    sum
}

/// Attributes of a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attr {
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// 512-byte blocks (derived from the size).
    pub blocks: u64,
    /// Last modification (also reported as access and change time).
    pub mtime: SystemTime,
    /// Type.
    pub kind: FileKind,
    /// Permission bits.
    pub perm: u16,
    /// Hard links.
    pub nlink: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Device number for device nodes.
    pub rdev: u32,
}

/// One directory entry, as `readdir` hands it out.
#[derive(Clone, Debug)]
pub struct DirEntry<'a> {
    /// Offset to resume after this entry.
    pub offset: u64,
    /// Inode number.
    pub ino: u64,
    /// Type.
    pub kind: FileKind,
    /// Name.
    pub name: &'a OsStr,
    /// Attributes (for `readdirplus`).
    pub attr: Attr,
}

/// What an open answers.
#[derive(Debug)]
pub struct Opened {
    /// The handle for later reads.
    pub fh: u64,
    /// Keep the kernel's page cache from earlier opens (contents unchanged).
    pub keep_cache: bool,
    /// Bypass the page cache (virtual files whose contents change).
    pub direct_io: bool,
    /// A fully cached, verified file the kernel may read directly (passthrough).
    pub passthrough: Option<std::fs::File>,
}

/// What an open handle reads.
pub(crate) enum Handle {
    Source {
        state: Arc<FileState>,
        ra: Mutex<ReadAhead>,
        pinned: Option<EntryId>,
    },
    Bytes(Vec<u8>),
    View(Arc<OpenView>),
}

/// Where the snapshot being served came from (the stats' `snapshot` field).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotOrigin {
    /// Loaded from `stagefs index` output (`--index`).
    Index,
    /// The one an earlier mount of this source kept in the cache.
    Cache,
    /// Listed from the source by this mount.
    Listed,
}

impl SnapshotOrigin {
    /// Its name in the stats.
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotOrigin::Index => "index",
            SnapshotOrigin::Cache => "cache",
            SnapshotOrigin::Listed => "listed",
        }
    }

    /// Whether the snapshot is kept in the cache already (else it is kept once complete).
    pub fn persisted(self) -> bool {
        self == SnapshotOrigin::Cache
    }
}

/// The filesystem. Its parts are built, and its background work started and stopped, in
/// [`crate::session`]; the request methods are here.
pub struct FsCore {
    pub(crate) cfg: FsConfig,
    pub(crate) snapshot: Arc<Snapshot>,
    pub(crate) files: Arc<Files>,
    pub(crate) fetcher: Fetcher,
    pub(crate) store: Arc<CacheStore>,
    pub(crate) stats: Arc<Stats>,
    /// Shared with the hint service, which pushes into views' pages by inode.
    pub(crate) inodes: Arc<InodeTable>,
    pub(crate) handles: Mutex<HashMap<u64, Arc<Handle>>>,
    /// Views read without a handle (a normal user's mount skips opens), by inode, at most
    /// [`VIEWS_BY_INO`]: each holds its table's or folder's metadata, and kept for every view
    /// ever read they grew without bound (12 wide tables held 3 GB).
    pub(crate) views_by_ino: Mutex<lru::LruCache<u64, Arc<OpenView>>>,
    pub(crate) next_fh: AtomicU64,
    pub(crate) stop: Arc<AtomicBool>,
    /// Background threads, joined at stop.
    pub(crate) threads: Mutex<Vec<JoinHandle<()>>>,
    /// The `.npy/` views, prepared on first use.
    pub(crate) views: Arc<MountViews>,
    /// Complete copies waiting for background verification.
    pub(crate) verify: Arc<VerifyQueue>,
    /// Where the snapshot came from (for the stats).
    pub(crate) origin: SnapshotOrigin,
    /// The stats file as readers without a handle see it.
    pub(crate) stats_file: StatsFile,
    /// Read-order hints ([`crate::hints`]).
    pub(crate) hints: Arc<HintService>,
    /// The hint socket, from [`FsCore::start_hints`] (once the kernel session runs) to stop.
    pub(crate) hint_server: Mutex<Option<HintServer>>,
    /// Direct descriptors ([`crate::direct`]).
    pub(crate) direct: Arc<DirectService>,
}

fn time(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

fn attr_of(ino: u64, a: &NodeAttr) -> Attr {
    Attr {
        ino,
        size: a.size,
        blocks: a.size.div_ceil(512),
        mtime: time(a.mtime_ns),
        kind: a.kind,
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev as u32,
    }
}

impl FsCore {
    /// Whether metadata is re-checked while mounted (`--revalidate`) instead of a snapshot
    /// served as taken.
    pub fn revalidating(&self) -> bool {
        self.cfg.revalidate.is_some()
    }

    /// Whether a request about inode `ino` (or, with `name`, about its child `name`) may render
    /// a view: anything under `.npy/`, and `.npy` itself (its first use builds the view set).
    /// The adapter runs those on its view pool ([`crate::offload`]). No lock for source inodes.
    pub fn may_render(&self, ino: u64, name: Option<&OsStr>) -> bool {
        if ino < crate::inode::VIRTUAL_BASE {
            return ino == ROOT_INO && name.is_some_and(|n| n == VIEW_DIR);
        }
        matches!(
            self.inodes.get(ino),
            Some(Node::Virtual(Virtual::ViewDir(_) | Virtual::ViewFile(_)))
        )
    }

    /// The inode number of `.stagefs/stats`.
    pub fn stats_ino(&self) -> u64 {
        self.inodes.ino(Virtual::Stats)
    }

    /// Bytes the files' remembered blocks hold now (bounded by [`crate::files::MEMO_BUDGET`]).
    pub fn memo_bytes(&self) -> u64 {
        self.files.memo_bytes()
    }

    /// The live counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// The cache store.
    pub fn store(&self) -> &Arc<CacheStore> {
        &self.store
    }

    /// The metadata snapshot being served.
    pub fn snapshot_ref(&self) -> &Arc<Snapshot> {
        &self.snapshot
    }

    /// A snapshot of the statistics with occupancy and identity filled in.
    pub fn snapshot(&self) -> StatsSnapshot {
        let mut s = self.stats.snapshot();
        s.cache_used = self.store.used();
        s.cache_capacity = self.store.capacity();
        s.pid = std::process::id();
        s.cache_dir = self.cfg.cache_dir.display().to_string();
        s.source = self.cfg.source.display().to_string();
        let scan = self.snapshot.scan_stats();
        s.metadata_requests = scan.requests;
        s.snapshot_entries = self.snapshot.len() as u64;
        s.snapshot = self.origin.as_str().to_string();
        s.hint_socket = self.hint_socket().map(|p| p.display().to_string());
        s.direct_pins = self.direct.direct_pins() as u64;
        // Opens through the direct table are counted by the readers themselves.
        let (opens, bytes) = self.direct.table_counted();
        s.direct_table_opens = opens;
        s.direct_opens += opens;
        s.bytes_direct += bytes;
        s
    }

    /// Applies one hint line as the socket's worker does (views render where a running hint
    /// socket renders them): the bytes it names, or why it was ignored ([`crate::hints`]).
    pub fn hint(&self, line: &[u8]) -> Result<u64, Rejected> {
        let on = lock(&self.hint_server)
            .as_ref()
            .map(HintServer::renderer)
            .unwrap_or_default();
        self.hints.hint(line, &on)
    }

    /// Pushes the pending hinted blocks that are cached now, drops those waited on too long;
    /// how many were pushed.
    pub fn push_hinted(&self) -> usize {
        self.hints.push_hinted()
    }

    /// Direct descriptors pinned now, by all connections ([`crate::direct`]).
    pub fn direct_pins(&self) -> usize {
        self.direct.direct_pins()
    }

    fn node(&self, ino: u64) -> Result<Node, FsError> {
        self.inodes.get(ino).ok_or(FsError::BadHandle)
    }

    /// The attributes of snapshot node `id` (re-checked first under `--revalidate`).
    fn node_attr(&self, id: NodeId) -> Result<NodeAttr, FsError> {
        if let Some(max_age) = self.cfg.revalidate {
            let before = self.snapshot.attr(id);
            let now = self.snapshot.revalidate(id, max_age)?;
            if before.is_some_and(|b| b.version() != now.version()) && now.kind == FileKind::File {
                self.files.unbind(id);
            }
            return Ok(now);
        }
        self.snapshot.attr(id).ok_or(FsError::NotFound)
    }

    /// Attributes of a virtual node: the owner and mtime of the source root for the control
    /// tree; for views, the owner and read bits of the input they are derived from (so a 0600
    /// table's columns are as private as the table, with `default_permissions` enforcing it).
    fn virtual_attr(&self, ino: u64, kind: FileKind, size: u64, input: Option<NodeAttr>) -> Attr {
        let root = self.snapshot.attr(ROOT);
        let base = input.or(root);
        let (mtime, uid, gid, read) = base
            .as_ref()
            .map(|a| (time(a.mtime_ns), a.uid, a.gid, a.perm & 0o444))
            .unwrap_or((UNIX_EPOCH, 0, 0, 0o444));
        let perm = if kind == FileKind::Dir {
            // Read and search for the classes that have both on the input (one that may list
            // but not enter a source directory may not enter its view either).
            // (A table's view directory: the classes that may read the table.)
            let search = match base {
                Some(a) if a.kind == FileKind::Dir => (a.perm & 0o111) << 2,
                _ => 0o444,
            };
            let both = read & search;
            both | (both >> 2)
        } else {
            read
        };
        Attr {
            ino,
            size,
            blocks: size.div_ceil(512),
            mtime,
            kind,
            perm,
            nlink: if kind == FileKind::Dir { 2 } else { 1 },
            uid,
            gid,
            rdev: 0,
        }
    }

    fn control_attr(&self, ino: u64, kind: FileKind, size: u64) -> Attr {
        let mut a = self.virtual_attr(ino, kind, size, None);
        // The stats are about the mount, readable by whoever may read its root.
        if kind == FileKind::Dir {
            a.perm = 0o555 & (a.perm | 0o500);
        } else {
            a.perm = 0o444 & (a.perm | 0o400);
        }
        a
    }

    fn view_attr(&self, ino: u64, rel: &Path, kind: ViewKind, views: &Views) -> Attr {
        match kind {
            ViewKind::Dir => self.virtual_attr(ino, FileKind::Dir, 0, views.input_of(rel, true)),
            ViewKind::File(len) => {
                let mut input = views.input_of(rel, false);
                // An image folder's view files hold every image under it: they narrow to the
                // classes that may read all of them (a table's columns have one input).
                if let Some(a) = input.as_mut().filter(|a| a.kind == FileKind::Dir) {
                    let folder = rel.parent().unwrap_or(Path::new(""));
                    a.perm &= !0o444 | views.folder_read_bits(folder, a);
                }
                self.virtual_attr(ino, FileKind::File, len, input)
            }
        }
    }

    fn view_node(&self, rel: PathBuf, kind: ViewKind, views: &Views) -> Attr {
        let ino = self.inodes.ino(match kind {
            ViewKind::Dir => Virtual::ViewDir(rel.clone()),
            ViewKind::File(_) => Virtual::ViewFile(rel.clone()),
        });
        self.view_attr(ino, &rel, kind, views)
    }

    /// Attributes of `ino`.
    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        match self.node(ino)? {
            Node::Source(id) => Ok(attr_of(ino, &self.node_attr(id)?)),
            Node::Virtual(Virtual::ControlDir) => Ok(self.control_attr(ino, FileKind::Dir, 0)),
            Node::Virtual(Virtual::Stats) => Ok(self.stats_attr(ino, StatsLook::Held)),
            Node::Virtual(Virtual::ViewDir(rel)) if rel.as_os_str().is_empty() => {
                Ok(self.virtual_attr(ino, FileKind::Dir, 0, None))
            }
            Node::Virtual(Virtual::ViewDir(rel) | Virtual::ViewFile(rel)) => {
                let views = self.views.get()?;
                let kind = views.stat(&rel)?;
                Ok(self.view_attr(ino, &rel, kind, &views))
            }
        }
    }

    /// Looks up `name` in directory `parent`.
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, FsError> {
        match self.node(parent)? {
            Node::Source(dir) => {
                if dir == ROOT && name == CONTROL_DIR {
                    return self.getattr(self.inodes.ino(Virtual::ControlDir));
                }
                if dir == ROOT && name == VIEW_DIR {
                    return self.getattr(self.inodes.ino(Virtual::ViewDir(PathBuf::new())));
                }
                if self.cfg.revalidate.is_some() {
                    self.node_attr(dir)?;
                }
                let id = self.snapshot.lookup(dir, name)?.ok_or(FsError::NotFound)?;
                Ok(attr_of(source_ino(id), &self.node_attr(id)?))
            }
            Node::Virtual(Virtual::ControlDir) if name == STATS_FILE => {
                Ok(self.stats_attr(self.inodes.ino(Virtual::Stats), StatsLook::Lookup))
            }
            Node::Virtual(Virtual::ControlDir) => Err(FsError::NotFound),
            Node::Virtual(Virtual::Stats | Virtual::ViewFile(_)) => Err(FsError::NotDir),
            Node::Virtual(Virtual::ViewDir(rel)) => {
                let views = self.views.get()?;
                let child = rel.join(name);
                let kind = views.stat(&child)?;
                Ok(self.view_node(child, kind, &views))
            }
        }
    }

    /// Lists directory `ino` from `offset` (as the kernel resumes: 0 at the start, then the
    /// offset of the last entry it kept), calling `add` per entry until it returns true (reply
    /// buffer full). Offsets 1 and 2 are `.` and `..`. The virtual `.stagefs` and `.npy` are
    /// not listed in the root (reachable by name, like ZFS's hidden `.zfs`), so `du`, `find`,
    /// `tar` and `rsync` see the dataset only.
    pub fn readdir(
        &self,
        ino: u64,
        offset: u64,
        mut add: impl FnMut(DirEntry<'_>) -> bool,
    ) -> Result<(), FsError> {
        let dots = |add: &mut dyn FnMut(DirEntry<'_>) -> bool, this: Attr| {
            for (off, name) in [(1u64, "."), (2, "..")] {
                if off > offset {
                    let e = DirEntry {
                        offset: off,
                        ino: this.ino,
                        kind: FileKind::Dir,
                        name: OsStr::new(name),
                        attr: this.clone(),
                    };
                    if add(e) {
                        return true;
                    }
                }
            }
            false
        };
        let start = offset.saturating_sub(2) as usize;
        match self.node(ino)? {
            Node::Source(dir) => {
                let this = attr_of(ino, &self.node_attr(dir)?);
                if this.kind != FileKind::Dir {
                    return Err(FsError::NotDir);
                }
                if dots(&mut add, this) {
                    return Ok(());
                }
                let mut err = None;
                self.snapshot.read_dir(dir, start, |i, id, name, attr| {
                    if dir == ROOT && (name == CONTROL_DIR || name == VIEW_DIR) {
                        return true;
                    }
                    let attr = match self.cfg.revalidate {
                        Some(_) => match self.node_attr(id) {
                            Ok(a) => a,
                            Err(e) => {
                                err = Some(e);
                                return false;
                            }
                        },
                        None => attr.clone(),
                    };
                    let ino = source_ino(id);
                    !add(DirEntry {
                        offset: i as u64 + 3,
                        ino,
                        kind: attr.kind,
                        name,
                        attr: attr_of(ino, &attr),
                    })
                })?;
                err.map_or(Ok(()), Err)
            }
            Node::Virtual(v) => {
                let this = self.getattr(ino)?;
                if this.kind != FileKind::Dir {
                    return Err(FsError::NotDir);
                }
                if dots(&mut add, this) {
                    return Ok(());
                }
                let entries: Vec<(OsString, Attr)> = match v {
                    Virtual::ControlDir => {
                        let ino = self.inodes.ino(Virtual::Stats);
                        vec![(STATS_FILE.into(), self.getattr(ino)?)]
                    }
                    Virtual::ViewDir(rel) => {
                        let views = self.views.get()?;
                        views
                            .read_dir(&rel)?
                            .into_iter()
                            .map(|(name, kind)| {
                                let a = self.view_node(rel.join(&name), kind, &views);
                                (name, a)
                            })
                            .collect()
                    }
                    Virtual::Stats | Virtual::ViewFile(_) => return Err(FsError::NotDir),
                };
                for (i, (name, attr)) in entries.iter().enumerate().skip(start) {
                    let e = DirEntry {
                        offset: i as u64 + 3,
                        ino: attr.ino,
                        kind: attr.kind,
                        name,
                        attr: attr.clone(),
                    };
                    if add(e) {
                        break;
                    }
                }
                Ok(())
            }
        }
    }

    /// The target of symlink `ino`, exactly as stored (never resolved).
    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>, FsError> {
        match self.node(ino)? {
            Node::Source(id) => self.snapshot.link_target(id).ok_or(FsError::NotSymlink),
            Node::Virtual(_) => Err(FsError::NotSymlink),
        }
    }

    /// Opens `ino` for reading; `write` (any write access) fails with EROFS. With
    /// `passthrough`, a fully cached and verified file comes back ready for kernel passthrough.
    pub fn open(&self, ino: u64, write: bool, passthrough: bool) -> Result<Opened, FsError> {
        if write {
            return Err(FsError::ReadOnly);
        }
        let (handle, keep_cache, direct_io, pt) = match self.node(ino)? {
            Node::Source(id) => {
                let attr = self.node_attr(id)?;
                match attr.kind {
                    FileKind::Dir => return Err(FsError::IsDir),
                    FileKind::File => {}
                    _ => return Err(FsError::NotFound),
                }
                let state = self.files.state(id, &attr)?;
                self.files.opened(id, attr.size);
                let pt = if passthrough && is_large(attr.size) {
                    self.passthrough_file(state.entry)
                } else {
                    None
                };
                if pt.is_some() {
                    self.stats.passthrough_opens.fetch_add(1, Relaxed);
                    self.stats.bytes_passthrough.fetch_add(attr.size, Relaxed);
                }
                let h = Handle::Source {
                    ra: Mutex::new(ReadAhead::default()),
                    pinned: pt.as_ref().map(|_| state.entry),
                    state,
                };
                // Snapshot semantics: the file's contents never change for the mount's life.
                (h, self.cfg.revalidate.is_none(), false, pt)
            }
            Node::Virtual(Virtual::Stats) => (
                Handle::Bytes(self.stats_json().into_bytes()),
                false,
                true,
                None,
            ),
            Node::Virtual(Virtual::ControlDir | Virtual::ViewDir(_)) => return Err(FsError::IsDir),
            // Views are immutable for the life of the mount: keep the kernel's pages.
            Node::Virtual(Virtual::ViewFile(rel)) => (
                Handle::View(self.views.get()?.open(&rel)?),
                true,
                false,
                None,
            ),
        };
        let fh = self.next_fh.fetch_add(1, Relaxed);
        lock(&self.handles).insert(fh, Arc::new(handle));
        Ok(Opened {
            fh,
            keep_cache,
            direct_io,
            passthrough: pt,
        })
    }

    /// A passthrough descriptor for entry `id` if it is complete and verified; if it is
    /// complete but not yet verified in this mount, the verification is queued (off the read
    /// path) and this open is served by the daemon.
    fn passthrough_file(&self, id: EntryId) -> Option<std::fs::File> {
        if let Some(f) = self.store.pin_passthrough(id) {
            return Some(f);
        }
        if self.store.is_complete(id) {
            self.verify.queue(id);
        }
        None
    }

    /// Reads up to `size` bytes at `offset` through handle `fh` (0: no handle, for kernels
    /// that skip `open`; then the inode decides).
    pub fn read(&self, ino: u64, fh: u64, offset: u64, size: u32) -> Result<ReadData, FsError> {
        let handle = lock(&self.handles).get(&fh).cloned();
        let Some(handle) = handle else {
            if fh != 0 {
                return Err(FsError::BadHandle);
            }
            return self.read_unopened(ino, offset, size);
        };
        match &*handle {
            Handle::Source { state, ra, .. } => self.files.read(state, ra, offset, size),
            Handle::View(v) => self.read_view(v, offset, size),
            Handle::Bytes(bytes) => {
                let start = (offset as usize).min(bytes.len());
                let end = start.saturating_add(size as usize).min(bytes.len());
                Ok(ReadData::Gathered(bytes[start..end].to_vec()))
            }
        }
    }

    fn read_unopened(&self, ino: u64, offset: u64, size: u32) -> Result<ReadData, FsError> {
        match self.node(ino)? {
            Node::Source(id) => {
                let attr = self.node_attr(id)?;
                if attr.kind != FileKind::File {
                    return Err(FsError::IsDir);
                }
                let state = self.files.state(id, &attr)?;
                if offset == 0 {
                    self.files.opened(id, attr.size);
                }
                self.files.read(&state, &state.ra, offset, size)
            }
            Node::Virtual(Virtual::Stats) => {
                let (_, s) = self.stats_view(StatsLook::Held);
                let start = (offset as usize).min(s.len());
                let end = start.saturating_add(size as usize).min(s.len());
                Ok(ReadData::Gathered(s[start..end].to_vec()))
            }
            Node::Virtual(Virtual::ViewFile(rel)) => {
                let known = lock(&self.views_by_ino).get(&ino).cloned();
                let v = match known {
                    Some(v) => v,
                    None => {
                        let v = self.views.get()?.open(&rel)?;
                        lock(&self.views_by_ino).put(ino, v.clone());
                        v
                    }
                };
                self.read_view(&v, offset, size)
            }
            Node::Virtual(_) => Err(FsError::IsDir),
        }
    }

    fn read_view(&self, v: &Arc<OpenView>, offset: u64, size: u32) -> Result<ReadData, FsError> {
        let views = self.views.get()?;
        Ok(views.read(v, offset, size as usize).inspect_err(|e| {
            let msg = format!("view read failed: {e}");
            if !self.stats.has_error(&msg) {
                warn!("{msg}");
                self.stats.error(msg);
            }
        })?)
    }

    /// Releases handle `fh`.
    pub fn release(&self, fh: u64) {
        if let Some(h) = lock(&self.handles).remove(&fh) {
            if let Handle::Source {
                pinned: Some(id), ..
            } = &*h
            {
                self.store.unpin(*id);
            }
        }
    }

    /// The stats file as a reader without a handle sees it: one rendering shared by the
    /// lookup that gives its size and the attribute requests and reads that follow
    /// ([`StatsFile`]).
    fn stats_view(&self, look: StatsLook) -> (SystemTime, Arc<[u8]>) {
        self.stats_file.view(look, || self.stats_json())
    }

    /// The stats file's attributes, from the rendering `look` gets.
    fn stats_attr(&self, ino: u64, look: StatsLook) -> Attr {
        let (taken, bytes) = self.stats_view(look);
        let mut a = self.control_attr(ino, FileKind::File, bytes.len() as u64);
        // A new mtime with every new view: with FUSE_AUTO_INVAL_DATA the kernel then drops
        // the pages it kept of the file (it keeps pages across opens when opens are skipped),
        // so a read after that sees the new view.
        a.mtime = taken;
        a
    }

    /// The stats file's contents.
    pub fn stats_json(&self) -> String {
        crate::control::render(&self.snapshot())
    }

    /// The source directory.
    pub fn source(&self) -> &Path {
        &self.cfg.source
    }

    /// The root inode number.
    pub fn root(&self) -> u64 {
        ROOT_INO
    }

    /// How long the kernel may cache entries and attributes: the life of the mount under
    /// snapshot semantics, the revalidation interval otherwise.
    pub fn ttl(&self) -> Duration {
        self.cfg
            .revalidate
            .unwrap_or(Duration::from_secs(365 * 24 * 3600))
    }
}

/// Logs a one-line summary at unmount.
pub fn log_summary(core: &FsCore) {
    let s = core.snapshot();
    info!(
        from_cache = s.bytes_from_cache,
        from_source = s.bytes_from_source,
        staged = s.bytes_staged,
        replies_dropped = s.replies_dropped,
        "unmounted"
    );
}
