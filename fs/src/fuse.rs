//! The thin fuser adapter: translates kernel requests into [`FsCore`] calls and results into
//! replies. All errno mapping lives in [`FsError::errno`]; all behaviour lives in the core.
//!
//! Round trips per file are what a many-small-file epoch pays for, as a normal user (no
//! passthrough, no io_uring). So: entries and attributes are cached by the kernel for the life
//! of the mount (snapshot semantics; the `--revalidate` interval otherwise); listings come with
//! attributes (`readdirplus`), so `ls -l`, `find` and a DataLoader's first walk need no lookup
//! per file; symlink targets are cached; `opendir` and `flush` answer `ENOSYS` once, after
//! which the kernel stops sending them; reads of up to 1 MiB are allowed (`FUSE_MAX_PAGES`),
//! and each is answered with a slice of a cached block.
//!
//! Requests that may render a view (anything under `.npy/`) run on the view pool
//! ([`crate::offload`]) with their reply, so a slow render never holds a FUSE thread.
//!
//! Passthrough: when the kernel grants `FUSE_PASSTHROUGH` (root, kernel ≥ 6.9), fully cached,
//! verified large files are opened with a backing file so the kernel reads scratch directly.
//! One backing id per inode is shared by its open handles ([`BackingCache`], one lock); if
//! registering a backing file fails, passthrough is switched off for the rest of the mount.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use fuser::{
    BackingId, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, Request,
};
use stagefs_prefetch::locks;
use stagefs_prefetch::FileKind;
use tracing::{info, warn};

use crate::error::FsError;
use crate::fscore::{Attr, FsCore};
use crate::offload::Offload;
use stagefs_prefetch::locks::lock;

/// Kernel read-ahead asked for: 1 MiB, one cache block per request (the kernel caps it at what
/// it offers: 128 KiB for most mounts unless an admin raises the bdi's read_ahead_kb).
pub const MAX_READAHEAD: u32 = 1 << 20;

/// Background (read-ahead) requests the kernel may have in flight to the daemon: a few per FUSE
/// thread; congestion is declared at 3/4 of it.
pub const MAX_BACKGROUND: u16 = 64;

/// How many lookups of each source inode the kernel holds (entries it was handed by `lookup`
/// and `readdirplus`, minus what it forgot). A page pushed into an inode the kernel does not
/// hold is dropped on the floor, so the walker pushes only to inodes counted here: a reader
/// that listed the directory (ImageFolder does) gets pushes, one that opens paths from a list
/// costs no pushing. 4 bytes per file.
/// View files (virtual inodes, numbered from 2^40) are counted in a map: read-order hints push
/// rendered view rows ([`crate::hints`]), and there are only as many as views looked up.
#[derive(Default)]
pub struct Lookups {
    counts: std::sync::RwLock<Vec<std::sync::atomic::AtomicU32>>,
    views: std::sync::Mutex<HashMap<u64, u64>>,
}

impl Lookups {
    fn slot(ino: u64) -> Option<usize> {
        (ino > crate::inode::ROOT_INO && ino < crate::inode::VIRTUAL_BASE).then_some(ino as usize)
    }

    /// The kernel was handed one more lookup of `ino`.
    pub fn add(&self, ino: u64) {
        let Some(i) = Self::slot(ino) else {
            if ino >= crate::inode::VIRTUAL_BASE {
                *lock(&self.views).entry(ino).or_default() += 1;
            }
            return;
        };
        {
            let c = locks::read(&self.counts);
            if let Some(n) = c.get(i) {
                n.fetch_add(1, Relaxed);
                return;
            }
        }
        let mut c = locks::write(&self.counts);
        let want = (i + 1).next_power_of_two();
        while c.len() < want {
            c.push(std::sync::atomic::AtomicU32::new(0));
        }
        c[i].fetch_add(1, Relaxed);
    }

    /// The kernel forgot `n` lookups of `ino`.
    pub fn forget(&self, ino: u64, n: u64) {
        let Some(i) = Self::slot(ino) else {
            let mut views = lock(&self.views);
            if let Some(k) = views.get_mut(&ino) {
                *k = k.saturating_sub(n);
                if *k == 0 {
                    views.remove(&ino);
                }
            }
            return;
        };
        let c = locks::read(&self.counts);
        if let Some(k) = c.get(i) {
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            let _ = k.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(n)));
        }
    }

    /// Whether the kernel holds inode `ino`.
    pub fn held(&self, ino: u64) -> bool {
        if ino >= crate::inode::VIRTUAL_BASE {
            return lock(&self.views).contains_key(&ino);
        }
        let c = locks::read(&self.counts);
        Self::slot(ino)
            .and_then(|i| c.get(i))
            .is_some_and(|k| k.load(Relaxed) > 0)
    }
}

