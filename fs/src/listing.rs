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
    /// The window `[start, end)` of file indexes already handed out for prefetch: a reader walking the
    /// directory then costs one hand-out per [`Listings::next_files`] window, not one per file
    /// (each hand-out stats those files on the slow source).
    queued: Mutex<(usize, usize)>,
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

    /// Up to `count` regular files that follow `rel` in its directory and were not handed out
    /// before, as relative paths. Refills in half-windows, so prefetch stays ahead of the reader.
    pub fn next_files(&self, rel: &Path, count: usize) -> Vec<PathBuf> {
        let (Some(dir), Some(name)) = (rel.parent(), rel.file_name()) else {
            return Vec::new();
        };
        let Some(listing) = self.listing(dir) else {
            return Vec::new();
        };
        let pos = match listing.files.binary_search_by(|n| n.as_os_str().cmp(name)) {
            Ok(i) => i + 1,
            Err(i) => i,
        };
        let end = (pos + count).min(listing.files.len());
        let mut queued = listing.queued.lock().unwrap_or_else(|p| p.into_inner());
        let inside = queued.0 <= pos && pos <= queued.1;
        // More than half a window already queued ahead of this reader: nothing to do.
        if inside && queued.1.saturating_sub(pos) > count / 2 {
            return Vec::new();
        }
        let start = if inside { queued.1.max(pos) } else { pos };
        *queued = (if inside { queued.0 } else { pos }, end.max(start));
        listing.files[start.min(end)..end]
            .iter()
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
        let l = Arc::new(Listing {
            mtime,
            files,
            queued: Mutex::new((0, 0)),
        });
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .put(dir.to_path_buf(), l.clone());
        Some(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walking_a_directory_hands_out_each_file_once_in_half_window_refills() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("d")).unwrap();
        for i in 0..100 {
            std::fs::write(tmp.path().join(format!("d/{i:03}")), b"x").unwrap();
        }
        let l = Listings::new(tmp.path().to_path_buf());
        let mut handed = Vec::new();
        let mut calls = 0;
        for i in 0..100 {
            let got = l.next_files(Path::new(&format!("d/{i:03}")), 8);
            calls += usize::from(!got.is_empty());
            handed.extend(got);
        }
        let expected: Vec<PathBuf> = (1..100)
            .map(|i| PathBuf::from(format!("d/{i:03}")))
            .collect();
        assert_eq!(
            handed, expected,
            "every following file exactly once, in order"
        );
        assert!(calls <= 100 / 3, "refilled {calls} times");
        // Files already handed out are not handed out again.
        assert!(l.next_files(Path::new("d/010"), 2).is_empty());
        // A reader jumping outside the window gets the files after its new position.
        let l = Listings::new(tmp.path().to_path_buf());
        assert_eq!(l.next_files(Path::new("d/000"), 2).len(), 2);
        assert_eq!(
            l.next_files(Path::new("d/050"), 2),
            vec![PathBuf::from("d/051"), PathBuf::from("d/052")]
        );
    }
}
