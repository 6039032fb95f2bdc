//! The thin fuser adapter: translates kernel requests into [`FsCore`] calls and results into
//! replies. All errno mapping lives in [`FsError::errno`]; all behaviour lives in the core.
//!
//! Passthrough: when the kernel grants `FUSE_PASSTHROUGH` (root, kernel ≥ 6.9), fully cached
//! files are opened with a backing file so the kernel reads scratch directly. One backing id is
//! kept per inode while any handle uses it, as the kernel requires; if registering a backing file
//! fails, passthrough is switched off for the rest of the mount and reads go through the daemon.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fuser::{
    BackingId, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, Request,
};
use tracing::{info, warn};

use crate::core::{Attr, FsCore, Kind};
use crate::error::FsError;

/// How long the kernel may cache attributes and entries: short, so a source file changed while
/// mounted shows its new size within a second; long enough to absorb `stat` storms.
pub const TTL: Duration = Duration::from_secs(1);
/// Kernel read-ahead asked for: 1 MiB, one cache block per request.
pub const MAX_READAHEAD: u32 = 1 << 20;

/// The fuser filesystem over a [`FsCore`].
pub struct FuseFs {
    core: Arc<FsCore>,
    passthrough: AtomicBool,
    backing: Mutex<HashMap<u64, (Arc<BackingId>, usize)>>,
    fh_ino: Mutex<HashMap<u64, u64>>,
}

impl FuseFs {
    /// An adapter over `core`; `passthrough` asks the kernel for FUSE passthrough.
    pub fn new(core: Arc<FsCore>, passthrough: bool) -> FuseFs {
        FuseFs {
            core,
            passthrough: AtomicBool::new(passthrough),
            backing: Mutex::new(HashMap::new()),
            fh_ino: Mutex::new(HashMap::new()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs a core call, turning a panic into `EIO` for this request: a bug triggered by one file
/// must not take down the mount for every other reader.
fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, FsError>) -> Result<T, FsError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        tracing::error!(request = what, "internal error (panic) answered with EIO");
        Err(FsError::Io(std::io::Error::from_raw_os_error(libc::EIO)))
    })
}

fn errno(e: &FsError) -> fuser::Errno {
    fuser::Errno::from_i32(e.errno())
}

fn file_type(kind: Kind) -> FileType {
    match kind {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::CharDevice => FileType::CharDevice,
        Kind::BlockDevice => FileType::BlockDevice,
    }
}

fn attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: a.atime,
        mtime: a.mtime,
        ctime: a.ctime,
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

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_readahead(MAX_READAHEAD);
        if self.passthrough.load(Relaxed) {
            let granted = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            self.passthrough.store(granted, Relaxed);
            info!(granted, "FUSE passthrough for fully cached files");
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match guard("lookup", || self.core.lookup(parent.0, name)) {
            Ok(a) => reply.entry(&TTL, &attr(&a), Generation(0)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match guard("getattr", || self.core.getattr(ino.0)) {
            Ok(a) => reply.attr(&TTL, &attr(&a)),
            Err(e) => reply.error(errno(&e)),
        }
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
        let opened = match guard("open", || self.core.open(ino.0, write, passthrough)) {
            Ok(o) => o,
            Err(e) => return reply.error(errno(&e)),
        };
        let mut fopen = FopenFlags::empty();
        if opened.keep_cache {
            fopen |= FopenFlags::FOPEN_KEEP_CACHE;
        }
        if opened.direct_io {
            fopen |= FopenFlags::FOPEN_DIRECT_IO;
        }
        let fh = opened.fh;
        if let Some(file) = opened.passthrough {
            // Lock order: `backing` is never held while taking `fh_ino` (and vice versa); the
            // guard lives only for this block.
            let id = {
                let mut backing = lock(&self.backing);
                match backing.get_mut(&ino.0) {
                    Some((id, users)) => {
                        *users += 1;
                        Some(id.clone())
                    }
                    None => match reply.open_backing(&file) {
                        Ok(id) => {
                            let id = Arc::new(id);
                            backing.insert(ino.0, (id.clone(), 1));
                            Some(id)
                        }
                        Err(e) => {
                            warn!(error = %e, "passthrough unavailable; serving cached files through the daemon");
                            self.passthrough.store(false, Relaxed);
                            None
                        }
                    },
                }
            };
            if let Some(id) = id {
                lock(&self.fh_ino).insert(fh, ino.0);
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
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match guard("read", || self.core.read(fh.0, offset, size)) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(errno(&e)),
        }
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
        // Bound first so the `fh_ino` guard is dropped before `backing` is locked: an `if let`
        // on the guard's expression would hold it for the whole block and deadlock with open().
        let passthrough_ino = lock(&self.fh_ino).remove(&fh.0);
        if let Some(ino) = passthrough_ino {
            let mut backing = lock(&self.backing);
            if let Some((_, users)) = backing.get_mut(&ino) {
                *users -= 1;
                if *users == 0 {
                    backing.remove(&ino);
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
        // Read-only: nothing to write back on close.
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.core.getattr(ino.0) {
            Ok(a) if a.kind == Kind::Dir => reply.opened(FileHandle(0), FopenFlags::empty()),
            Ok(_) => reply.error(errno(&FsError::NotDir)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let entries = match guard("readdir", || self.core.readdir(ino.0)) {
            Ok(e) => e,
            Err(e) => return reply.error(errno(&e)),
        };
        // Offsets: 1 = ".", 2 = "..", 3.. = entries; the kernel resumes after the last offset.
        let parent = ino.0;
        let dots = [
            (1u64, parent, FileType::Directory, OsStr::new(".")),
            (2, parent, FileType::Directory, OsStr::new("..")),
        ];
        for (off, ino, kind, name) in dots {
            if off > offset && reply.add(INodeNo(ino), off, kind, name) {
                return reply.ok();
            }
        }
        for (i, e) in entries.iter().enumerate() {
            let off = i as u64 + 3;
            if off > offset && reply.add(INodeNo(e.ino), off, file_type(e.kind), &e.name) {
                break;
            }
        }
        reply.ok();
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
        match self.core.getattr(ino.0) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }
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
