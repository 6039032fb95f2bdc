//! The filesystem core: every request as a plain method, so tests drive it without a kernel.
//!
//! Source files are served through the [`Fetcher`] (cache first, source on a miss); each open
//! records the source's size and mtime and every read is checked against them, so a file that
//! changes while mounted is never served mixed (`ESTALE`), and the kernel's page cache is kept
//! across opens (`FOPEN_KEEP_CACHE`) only while the source is unchanged. Fully cached files can
//! be handed to the kernel for passthrough. Opening a small file queues the next files of its
//! directory ([`CROSS_FILE_COUNT`]) so small-file epochs are not one round trip per file.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{self, Metadata};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use stagefs_prefetch::readahead::ReadAhead;
use stagefs_prefetch::staging::SMALL_FILE;
use stagefs_prefetch::{
    block_count, BlockMemo, CacheStore, FetchConfig, Fetcher, LocalSource, Priority, Signature,
    Stats, StatsSnapshot, StoreConfig,
};
use tracing::{info, warn};

use crate::control::{CONTROL_DIR, STATS_FILE, VIEW_DIR};
use crate::error::FsError;
use crate::inode::{InodeTable, Node, ROOT};
use crate::listing::Listings;
use crate::views::{OpenView, Views};
use stagefs_views::ViewKind;

/// Files after an opened small file that are fetched ahead (about 3 MB of 100 KB images: a
/// DataLoader batch or two, enough to hide per-file latency without flooding the queue).
pub const CROSS_FILE_COUNT: usize = 32;
/// Pending cross-file requests; more are dropped (the next open asks again).
const CROSS_FILE_QUEUE: usize = 64;
/// Interval between flushes of cache headers, bounding what a killed daemon forgets.
pub const FLUSH_INTERVAL: Duration = Duration::from_secs(2);

/// How to run the filesystem.
#[derive(Clone, Debug)]
pub struct FsConfig {
    /// The source directory.
    pub source: PathBuf,
    /// The cache directory on scratch.
    pub cache_dir: PathBuf,
    /// Cache capacity in bytes.
    pub cache_size: u64,
    /// Worker pool sizing.
    pub fetch: FetchConfig,
    /// Stage the whole tree in the background when it fits.
    pub stage: bool,
    /// Cross-file prefetch depth (0 disables).
    pub cross_file: usize,
    /// Side S of images in `.npy/` views.
    pub image_size: u32,
    /// A corrupt image fails view reads with EIO instead of reading as zeros.
    pub strict_views: bool,
}

/// Type of a node, as the kernel needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Named pipe.
    Fifo,
    /// Socket.
    Socket,
    /// Character device.
    CharDevice,
    /// Block device.
    BlockDevice,
}

/// Attributes of a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attr {
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// 512-byte blocks allocated (as the source reports).
    pub blocks: u64,
    /// Last access.
    pub atime: SystemTime,
    /// Last modification.
    pub mtime: SystemTime,
    /// Last status change.
    pub ctime: SystemTime,
    /// Type.
    pub kind: Kind,
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

/// One directory entry.
#[derive(Clone, Debug)]
pub struct DirEntry {
    /// Inode number.
    pub ino: u64,
    /// Type.
    pub kind: Kind,
    /// Name.
    pub name: OsString,
}

/// What an open answers.
#[derive(Debug)]
pub struct Opened {
    /// The handle for later reads.
    pub fh: u64,
    /// Keep the kernel's page cache from earlier opens (contents unchanged).
    pub keep_cache: bool,
    /// Bypass the page cache (virtual files whose size is not known up front).
    pub direct_io: bool,
    /// A fully cached file the kernel may read directly (passthrough).
    pub passthrough: Option<fs::File>,
}

enum Handle {
    Source {
        rel: Arc<Path>,
        sig: Signature,
        ra: Mutex<ReadAhead>,
        memo: BlockMemo,
        pinned: bool,
    },
    Bytes(Vec<u8>),
    View(Arc<OpenView>),
}

