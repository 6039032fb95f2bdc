//! Directory listings kept for cross-file prefetch: when a reader opens a file, the next files
//! of the same directory (in name order, the order DataLoaders and `ls` walk them) are fetched
//! ahead. Listings are refreshed when the directory's mtime changes.

use std::ffi::OsString;
use std::num::NonZeroUsize;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use lru::LruCache;

/// Directories whose listing is remembered; a listing of 10,000 names is well under 1 MB.
const LISTINGS: usize = 64;

struct Listing {
    mtime: (i64, i64),
    files: Vec<OsString>,
}

/// Cache of sorted regular-file names per directory.
pub struct Listings {
    root: PathBuf,
    cache: Mutex<LruCache<PathBuf, Arc<Listing>>>,
}

impl Listings {
    /// Listings of directories under `root`.
    pub fn new(root: PathBuf) -> Listings {
        let cap = NonZeroUsize::new(LISTINGS).unwrap_or(NonZeroUsize::MIN);
        Listings {
            root,
            cache: Mutex::new(LruCache::new(cap)),
        }
    }

    /// Up to `count` regular files that follow `rel` in its directory, as relative paths.
    pub fn next_files(&self, rel: &Path, count: usize) -> Vec<PathBuf> {
        let (Some(dir), Some(name)) = (rel.parent(), rel.file_name()) else {
            return Vec::new();
        };
        let Some(listing) = self.listing(dir) else {
            return Vec::new();
        };
        let start = match listing.files.binary_search_by(|n| n.as_os_str().cmp(name)) {
            Ok(i) => i + 1,
            Err(i) => i,
        };
        listing
            .files
            .iter()
            .skip(start)
            .take(count)
            .map(|n| dir.join(n))
            .collect()
    }

    fn listing(&self, dir: &Path) -> Option<Arc<Listing>> {
        let meta = std::fs::metadata(self.root.join(dir)).ok()?;
        let mtime = (meta.mtime(), meta.mtime_nsec());
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = cache.get(dir).filter(|l| l.mtime == mtime) {
            return Some(l.clone());
        }
        drop(cache);
        let mut files: Vec<OsString> = std::fs::read_dir(self.root.join(dir))
            .ok()?
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .map(|e| e.file_name())
            .collect();
        files.sort();
        let l = Arc::new(Listing { mtime, files });
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .put(dir.to_path_buf(), l.clone());
        Some(l)
    }
}
