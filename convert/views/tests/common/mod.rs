//! Shared by the table tests: a source that counts the read requests made of it, so a test
//! proves what a read costs by counting, not timing.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use stagefs_views::{ByteSource, DirSource, SourceEntry};

/// A [`DirSource`] that counts the reads asked of it.
pub struct Counting {
    inner: DirSource,
    reads: AtomicU64,
}

impl Counting {
    /// A counting source over the directory `dir`.
    pub fn new(dir: &Path) -> Self {
        Counting {
            inner: DirSource::new(dir),
            reads: AtomicU64::new(0),
        }
    }

    /// Read requests so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
}

impl ByteSource for Counting {
    fn len(&self, rel: &Path) -> io::Result<u64> {
        self.inner.len(rel)
    }
    fn read_at(&self, rel: &Path, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.read_at(rel, offset, buf)
    }
    fn read_at_append(
        &self,
        rel: &Path,
        offset: u64,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> io::Result<usize> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.read_at_append(rel, offset, len, buf)
    }
    fn list_dir(&self, rel: &Path) -> io::Result<Vec<SourceEntry>> {
        self.inner.list_dir(rel)
    }
}