/// The filesystem.
pub struct FsCore {
    cfg: FsConfig,
    inodes: InodeTable,
    fetcher: Fetcher,
    store: Arc<CacheStore>,
    stats: Arc<Stats>,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    seen: Mutex<HashMap<u64, Signature>>,
    started: Instant,
    stop: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Dropped at shutdown, which ends the cross-file thread so it can be joined.
    cross_file: Mutex<Option<SyncSender<PathBuf>>>,
    /// Owner and mtime of the source root, given to virtual nodes (read once: no stat per
    /// virtual entry on the readdir path of `.npy/`).
    root_attr: (SystemTime, u32, u32),
    views: Mutex<Option<Arc<Views>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl FsCore {
    /// Opens the cache and starts the fetch workers, the header flusher, cross-file prefetch
    /// and (if configured) background staging.
    pub fn new(cfg: FsConfig) -> Result<Arc<FsCore>, FsError> {
        let meta = fs::metadata(&cfg.source)?;
        if !meta.is_dir() {
            return Err(FsError::NotDir);
        }
        let stats = Arc::new(Stats::default());
        let store = Arc::new(
            CacheStore::open(
                &StoreConfig {
                    dir: cfg.cache_dir.clone(),
                    capacity: cfg.cache_size,
                },
                stats.clone(),
            )
            .map_err(|e| FsError::Io(std::io::Error::other(e.to_string())))?,
        );
        let source = Arc::new(LocalSource::new(cfg.source.clone())?);
        let fetcher = Fetcher::new(store.clone(), source, stats.clone(), cfg.fetch.clone())?;
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let (tx, rx) = sync_channel::<PathBuf>(CROSS_FILE_QUEUE);
        {
            let fetcher = fetcher.clone();
            let listings = Listings::new(cfg.source.clone());
            let root = cfg.source.clone();
            let count = cfg.cross_file;
            threads.push(
                std::thread::Builder::new()
                    .name("stagefs-xfile".into())
                    .spawn(move || {
                        // Ends when the core (the sender) is dropped.
                        for rel in rx {
                            for next in listings.next_files(&rel, count) {
                                let Ok(meta) = fs::symlink_metadata(root.join(&next)) else {
                                    continue;
                                };
                                if !meta.is_file() || meta.len() > SMALL_FILE {
                                    continue;
                                }
                                let sig = Signature::of(&meta);
                                let next: Arc<Path> = next.into();
                                fetcher.prefetch(
                                    &next,
                                    sig,
                                    0..block_count(sig.size),
                                    Priority::ReadAhead,
                                );
                            }
                        }
                    })?,
            );
        }
        {
            let store = store.clone();
            let stop = stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("stagefs-flush".into())
                    .spawn(move || {
                        // Short sleeps so shutdown is prompt; a flush every FLUSH_INTERVAL.
                        let mut last = Instant::now();
                        while !stop.load(Relaxed) {
                            std::thread::sleep(Duration::from_millis(100));
                            if last.elapsed() >= FLUSH_INTERVAL && !stop.load(Relaxed) {
                                let _ = store.flush();
                                last = Instant::now();
                            }
                        }
                    })?,
            );
        }
        if cfg.stage {
            threads.push(stagefs_prefetch::staging::spawn(
                fetcher.clone(),
                cfg.source.clone(),
                store.capacity(),
                stop.clone(),
            )?);
        }
        Ok(Arc::new(FsCore {
            cross_file: Mutex::new((cfg.cross_file > 0).then_some(tx)),
            root_attr: (
                time(meta.mtime(), meta.mtime_nsec()),
                meta.uid(),
                meta.gid(),
            ),
            views: Mutex::new(None),
            cfg,
            inodes: InodeTable::default(),
            fetcher,
            store,
            stats,
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            seen: Mutex::new(HashMap::new()),
            started: Instant::now(),
            stop,
            threads: Mutex::new(threads),
        }))
    }

    /// Stops background work and writes the cache headers; call after the session ends.
    pub fn shutdown(&self) {
        self.stop.store(true, Relaxed);
        self.fetcher.shutdown();
        if let Err(e) = self.store.flush() {
            warn!(error = %e, "could not write the cache index at unmount");
        }
        lock(&self.cross_file).take();
        let threads: Vec<_> = lock(&self.threads).drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }

    /// The live counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// The cache store.
    pub fn store(&self) -> &Arc<CacheStore> {
        &self.store
    }

    /// A snapshot of the statistics with occupancy and identity filled in.
    pub fn snapshot(&self) -> StatsSnapshot {
        let mut s = self.stats.snapshot(self.started);
        s.cache_used = self.store.used();
        s.cache_capacity = self.store.capacity();
        s.pid = std::process::id();
        s.cache_dir = self.cfg.cache_dir.display().to_string();
        s.source = self.cfg.source.display().to_string();
        s
    }

