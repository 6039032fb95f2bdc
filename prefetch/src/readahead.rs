//! Per-handle sequential detection with a read-ahead window that grows with the run.
//!
//! Like mountpoint-s3's prefetcher: the window starts at [`INITIAL_WINDOW`] and doubles on each
//! sequential read up to [`MAX_WINDOW`]; a read within [`SEEK_TOLERANCE`] of the expected offset
//! still counts as sequential (readers that skip a header or re-read a little), anything else
//! resets the window. A handle's first read fetches nothing ahead: one read is no pattern yet
//! (a header probe — `.npy`'s, or `file`'s magic sniff — is often all there is), and on a file
//! split between the nodes of a job a guess from offset 0 would read into another node's rows.
//! The second read, if it continues the first, starts the window. The window is per handle;
//! the global bound on memory and in-flight bytes is the fetcher's fixed worker pool and queue.

use std::ops::Range;

/// First window: one cache block, enough to hide the latency of the next request.
pub const INITIAL_WINDOW: u64 = crate::BLOCK_SIZE;
/// Largest window: 64 MiB keeps ~0.3 s of a 200 MB/s source in flight per sequential reader.
pub const MAX_WINDOW: u64 = 64 << 20;
/// A forward or backward jump this small is still a sequential read.
pub const SEEK_TOLERANCE: u64 = 256 << 10;

/// Read-ahead state of one open file handle.
#[derive(Debug, Clone)]
pub struct ReadAhead {
    /// Whether the handle has been read at all.
    started: bool,
    next: u64,
    window: u64,
    prefetched_to: u64,
}

impl Default for ReadAhead {
    fn default() -> Self {
        ReadAhead {
            started: false,
            next: 0,
            window: INITIAL_WINDOW / 2,
            prefetched_to: 0,
        }
    }
}

impl ReadAhead {
    /// Records a read of `len` bytes at `offset` in a file of `size` bytes; returns the byte range
    /// to fetch ahead, if any.
    pub fn on_read(&mut self, offset: u64, len: u64, size: u64) -> Option<Range<u64>> {
        let end = (offset + len).min(size);
        if !self.started {
            self.started = true;
            self.next = end;
            self.prefetched_to = end;
            return None;
        }
        let sequential =
            offset + SEEK_TOLERANCE >= self.next && offset <= self.next + SEEK_TOLERANCE;
        if sequential {
            self.window = (self.window * 2).clamp(INITIAL_WINDOW, MAX_WINDOW);
        } else {
            self.window = INITIAL_WINDOW / 2;
            self.prefetched_to = end;
        }
        self.next = end;
        if !sequential {
            return None;
        }
        let start = self.prefetched_to.max(end);
        let stop = (end + self.window).min(size);
        if start >= stop {
            return None;
        }
        self.prefetched_to = stop;
        Some(start..stop)
    }

    /// The current window in bytes.
    pub fn window(&self) -> u64 {
        self.window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    #[test]
    fn window_grows_on_sequential_reads_and_caps() {
        let mut ra = ReadAhead::default();
        let size = 10_000 * MB;
        let mut off = 0;
        let mut last = 0;
        for _ in 0..20 {
            ra.on_read(off, MB, size);
            assert!(ra.window() >= last);
            last = ra.window();
            off += MB;
        }
        assert_eq!(ra.window(), MAX_WINDOW);
    }

    #[test]
    fn prefetch_ranges_do_not_overlap_and_stay_in_file() {
        let mut ra = ReadAhead::default();
        let size = 5 * MB + 17;
        let mut covered = 0;
        let mut off = 0;
        while off < size {
            if let Some(r) = ra.on_read(off, 128 << 10, size) {
                assert!(r.start >= covered, "overlap: {r:?} after {covered}");
                assert!(r.end <= size);
                covered = r.end;
            }
            off += 128 << 10;
        }
        assert_eq!(covered, size);
    }

    #[test]
    fn random_reads_reset_and_fetch_nothing_ahead() {
        let mut ra = ReadAhead::default();
        let size = 1000 * MB;
        ra.on_read(0, MB, size);
        ra.on_read(MB, MB, size);
        assert_eq!(ra.on_read(500 * MB, 4096, size), None);
        assert_eq!(ra.window(), INITIAL_WINDOW / 2);
        assert_eq!(ra.on_read(100 * MB, 4096, size), None);
    }

    #[test]
    fn a_first_read_alone_fetches_nothing_ahead() {
        let mut ra = ReadAhead::default();
        assert_eq!(ra.on_read(0, 4096, 100 * MB), None);
        assert_eq!(ra.on_read(4096, 4096, 100 * MB), Some(8192..8192 + MB));
    }

    #[test]
    fn small_seeks_are_tolerated() {
        let mut ra = ReadAhead::default();
        let size = 1000 * MB;
        ra.on_read(0, MB, size);
        let w = ra.window();
        assert!(ra.on_read(MB + 4096, MB, size).is_some());
        assert!(ra.window() > w);
    }
}
