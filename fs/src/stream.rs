//! Pushing large files into the kernel's page cache ahead of sequential readers.
//!
//! A normal user's mount gets 128 KiB of kernel read-ahead, so a reader streaming a large file
//! costs eight requests per cache block (a round trip, a daemon wake-up and a reply each). Once
//! a large file's blocks are cached, the daemon can instead hand whole blocks to the kernel as
//! page-cache contents (`FUSE_NOTIFY_STORE`, allowed unprivileged): the reader then finds them
//! in the page cache and sends no request until it reaches the end of what was pushed. Its
//! next request is at that end, which continues the stream and pushes the next window — one
//! round trip per [`PUSH_AHEAD`] instead of eight per MiB, and the copying moves to the pusher
//! threads, beside the reader instead of in its way.
//!
//! A read continues a stream when it starts where the last request ended or where the last
//! push ended (within [`SEEK_TOLERANCE`]); any other read (shuffled readers, `mmap` faults in
//! random order) pushes nothing. Only cached blocks are pushed, read and checksummed as for a
//! reader (a corrupt block is dropped, never pushed); the first block that is not cached ends
//! the push (the reader's request fetches it as usual). Pushes are hints: a full queue drops
//! them, and a reader overtaking the pusher simply gets its pages by request (the blocks it
//! has asked for are then skipped, not copied twice).
//!
//! Pushing ahead is a lever, off unless the mount asks for it (`--push-ahead`): on the 2-core
//! VM it lost to plain requests with caches dropped (0.24–0.28× a local copy against 0.28–0.34×
//! for 1 MiB reads in order, 0.27–0.32× against 0.39–0.44× for shuffled 1–4 MiB pieces;
//! docs/mount.md#large-files): a reader of 1 MiB chunks has all eight requests of a block queued
//! before a push lands, every core is busy copying, and each block raced for is copied twice.
//! It halves the requests of a reader of 128 KiB chunks, at the same speed there.
//!
//! Readers that do not stream (`mmap` faults in random order) get the rest of each block they
//! touch: answering a 128 KiB request reads and verifies the whole 1 MiB block,
//! and its other pages are pushed from memory ([`Push::Bytes`], [`rest_of_block`]) instead of
//! costing seven more round trips — and, once the block is no longer remembered, seven more
//! reads of it from scratch.
//!
//! [`PUSH_AHEAD`] is 16 MiB: at a local copy's ~1–2 GB/s that is ~10 ms of reading per round
//! trip, far more than the round trip costs, and 8 readers × 16 MiB is a modest page-cache
//! footprint. [`PUSHERS`] threads: two, so one reader's push never waits for another's.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use bytes::Bytes;
use stagefs_prefetch::{EntryId, BLOCK_SIZE};

/// Bytes pushed ahead of a streaming reader per round trip.
pub const PUSH_AHEAD: u64 = 16 << 20;
/// How far a read may start from where the stream stands and still continue it.
pub const SEEK_TOLERANCE: u64 = 256 << 10;
/// Pusher threads.
pub const PUSHERS: usize = 2;
/// Pushes waiting for a thread; more are dropped (readers then request as usual). A queued
/// [`Push::Bytes`] holds at most a block (1 MiB), so the queue holds at most 64 MiB.
pub(crate) const QUEUE: usize = 64;

/// Where one file's stream stands.
#[derive(Debug, Default)]
pub struct Stream {
    /// End of the last request.
    last_end: u64,
    /// End of what was pushed (0: nothing yet).
    pushed_to: u64,
    /// Whether the last request continued a stream.
    streaming: bool,
}