    /// The `.npy/` views, scanning the source on first use.
    fn views(&self) -> Result<Arc<Views>, FsError> {
        let mut slot = lock(&self.views);
        if let Some(v) = slot.as_ref() {
            return Ok(v.clone());
        }
        let v = Views::new(
            &self.cfg.source,
            self.fetcher.clone(),
            self.cfg.image_size,
            self.cfg.strict_views,
        )?;
        *slot = Some(v.clone());
        Ok(v)
    }

    fn view_attr(&self, ino: u64, kind: ViewKind) -> Attr {
        match kind {
            ViewKind::Dir => self.virtual_attr(ino, Kind::Dir, 0),
            ViewKind::File(len) => self.virtual_attr(ino, Kind::File, len),
        }
    }

    fn view_node(&self, rel: PathBuf, kind: ViewKind) -> Attr {
        let node = match kind {
            ViewKind::Dir => Node::ViewDir(rel),
            ViewKind::File(_) => Node::ViewFile(rel),
        };
        self.view_attr(self.inodes.ino(node), kind)
    }

    fn node(&self, ino: u64) -> Result<Node, FsError> {
        self.inodes.get(ino).ok_or(FsError::BadHandle)
    }

    fn source_path(&self, rel: &Path) -> PathBuf {
        self.cfg.source.join(rel)
    }

    fn source_attr(&self, ino: u64, meta: &Metadata) -> Attr {
        let ft = meta.file_type();
        let kind = if ft.is_dir() {
            Kind::Dir
        } else if ft.is_symlink() {
            Kind::Symlink
        } else if ft.is_fifo() {
            Kind::Fifo
        } else if ft.is_socket() {
            Kind::Socket
        } else if ft.is_char_device() {
            Kind::CharDevice
        } else if ft.is_block_device() {
            Kind::BlockDevice
        } else {
            Kind::File
        };
        Attr {
            ino,
            size: meta.size(),
            blocks: meta.blocks(),
            atime: time(meta.atime(), meta.atime_nsec()),
            mtime: time(meta.mtime(), meta.mtime_nsec()),
            ctime: time(meta.ctime(), meta.ctime_nsec()),
            kind,
            perm: (meta.mode() & 0o7777) as u16,
            nlink: meta.nlink() as u32,
            uid: meta.uid(),
            gid: meta.gid(),
            rdev: meta.rdev() as u32,
        }
    }