/// Backing files registered for passthrough: one id per inode, shared by its handles.
#[derive(Default)]
///
/// The kernel keeps one I/O mode per inode: while any handle of an inode is open through the
/// page cache, a passthrough open of it fails (EIO to the reader), and the reverse. So an inode
/// with a live backing id gets passthrough for every new open (even before its entry is verified
/// for this open), and one with handles open through the daemon gets none until they close.
pub struct BackingCache {
    by_fh: HashMap<u64, Arc<BackingId>>,
    by_ino: HashMap<u64, Weak<BackingId>>,
    /// Handles open through the daemon (page-cache mode) per inode, while passthrough is on.
    cached: HashMap<u64, u32>,
    /// Their inodes, by handle.
    cached_fh: HashMap<u64, u64>,
}

/// The fuser filesystem over a [`FsCore`].
pub struct FuseFs {
    core: Arc<FsCore>,
    passthrough: AtomicBool,
    skip_open: bool,
    readdirplus: bool,
    lookups: Arc<Lookups>,
    backing: Mutex<BackingCache>,
    views: Offload,
    direct_io_large: bool,
}

impl FuseFs {
    /// An adapter over `core`; `passthrough` asks the kernel for FUSE passthrough; `skip_open`
    /// answers the first `open` with `ENOSYS`, after which the kernel opens files without
    /// asking (`FUSE_NO_OPEN_SUPPORT`: no open or release round trip per file, and the page
    /// cache kept across opens). Passthrough needs opens, so it wins when granted.
    /// `lookups` counts what the kernel holds (shared with the page pusher). `views` runs the
    /// requests that may render.
    pub fn new(
        core: Arc<FsCore>,
        passthrough: bool,
        skip_open: bool,
        readdirplus: bool,
        lookups: Arc<Lookups>,
        views: Offload,
    ) -> FuseFs {
        FuseFs {
            core,
            passthrough: AtomicBool::new(passthrough),
            skip_open,
            readdirplus,
            lookups,
            backing: Mutex::new(BackingCache::default()),
            views,
            direct_io_large: false,
        }
    }

    /// Opens large source files for direct I/O: each read is one request of the reader's size
    /// (up to 1 MiB), answered straight into the reader's buffer, no page cache on the mount.
    pub fn set_direct_io_large(&mut self, on: bool) {
        self.direct_io_large = on;
    }
}

/// Runs a core call, turning a panic into `EIO` for this request: a bug triggered by one file
/// must not take down the mount for every other reader.
fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, FsError>) -> Result<T, FsError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        tracing::error!(request = what, "internal error (panic) answered with EIO");
        Err(FsError::Internal)
    })
}

fn errno(e: &FsError) -> fuser::Errno {
    fuser::Errno::from_i32(e.errno())
}

fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::File => FileType::RegularFile,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
    }
}

fn attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind: file_type(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: 1 << 20,
        flags: 0,
    }
}

/// The stats file changes as counters grow: its attributes are never cached, and each look
/// at them shows a new mtime, which makes the kernel drop its pages (`FUSE_AUTO_INVAL_DATA`).
fn changing(core: &FsCore, a: &Attr) -> bool {
    a.ino == core.stats_ino()
}

fn reply_lookup(core: &FsCore, lookups: &Lookups, parent: u64, name: &OsStr, reply: ReplyEntry) {
    match guard("lookup", || core.lookup(parent, name)) {
        Ok(a) if changing(core, &a) => reply.entry(&Duration::ZERO, &attr(&a), Generation(0)),
        Ok(a) => {
            lookups.add(a.ino);
            reply.entry(&core.ttl(), &attr(&a), Generation(0))
        }
        Err(e) => reply.error(errno(&e)),
    }
}

fn reply_getattr(core: &FsCore, ino: u64, reply: ReplyAttr) {
    match guard("getattr", || core.getattr(ino)) {
        Ok(a) if changing(core, &a) => reply.attr(&Duration::ZERO, &attr(&a)),
        Ok(a) => reply.attr(&core.ttl(), &attr(&a)),
        Err(e) => reply.error(errno(&e)),
    }
}

fn reply_read(core: &FsCore, ino: u64, fh: u64, offset: u64, size: u32, reply: ReplyData) {
    match guard("read", || core.read(ino, fh, offset, size)) {
        Ok(data) => reply.data(data.as_ref()),
        Err(e) => reply.error(errno(&e)),
    }
}

