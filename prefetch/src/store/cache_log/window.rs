//! The read window: the cache log read front to back through one reused buffer.
//!
//! Reading the whole log at once (157 MB for 1.28 M files) cost a remount ~0.3 s of CPU in
//! first-touch page faults alone, and as much again in peak memory; replay and compaction at
//! close both read it through this window instead.

use std::fs::File;
use std::io;

use crate::source::read_full_at;

/// Bytes of the log read at a time during replay, through one reused buffer: the whole log
/// read at once (157 MB for 1.28 M files) cost a remount ~0.3 s of CPU in first-touch page
/// faults alone, and as much again in peak memory.
const LOG_WINDOW: usize = 4 << 20;

/// The longest record the format can hold (a `u16` body length, its prefix and CRC): a
/// window refills before fewer bytes than this are left, so a record is never cut.
const MAX_RECORD: usize = 2 + u16::MAX as usize + 4;

/// The first `len` bytes of the cache log, read in order through a window of
/// [`LOG_WINDOW`] bytes.
pub(super) struct LogWindow<'f> {
    file: &'f File,
    pub(super) len: u64,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    base: u64,
    /// Next unread byte of `buf`.
    pos: usize,
    /// End of valid bytes in `buf`.
    end: usize,
}

impl<'f> LogWindow<'f> {
    pub(super) fn new(file: &'f File, len: u64) -> Self {
        LogWindow {
            file,
            len,
            buf: vec![0; LOG_WINDOW],
            base: 0,
            pos: 0,
            end: 0,
        }
    }

    /// The unread bytes, refilled first so that at least [`MAX_RECORD`] of them are there
    /// unless the log ends sooner; empty at the end.
    pub(super) fn rest(&mut self) -> io::Result<&[u8]> {
        let file_end = self.base + self.end as u64;
        if self.end - self.pos < MAX_RECORD && file_end < self.len {
            self.buf.copy_within(self.pos..self.end, 0);
            self.base += self.pos as u64;
            self.end -= self.pos;
            self.pos = 0;
            let want = (self.buf.len() - self.end).min((self.len - file_end) as usize);
            let got = read_full_at(
                self.file,
                &mut self.buf[self.end..self.end + want],
                file_end,
            )?;
            if got < want {
                // The log ended sooner than its length said (truncated meanwhile): it ends here.
                self.len = file_end + got as u64;
            }
            self.end += got;
        }
        Ok(&self.buf[self.pos..self.end])
    }

    /// File offset of the next unread byte.
    pub(super) fn at(&self) -> u64 {
        self.base + self.pos as u64
    }

    pub(super) fn advance(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.end);
    }

    /// Moves to file offset `at` (forward only: the window refills from there if `at` is not
    /// buffered).
    pub(super) fn seek_forward(&mut self, at: u64) {
        let end = self.base + self.end as u64;
        if at <= end && at >= self.at() {
            self.pos = (at - self.base) as usize;
        } else if at > end {
            self.base = at.min(self.len);
            self.pos = 0;
            self.end = 0;
        }
    }
}