impl Stream {
    /// Records a request for `offset..end` of a file of `size` bytes; the block range to push,
    /// if the request continues a stream.
    pub fn on_read(&mut self, offset: u64, end: u64, size: u64) -> Option<std::ops::Range<u64>> {
        let near = |at: u64| offset.abs_diff(at) <= SEEK_TOLERANCE;
        let streaming = near(self.last_end) || (self.pushed_to > 0 && near(self.pushed_to));
        self.last_end = end;
        self.streaming = streaming;
        if !streaming {
            self.pushed_to = 0;
            return None;
        }
        // Whole blocks after the one being served (which the kernel is reading already).
        let from = self.pushed_to.max(end).div_ceil(BLOCK_SIZE);
        let to = end
            .saturating_add(PUSH_AHEAD)
            .min(size)
            .div_ceil(BLOCK_SIZE);
        if from >= to {
            return None;
        }
        self.pushed_to = (to * BLOCK_SIZE).min(size);
        Some(from..to)
    }
}

impl Stream {
    /// Whether the last request continued a stream: the kernel's read-ahead is then asking
    /// for the pages around it by itself, and pushing the rest of its block would copy them
    /// twice.
    pub fn streaming(&self) -> bool {
        self.streaming
    }
}

/// One push.
pub(crate) enum Push {
    /// Cached blocks `blocks` of cache entry `entry` (a file of `size` bytes), as pages of
    /// inode `ino`: the pusher reads and verifies them.
    Blocks {
        ino: u64,
        entry: EntryId,
        size: u64,
        blocks: std::ops::Range<u64>,
        /// Where the reader's requests have got to: blocks before it are skipped (the reader
        /// asked for them, a push would copy them a second time).
        read_to: Option<Arc<AtomicU64>>,
    },
    /// Verified bytes a reader's request brought into memory already (the rest of a block it
    /// read), as the pages of inode `ino` at `offset`.
    Bytes { ino: u64, offset: u64, data: Bytes },
}

/// The pages of a block of `len` bytes that a request for `served` (offsets in the block) did
/// not cover: whole pages only (a partial page would not become readable).
pub fn rest_of_block(len: usize, served: std::ops::Range<usize>) -> [std::ops::Range<usize>; 2] {
    use stagefs_prefetch::store::scratch::{aligned, ALIGN};
    let before = served.start - served.start % ALIGN as usize;
    // The block's end counts as a page end (the file's last, partial page).
    let after = (aligned(served.end as u64) as usize).min(len);
    [0..before, after..len]
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    #[test]
    fn a_sequential_reader_gets_windows_and_a_random_one_nothing() {
        let size = 100 * MB;
        let mut s = Stream::default();
        // First request at 0: push the blocks after it.
        assert_eq!(s.on_read(0, 128 << 10, size), Some(1..17));
        // The reader reads the pushed pages without requests; its next request is at the end
        // of the push, which continues the stream.
        assert_eq!(
            s.on_read(17 * MB, 17 * MB + (128 << 10), size),
            Some(18..34)
        );
        // A jump elsewhere ends the stream.
        assert_eq!(s.on_read(60 * MB, 61 * MB, size), None);
        assert_eq!(s.on_read(5 * MB, 6 * MB, size), None);
        // Reading on from the jump starts a new stream; the end of the file bounds it.
        assert_eq!(s.on_read(6 * MB, 7 * MB, size), Some(7..23));
        assert_eq!(s.on_read(90 * MB, 91 * MB, size), None);
        assert_eq!(s.on_read(91 * MB, 92 * MB, size), Some(92..100));
        assert_eq!(
            s.on_read(92 * MB, 93 * MB, size),
            None,
            "all pushed already"
        );
    }

    #[test]
    fn the_rest_of_a_block_is_whole_pages_around_the_request() {
        let b = MB as usize;
        assert_eq!(rest_of_block(b, 0..131072), [0..0, 131072..b]);
        assert_eq!(rest_of_block(b, 262144..393216), [0..262144, 393216..b]);
        // Unaligned requests keep their partial pages out of the push.
        assert_eq!(rest_of_block(b, 5000..9000), [0..4096, 12288..b]);
        // A short last block: its partial last page is pushed.
        assert_eq!(rest_of_block(10_000, 0..4096), [0..0, 4096..10_000]);
        assert_eq!(rest_of_block(b, 0..b), [0..0, b..b]);
    }
}