    fn virtual_attr(&self, ino: u64, kind: Kind, size: u64) -> Attr {
        let (t, uid, gid) = self.root_attr;
        Attr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: t,
            mtime: t,
            ctime: t,
            kind,
            perm: if kind == Kind::Dir { 0o555 } else { 0o444 },
            nlink: if kind == Kind::Dir { 2 } else { 1 },
            uid,
            gid,
            rdev: 0,
        }
    }

    /// Attributes of `ino`.
    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        match self.node(ino)? {
            Node::Source(rel) => {
                let meta = fs::symlink_metadata(self.source_path(&rel)).map_err(not_found)?;
                Ok(self.source_attr(ino, &meta))
            }
            Node::ControlDir => Ok(self.virtual_attr(ino, Kind::Dir, 0)),
            Node::Stats => Ok(self.virtual_attr(ino, Kind::File, self.stats_json().len() as u64)),
            Node::ViewDir(rel) if rel.as_os_str().is_empty() => {
                Ok(self.virtual_attr(ino, Kind::Dir, 0))
            }
            Node::ViewDir(rel) | Node::ViewFile(rel) => {
                Ok(self.view_attr(ino, self.views()?.stat(&rel)?))
            }
        }
    }

    /// Looks up `name` in directory `parent`.
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, FsError> {
        match self.node(parent)? {
            Node::Source(rel) => {
                if rel.as_os_str().is_empty() && name == CONTROL_DIR {
                    let ino = self.inodes.ino(Node::ControlDir);
                    return self.getattr(ino);
                }
                if rel.as_os_str().is_empty() && name == VIEW_DIR {
                    let ino = self.inodes.ino(Node::ViewDir(PathBuf::new()));
                    return Ok(self.virtual_attr(ino, Kind::Dir, 0));
                }
                let child = rel.join(name);
                let meta = fs::symlink_metadata(self.source_path(&child)).map_err(not_found)?;
                let ino = self.inodes.ino(Node::Source(child));
                Ok(self.source_attr(ino, &meta))
            }
            Node::ControlDir if name == STATS_FILE => self.getattr(self.inodes.ino(Node::Stats)),
            Node::ControlDir => Err(FsError::NotFound),
            Node::Stats | Node::ViewFile(_) => Err(FsError::NotDir),
            Node::ViewDir(rel) => {
                let child = rel.join(name);
                let kind = self.views()?.stat(&child)?;
                Ok(self.view_node(child, kind))
            }
        }
    }

    /// The entries of directory `ino` (without `.` and `..`), in name order.
    pub fn readdir(&self, ino: u64) -> Result<Vec<DirEntry>, FsError> {
        match self.node(ino)? {
            Node::Source(rel) => {
                let mut out = Vec::new();
                if rel.as_os_str().is_empty() {
                    out.push(DirEntry {
                        ino: self.inodes.ino(Node::ControlDir),
                        kind: Kind::Dir,
                        name: CONTROL_DIR.into(),
                    });
                    out.push(DirEntry {
                        ino: self.inodes.ino(Node::ViewDir(PathBuf::new())),
                        kind: Kind::Dir,
                        name: VIEW_DIR.into(),
                    });
                }
                let dir = fs::read_dir(self.source_path(&rel)).map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => FsError::NotFound,
                    _ if e.raw_os_error() == Some(libc::ENOTDIR) => FsError::NotDir,
                    _ => FsError::Io(e),
                })?;
                let mut entries: Vec<_> = dir.flatten().collect();
                entries.sort_by_key(|e| e.file_name());
                for e in entries {
                    let name = e.file_name();
                    if rel.as_os_str().is_empty() && (name == CONTROL_DIR || name == VIEW_DIR) {
                        continue;
                    }
                    let kind = match e.file_type() {
                        Ok(t) if t.is_dir() => Kind::Dir,
                        Ok(t) if t.is_symlink() => Kind::Symlink,
                        Ok(t) if t.is_fifo() => Kind::Fifo,
                        Ok(t) if t.is_socket() => Kind::Socket,
                        Ok(t) if t.is_char_device() => Kind::CharDevice,
                        Ok(t) if t.is_block_device() => Kind::BlockDevice,
                        _ => Kind::File,
                    };
                    let ino = self.inodes.ino(Node::Source(rel.join(&name)));
                    out.push(DirEntry { ino, kind, name });
                }
                Ok(out)
            }
            Node::ControlDir => Ok(vec![DirEntry {
                ino: self.inodes.ino(Node::Stats),
                kind: Kind::File,
                name: STATS_FILE.into(),
            }]),
            Node::Stats | Node::ViewFile(_) => Err(FsError::NotDir),
            Node::ViewDir(rel) => {
                let views = self.views()?;
                let mut out = Vec::new();
                for (name, kind) in views.read_dir(&rel)? {
                    let attr = self.view_node(rel.join(&name), kind);
                    out.push(DirEntry {
                        ino: attr.ino,
                        kind: attr.kind,
                        name,
                    });
                }
                Ok(out)
            }
        }
    }

    /// The target of symlink `ino`, exactly as stored (never resolved).
    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>, FsError> {
        match self.node(ino)? {
            Node::Source(rel) => {
                let target =
                    fs::read_link(self.source_path(&rel)).map_err(|e| match e.raw_os_error() {
                        Some(libc::EINVAL) => FsError::NotSymlink,
                        _ => not_found(e),
                    })?;
                Ok(target.as_os_str().as_bytes().to_vec())
            }
            _ => Err(FsError::NotSymlink),
        }
    }

    /// Opens `ino` for reading; `write` (any write access) fails with EROFS. With
    /// `passthrough`, a fully cached file comes back ready for kernel passthrough.
    pub fn open(&self, ino: u64, write: bool, passthrough: bool) -> Result<Opened, FsError> {
        if write {
            return Err(FsError::ReadOnly);
        }
        let (handle, keep_cache, direct_io, pt) = match self.node(ino)? {
            Node::Source(rel) => {
                let meta = fs::symlink_metadata(self.source_path(&rel)).map_err(not_found)?;
                if meta.is_dir() {
                    return Err(FsError::IsDir);
                }
                let sig = Signature::of(&meta);
                let unchanged = lock(&self.seen)
                    .insert(ino, sig)
                    .is_none_or(|old| old == sig);
                if !unchanged {
                    self.store.invalidate(&rel);
                }
                let pt = if passthrough && sig.size > 0 {
                    self.store.pin_complete(&rel, sig)
                } else {
                    None
                };
                if pt.is_some() {
                    self.stats.passthrough_opens.fetch_add(1, Relaxed);
                }
                if let Some(tx) = lock(&self.cross_file).as_ref() {
                    if sig.size <= SMALL_FILE {
                        // Full queue: drop; the next open asks again.
                        if let Err(TrySendError::Disconnected(_)) = tx.try_send(rel.clone()) {
                            warn!("cross-file prefetch thread is gone");
                        }
                    }
                }
                let rel: Arc<Path> = rel.into();
                let h = Handle::Source {
                    rel,
                    sig,
                    ra: Mutex::new(ReadAhead::default()),
                    memo: Mutex::new(None),
                    pinned: pt.is_some(),
                };
                (h, unchanged, false, pt)
            }
            Node::Stats => (
                Handle::Bytes(self.stats_json().into_bytes()),
                false,
                true,
                None,
            ),
            Node::ControlDir | Node::ViewDir(_) => return Err(FsError::IsDir),
            // Views are immutable for the life of the mount: keep the kernel's pages.
            Node::ViewFile(rel) => (Handle::View(self.views()?.open(&rel)?), true, false, None),
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

    /// Reads up to `size` bytes at `offset` through handle `fh`.
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>, FsError> {
        let handle = lock(&self.handles)
            .get(&fh)
            .cloned()
            .ok_or(FsError::BadHandle)?;
        match &*handle {
            Handle::Source {
                rel, sig, ra, memo, ..
            } => {
                self.stats.reads.fetch_add(1, Relaxed);
                if let Some(ahead) = lock(ra).on_read(offset, u64::from(size), sig.size) {
                    self.fetcher.prefetch_bytes(rel, *sig, ahead);
                }
                let data = self
                    .fetcher
                    .read_with_memo(rel, *sig, offset, size as usize, Some(memo))
                    .map_err(|e| {
                        let e = FsError::from(e);
                        if !matches!(e, FsError::Stale(_)) {
                            self.stats.error(e.to_string());
                        }
                        e
                    })?;
                Ok(data)
            }
            Handle::View(v) => {
                let views = self.views()?;
                Ok(views.read(v, offset, size as usize).inspect_err(|e| {
                    let msg = format!("view read failed: {e}");
                    if !self.stats.has_error(&msg) {
                        warn!("{msg}");
                        self.stats.error(msg);
                    }
                })?)
            }
            Handle::Bytes(bytes) => {
                let start = (offset as usize).min(bytes.len());
                let end = start.saturating_add(size as usize).min(bytes.len());
                Ok(bytes[start..end].to_vec())
            }
        }
    }

    /// Releases handle `fh`.
    pub fn release(&self, fh: u64) {
        if let Some(h) = lock(&self.handles).remove(&fh) {
            if let Handle::Source {
                rel, pinned: true, ..
            } = &*h
            {
                self.store.unpin(rel);
            }
        }
    }

    /// The stats file's contents.
    pub fn stats_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(&self.snapshot())
            .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
        s.push('\n');
        s
    }

    /// The source directory.
    pub fn source(&self) -> &Path {
        &self.cfg.source
    }

    /// The root inode number.
    pub fn root(&self) -> u64 {
        ROOT
    }
}

fn not_found(e: std::io::Error) -> FsError {
    match e.kind() {
        std::io::ErrorKind::NotFound => FsError::NotFound,
        _ if e.raw_os_error() == Some(libc::ENOTDIR) => FsError::NotFound,
        _ => FsError::Io(e),
    }
}

fn time(secs: i64, nsecs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nsecs as u32)
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs()) + Duration::from_nanos(nsecs as u64)
    }
}

/// Logs a one-line summary at unmount.
pub fn log_summary(core: &FsCore) {
    let s = core.snapshot();
    info!(
        from_cache = s.bytes_from_cache,
        from_source = s.bytes_from_source,
        hit_ratio = s.hit_ratio,
        staged = s.bytes_staged,
        "unmounted"
    );
}