fn reply_readdir(core: &FsCore, ino: u64, offset: u64, mut reply: ReplyDirectory) {
    let r = guard("readdir", || {
        core.readdir(ino, offset, |e| {
            reply.add(INodeNo(e.ino), e.offset, file_type(e.kind), e.name)
        })
    });
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(&e)),
    }
}

fn reply_readdirplus(
    core: &FsCore,
    lookups: &Lookups,
    ino: u64,
    offset: u64,
    mut reply: ReplyDirectoryPlus,
) {
    let ttl = core.ttl();
    let r = guard("readdirplus", || {
        core.readdir(ino, offset, |e| {
            // `.` and `..` carry no entry the kernel could cache (their attributes are
            // not looked up by name).
            let full = reply.add(
                INodeNo(e.ino),
                e.offset,
                e.name,
                &ttl,
                &attr(&e.attr),
                Generation(0),
            );
            // The kernel counts a lookup for every entry but `.` and `..`.
            if !full && e.name != "." && e.name != ".." {
                lookups.add(e.ino);
            }
            full
        })
    });
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(&e)),
    }
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(max) = config.set_max_readahead(MAX_READAHEAD) {
            let _ = config.set_max_readahead(max);
        }
        // Kernel read-ahead of small files arrives as background requests: 8 readers each with
        // a request or two in flight exceed fuser's default of 16 (the kernel then makes
        // readers wait for a slot, not for the daemon).
        let _ = config.set_max_background(MAX_BACKGROUND);
        // Each is an optimisation the kernel may not offer: take what it has.
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // Pages are dropped when a file's mtime changes: only the stats file's ever does
        // (under --revalidate, a source file's too, which is then what is wanted).
        let _ = config.add_capabilities(InitFlags::FUSE_AUTO_INVAL_DATA);
        let _ = config.add_capabilities(InitFlags::FUSE_CACHE_SYMLINKS);
        // mmap keeps working on files opened for direct I/O (kernel >= 6.6).
        let _ = config.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP);
        if self.readdirplus {
            let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS);
            let _ = config.add_capabilities(InitFlags::FUSE_READDIRPLUS_AUTO);
        }
        if self.passthrough.load(Relaxed) {
            let granted = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            self.passthrough.store(granted, Relaxed);
            info!(granted, "FUSE passthrough for fully cached files");
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if self.core.may_render(parent.0, Some(name)) {
            let (core, lookups, name) = (self.core.clone(), self.lookups.clone(), name.to_owned());
            return self
                .views
                .run(move || reply_lookup(&core, &lookups, parent.0, &name, reply));
        }
        reply_lookup(&self.core, &self.lookups, parent.0, name, reply)
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.lookups.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if self.core.may_render(ino.0, None) {
            let core = self.core.clone();
            return self.views.run(move || reply_getattr(&core, ino.0, reply));
        }
        reply_getattr(&self.core, ino.0, reply)
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match guard("readlink", || self.core.readlink(ino.0)) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let write = !matches!(flags.acc_mode(), OpenAccMode::O_RDONLY)
            || flags.0 & (libc::O_TRUNC | libc::O_APPEND) != 0;
        let passthrough = self.passthrough.load(Relaxed);
        if self.skip_open && !passthrough && !write {
            // Reads then arrive without a handle; the core serves them by inode.
            return reply.error(fuser::Errno::ENOSYS);
        }
        if self.core.may_render(ino.0, None) {
            // A view: no passthrough, and opening it may need its size.
            let core = self.core.clone();
            return self.views.run(move || {
                match guard("open", || core.open(ino.0, write, false)) {
                    Ok(o) => reply.opened(FileHandle(o.fh), open_flags(&o)),
                    Err(e) => reply.error(errno(&e)),
                }
            });
        }
        let opened = match guard("open", || self.core.open(ino.0, write, passthrough)) {
            Ok(o) => o,
            Err(e) => return reply.error(errno(&e)),
        };
        let mut fopen = open_flags(&opened);
        if self.direct_io_large
            && opened.passthrough.is_none()
            && self
                .core
                .getattr(ino.0)
                .is_ok_and(|a| crate::files::is_large(a.size))
        {
            fopen = FopenFlags::FOPEN_DIRECT_IO;
        }
        let fh = opened.fh;
        if passthrough {
            // One decision per open under one lock: the inode's I/O mode (see BackingCache).
            let id = {
                let mut b = lock(&self.backing);
                let shared = b.by_ino.get(&ino.0).and_then(Weak::upgrade);
                let cached_open = b.cached.get(&ino.0).is_some_and(|n| *n > 0);
                let id = match (shared, opened.passthrough, cached_open) {
                    (Some(id), _, _) => Some(id),
                    (None, Some(file), false) => match reply.open_backing(&file) {
                        Ok(id) => {
                            let id = Arc::new(id);
                            b.by_ino.insert(ino.0, Arc::downgrade(&id));
                            Some(id)
                        }
                        Err(e) => {
                            warn!(error = %e, "passthrough unavailable; serving cached files through the daemon");
                            self.passthrough.store(false, Relaxed);
                            None
                        }
                    },
                    _ => None,
                };
                match &id {
                    Some(id) => {
                        b.by_fh.insert(fh, id.clone());
                    }
                    None => {
                        *b.cached.entry(ino.0).or_default() += 1;
                        b.cached_fh.insert(fh, ino.0);
                    }
                }
                id
            };
            if let Some(id) = id {
                // The kernel refuses (EIO) passthrough opens carrying any flag outside its mask,
                // FOPEN_KEEP_CACHE included: the page cache is the backing file's here.
                return reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id);
            }
        }
        reply.opened(FileHandle(fh), fopen);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if self.core.may_render(ino.0, None) {
            let core = self.core.clone();
            return self
                .views
                .run(move || reply_read(&core, ino.0, fh.0, offset, size, reply));
        }
        reply_read(&self.core, ino.0, fh.0, offset, size, reply)
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        {
            let mut b = lock(&self.backing);
            if let Some(ino) = b.cached_fh.remove(&fh.0) {
                if let Some(n) = b.cached.get_mut(&ino) {
                    *n -= 1;
                    if *n == 0 {
                        b.cached.remove(&ino);
                    }
                }
            }
            if let Some(id) = b.by_fh.remove(&fh.0) {
                if Arc::strong_count(&id) == 1 {
                    b.by_ino.retain(|_, w| {
                        w.strong_count() > 0 && !Weak::ptr_eq(w, &Arc::downgrade(&id))
                    });
                }
            }
        }
        self.core.release(fh.0);
        reply.ok();
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Read-only: nothing to write back on close. ENOSYS makes the kernel stop sending
        // flush at every close (one round trip fewer per file).
        reply.error(fuser::Errno::ENOSYS);
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // Directories need no handle: ENOSYS makes the kernel skip opendir/releasedir from now
        // on (FUSE_NO_OPENDIR_SUPPORT); listings are served from the snapshot by inode.
        reply.error(fuser::Errno::ENOSYS);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        if self.core.may_render(ino.0, None) {
            let core = self.core.clone();
            return self
                .views
                .run(move || reply_readdir(&core, ino.0, offset, reply));
        }
        reply_readdir(&self.core, ino.0, offset, reply)
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        if self.core.may_render(ino.0, None) {
            let (core, lookups) = (self.core.clone(), self.lookups.clone());
            return self
                .views
                .run(move || reply_readdirplus(&core, &lookups, ino.0, offset, reply));
        }
        reply_readdirplus(&self.core, &self.lookups, ino.0, offset, reply)
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match source_statvfs(&self.core) {
            Some(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                s.f_namemax as u32,
                s.f_frsize as u32,
            ),
            None => reply.statfs(0, 0, 0, 0, 0, 4096, 255, 4096),
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, mask: fuser::AccessFlags, reply: ReplyEmpty) {
        if mask.bits() & libc::W_OK != 0 {
            return reply.error(errno(&FsError::ReadOnly));
        }
        let access =
            move |core: &FsCore, reply: ReplyEmpty| match guard("access", || core.getattr(ino.0)) {
                Ok(_) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            };
        if self.core.may_render(ino.0, None) {
            let core = self.core.clone();
            return self.views.run(move || access(&core, reply));
        }
        access(&self.core, reply)
    }
}

fn open_flags(o: &crate::fscore::Opened) -> FopenFlags {
    let mut fopen = FopenFlags::empty();
    if o.keep_cache {
        fopen |= FopenFlags::FOPEN_KEEP_CACHE;
    }
    if o.direct_io {
        fopen |= FopenFlags::FOPEN_DIRECT_IO;
    }
    fopen
}

/// The source filesystem's statvfs, so `df` on the mount shows the dataset's filesystem.
fn source_statvfs(core: &FsCore) -> Option<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(core.source().as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain old data; all-zero is a valid value.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid C string and `s` a struct we own.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut s) };
    (rc == 0).then_some(s)
}
