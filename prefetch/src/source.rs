//! Where the bytes come from: the source tree, with change detection on every read.
//!
//! Every read names the [`Signature`] (size, mtime) the caller saw at open; the source checks it
//! against `fstat` before and after reading, so a file replaced or rewritten while mounted is
//! reported as [`SourceError::Changed`] instead of being served mixed. Opening a file on a
//! parallel filesystem costs milliseconds, so descriptors are kept in a small LRU.

use std::fs::File;
use std::io;
use std::num::NonZeroUsize;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use lru::LruCache;

use crate::error::SourceError;

/// Open source descriptors kept for reuse: enough for many DataLoader workers' files at once,
/// far below the usual 1024-descriptor soft limit.
const OPEN_FILES: usize = 256;

/// The identity of a source file's contents: size and modification time in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Signature {
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i64,
}

impl Signature {
    /// The signature of a file's metadata.
    pub fn of(meta: &std::fs::Metadata) -> Signature {
        Signature {
            size: meta.size(),
            mtime_ns: meta
                .mtime()
                .saturating_mul(1_000_000_000)
                .saturating_add(meta.mtime_nsec()),
        }
    }
}

/// A readable source tree. Implemented by [`LocalSource`]; tests implement slow or failing ones.
pub trait Source: Send + Sync + 'static {
    /// Reads `buf.len()` bytes at `offset` of `rel`, whose contents must still have `sig`.
    fn read_at(
        &self,
        rel: &Path,
        sig: Signature,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize, SourceError>;
}

/// A directory on a (possibly slow) mounted filesystem.
pub struct LocalSource {
    root: PathBuf,
    open: Mutex<LruCache<PathBuf, Arc<File>>>,
}

impl LocalSource {
    /// A source rooted at `root`.
    pub fn new(root: impl Into<PathBuf>) -> LocalSource {
        let cap = NonZeroUsize::new(OPEN_FILES).unwrap_or(NonZeroUsize::MIN);
        LocalSource {
            root: root.into(),
            open: Mutex::new(LruCache::new(cap)),
        }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn file(&self, rel: &Path) -> Result<Arc<File>, SourceError> {
        if let Some(f) = lock(&self.open).get(rel) {
            return Ok(f.clone());
        }
        let f = File::open(self.root.join(rel)).map_err(|e| io_err(rel, e))?;
        let f = Arc::new(f);
        lock(&self.open).put(rel.to_path_buf(), f.clone());
        Ok(f)
    }

    /// Fails unless `file` still has `sig`; with `by_name`, also unless `rel` still names it.
    fn check(
        &self,
        rel: &Path,
        file: &File,
        sig: Signature,
        by_name: bool,
    ) -> Result<(), SourceError> {
        let meta = file.metadata().map_err(|e| io_err(rel, e))?;
        // A replaced file (new inode under the same name) keeps the old descriptor's metadata, so
        // the name is checked too; once per read, since a stat on a parallel filesystem is slow.
        let replaced = by_name && {
            let named =
                std::fs::symlink_metadata(self.root.join(rel)).map_err(|e| io_err(rel, e))?;
            named.ino() != meta.ino() || named.dev() != meta.dev()
        };
        if Signature::of(&meta) != sig || replaced {
            lock(&self.open).pop(rel);
            return Err(SourceError::Changed {
                path: rel.to_path_buf(),
            });
        }
        Ok(())
    }
}

impl Source for LocalSource {
    fn read_at(
        &self,
        rel: &Path,
        sig: Signature,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize, SourceError> {
        let file = self.file(rel)?;
        self.check(rel, &file, sig, true)?;
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(rel, e)),
            }
        }
        self.check(rel, &file, sig, false)?;
        Ok(done)
    }
}

fn io_err(rel: &Path, e: io::Error) -> SourceError {
    if e.kind() == io::ErrorKind::NotFound {
        SourceError::Gone {
            path: rel.to_path_buf(),
        }
    } else {
        SourceError::Io {
            path: rel.to_path_buf(),
            source: e,
        }
    }
}

/// Locks a mutex, recovering from poisoning: a panicked holder leaves data that is still
/// structurally valid here (caches), and the mount must keep serving.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
