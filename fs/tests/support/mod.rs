//! Shared by the core tests: a source that counts (and can slow or fail) every operation, and
//! helpers to drive an `FsCore` like the kernel would.
#![allow(dead_code, missing_docs, clippy::unwrap_used)]

pub use stagefs_test_support::pattern;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use stagefs_fs::fscore::Attr;
use stagefs_fs::{FsConfig, FsCore, FsError};
use stagefs_prefetch::source::DirName;
use stagefs_prefetch::{FetchConfig, LocalSource, Meta, Source, SourceError, Version};

/// A [`LocalSource`] that counts every operation and can be slowed or made to fail.
pub struct Counting {
    pub inner: LocalSource,
    pub stats: AtomicUsize,
    pub lists: AtomicUsize,
    pub links: AtomicUsize,
    pub reads: AtomicUsize,
    pub meta_delay_ms: AtomicU64,
    pub fail_reads: AtomicBool,
}

impl Counting {
    pub fn new(root: &Path) -> Arc<Counting> {
        Arc::new(Counting {
            inner: LocalSource::new(root).unwrap(),
            stats: AtomicUsize::new(0),
            lists: AtomicUsize::new(0),
            links: AtomicUsize::new(0),
            reads: AtomicUsize::new(0),
            meta_delay_ms: AtomicU64::new(0),
            fail_reads: AtomicBool::new(false),
        })
    }

    /// Metadata requests made so far.
    pub fn metadata_calls(&self) -> usize {
        self.stats.load(SeqCst) + self.lists.load(SeqCst) + self.links.load(SeqCst)
    }

    fn delay(&self) {
        let ms = self.meta_delay_ms.load(SeqCst);
        if ms > 0 {
            std::thread::sleep(Duration::from_millis(ms));
        }
    }
}

impl Source for Counting {
    fn stat(&self, rel: &Path) -> Result<Meta, SourceError> {
        self.stats.fetch_add(1, SeqCst);
        self.delay();
        self.inner.stat(rel)
    }
    fn read_dir(&self, rel: &Path) -> Result<Vec<DirName>, SourceError> {
        self.lists.fetch_add(1, SeqCst);
        self.delay();
        self.inner.read_dir(rel)
    }
    fn readlink(&self, rel: &Path) -> Result<Vec<u8>, SourceError> {
        self.links.fetch_add(1, SeqCst);
        self.inner.readlink(rel)
    }
    fn read_at(&self, rel: &Path, v: Version, off: u64, len: usize) -> Result<Bytes, SourceError> {
        self.reads.fetch_add(1, SeqCst);
        if self.fail_reads.load(SeqCst) {
            return Err(SourceError::Io {
                path: rel.to_path_buf(),
                source: std::io::Error::from_raw_os_error(libc::EIO),
            });
        }
        self.inner.read_at(rel, v, off, len)
    }
}

pub fn config(src: &Path, cache: &Path) -> FsConfig {
    // Small and quick: a 256 MiB cache, 4 workers, no staging, 32-pixel views.
    FsConfig {
        cache_size: 256 << 20,
        fetch: FetchConfig {
            workers: 4,
            max_queued: 256,
            read_timeout: Duration::from_secs(30),
        },
        stage: false,
        cross_file: 4,
        image_size: 32,
        scan_threads: 8,
        ..FsConfig::new(std::fs::canonicalize(src).unwrap(), cache.to_path_buf())
    }
}

pub fn mount(cfg: FsConfig) -> (Arc<FsCore>, Arc<Counting>) {
    let src = Counting::new(&cfg.source);
    let core = FsCore::with_source(cfg, src.clone()).unwrap();
    (core, src)
}

/// Looks `rel` up component by component, as the kernel does.
pub fn lookup(core: &FsCore, rel: &Path) -> Result<Attr, FsError> {
    let mut attr = core.getattr(core.root())?;
    for c in rel.iter() {
        attr = core.lookup(attr.ino, c)?;
    }
    Ok(attr)
}

/// Reads `len` bytes at `off` of `rel` through open/read/release, in requests of `chunk`.
pub fn read(core: &FsCore, rel: &Path, off: u64, len: u64, chunk: u32) -> Result<Vec<u8>, FsError> {
    read_as(core, rel, off, len, chunk, true)
}

/// [`read`], with the daemon's open (`open`) or without, as a normal user's mount reads once
/// opens are skipped: by inode, with file handle 0 and no release.
pub fn read_as(
    core: &FsCore,
    rel: &Path,
    off: u64,
    len: u64,
    chunk: u32,
    open: bool,
) -> Result<Vec<u8>, FsError> {
    let a = lookup(core, rel)?;
    let fh = if open {
        core.open(a.ino, false, false)?.fh
    } else {
        0
    };
    let mut out = Vec::new();
    let mut at = off;
    let r = loop {
        if at >= off + len {
            break Ok(());
        }
        let want = chunk.min((off + len - at) as u32);
        match core.read(a.ino, fh, at, want) {
            Ok(d) if d.as_ref().is_empty() => break Ok(()),
            Ok(d) => {
                out.extend_from_slice(d.as_ref());
                at += d.as_ref().len() as u64;
            }
            Err(e) => break Err(e),
        }
    };
    if open {
        core.release(fh);
    }
    r.map(|()| out)
}

/// Names in directory `rel` (without `.` and `..`), through readdir in chunks of `n`.
pub fn names(core: &FsCore, rel: &Path, n: usize) -> Result<Vec<std::ffi::OsString>, FsError> {
    let a = lookup(core, rel)?;
    let mut out = Vec::new();
    let mut offset = 0;
    loop {
        let mut got = 0;
        core.readdir(a.ino, offset, |e| {
            offset = e.offset;
            if e.name != OsStr::new(".") && e.name != OsStr::new("..") {
                out.push(e.name.to_os_string());
            }
            got += 1;
            got == n
        })?;
        if got < n {
            return Ok(out);
        }
    }
}

pub fn rel(p: &str) -> PathBuf {
    PathBuf::from(p)
}
