//! Cutting input files into work units, each one thread's job and one output row group.
//!
//! CSV: one reader thread reads each file sequentially and cuts it after the last newline
//! outside quotes in every chunk of about `chunk` bytes (quote parity counted with a
//! vectorised byte count, [`record_boundary`]); a record that does not end within the
//! record share of the budget fails the run, naming its line. Buffers are reused through a
//! [`BufferPool`]. Parquet: a row group, or row slices of one when the footer says it is
//! larger than `chunk` uncompressed, never slices smaller than [`MIN_SLICE_ROWS`].

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::{count_lines_before, human_bytes, io_err, Input};
use crate::CleanError;

/// Where a unit's bytes or rows are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Span {
    /// CSV bytes `[offset, offset + len)`; `header` when the range starts with the header line.
    Csv {
        /// Byte offset in the file.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// Whether the first record is the header.
        header: bool,
    },
    /// Rows `[skip, skip + take)` of Parquet row group `rg`.
    Parquet {
        /// Row group.
        rg: usize,
        /// Rows skipped at its start.
        skip: usize,
        /// Rows read.
        take: usize,
        /// Approximate uncompressed bytes, for progress.
        bytes: u64,
    },
}

impl Span {
    /// Bytes this unit stands for, for progress.
    pub fn bytes(&self) -> u64 {
        match self {
            Span::Csv { len, .. } => *len,
            Span::Parquet { bytes, .. } => *bytes,
        }
    }
}

/// Rows of a Parquet unit at least (when a row group is cut into slices): a slice smaller
/// than this costs more in per-unit overhead than it saves in memory.
const MIN_SLICE_ROWS: usize = 16 * 1024;

/// Splits a Parquet file into units of at most about `chunk` uncompressed bytes. The size is
/// the footer's claim, used only to choose the number of slices, which is bounded by the row
/// count (a footer claiming 9e18 bytes gets slices of [`MIN_SLICE_ROWS`], not one per row).
pub fn parquet_spans(input: &Input, chunk: u64) -> Vec<Span> {
    let Some(meta) = &input.parquet else {
        return Vec::new();
    };
    let mut spans = Vec::new();
    for (rg, g) in meta.metadata().row_groups().iter().enumerate() {
        let rows = usize::try_from(g.num_rows()).unwrap_or(0);
        if rows == 0 {
            continue;
        }
        let bytes = u64::try_from(g.total_byte_size()).unwrap_or(0).max(1);
        let max_pieces = rows.div_ceil(MIN_SLICE_ROWS).max(1);
        let pieces = usize::try_from(bytes.div_ceil(chunk.max(1)))
            .unwrap_or(usize::MAX)
            .clamp(1, max_pieces);
        let per = rows.div_ceil(pieces);
        let mut skip = 0;
        while skip < rows {
            let take = per.min(rows - skip);
            spans.push(Span::Parquet {
                rg,
                skip,
                take,
                bytes: bytes / pieces as u64,
            });
            skip += take;
        }
    }
    spans
}

/// A CSV record that does not end within `max_record` bytes: the error names the file and
/// the line the record starts on.
fn record_too_long(path: &Path, offset: u64, max_record: usize) -> CleanError {
    let line = match count_lines_before(path, offset) {
        Ok(n) => (n + 1).to_string(),
        Err(_) => "?".into(),
    };
    CleanError::Data(format!(
        "{}: line {line}: a record starts here that does not end within {} (the limit is 1/8 \
         of --memory-budget); usually a stray '\"' has opened a quoted field that runs to the \
         end of the file. Fix the file, or raise --memory-budget if a record really is that long",
        path.display(),
        human_bytes(max_record as u64)
    ))
}

/// Cuts a CSV file into record-aligned ranges of about `chunk` bytes, reading it once,
/// sequentially. Calls `emit(span, bytes)` for each range in order. A record longer than
/// `max_record` bytes fails the run (naming file and line) instead of growing the buffer.
pub fn csv_chunks(
    path: &Path,
    chunk: usize,
    max_record: usize,
    pool: &BufferPool,
    mut emit: impl FnMut(Span, Vec<u8>) -> Result<(), CleanError>,
) -> Result<(), CleanError> {
    let mut file = File::open(path).map_err(|e| io_err(path, e))?;
    let size = file.metadata().map_err(|e| io_err(path, e))?.len();
    let mut carry: Vec<u8> = Vec::new();
    let mut offset = 0u64;
    let mut header = true;
    let chunk = chunk.clamp(1, max_record.max(1));
    let mut want = chunk;
    let mut eof = false;
    let mut emit_at = |offset: u64, header: bool, buf: Vec<u8>| {
        let len = buf.len() as u64;
        emit(
            Span::Csv {
                offset,
                len,
                header,
            },
            buf,
        )
    };
    loop {
        let left = usize::try_from(size.saturating_sub(offset)).unwrap_or(usize::MAX);
        let mut buf = pool.get(want.min(left).max(carry.len()) + 1)?;
        buf.append(&mut carry);
        if buf.len() < want && !eof {
            // `read_to_end` fills spare capacity without zeroing it first.
            let need = (want - buf.len()) as u64;
            let n = (&mut file)
                .take(need)
                .read_to_end(&mut buf)
                .map_err(|e| io_err(path, e))?;
            eof = (n as u64) < need;
        }
        if eof {
            if !buf.is_empty() {
                emit_at(offset, header, buf)?;
            }
            return Ok(());
        }
        match record_boundary(&buf) {
            Some(cut) => {
                carry = buf.split_off(cut);
                let len = buf.len() as u64;
                emit_at(offset, header, buf)?;
                offset += len;
                header = false;
                want = chunk;
            }
            None if buf.len() > max_record => {
                return Err(record_too_long(path, offset, max_record));
            }
            None => {
                // One record longer than the chunk: read more before cutting, up to the cap
                // (one byte past it, to tell "exactly the cap" from "longer").
                carry = buf;
                want = want.saturating_mul(2).min(max_record.saturating_add(1));
            }
        }
    }
}

/// Position just after the last newline that is outside quotes, if any. Chunks always start
/// outside quotes, so the parity of the quotes before a newline says whether it is inside a
/// quoted field; the quotes are counted once (a loop LLVM vectorises), then only those after
/// each candidate newline, walking back from the end.
fn record_boundary(buf: &[u8]) -> Option<usize> {
    let mut quotes_before_end = count_byte(buf, b'"');
    let mut end = buf.len();
    while let Some(nl) = memchr::memrchr(b'\n', &buf[..end]) {
        quotes_before_end -= count_byte(&buf[nl..end], b'"');
        if quotes_before_end.is_multiple_of(2) {
            return Some(nl + 1);
        }
        end = nl;
    }
    None
}

/// Occurrences of `b` in `buf`. Counted in 32-byte lanes of `u8` counters, flushed before
/// they can overflow, which LLVM turns into vector compares and subtracts (a plain
/// `filter().count()` widens every byte to a `usize` and runs several times slower; this runs
/// on the single reader thread, for every byte of the input).
fn count_byte(buf: &[u8], b: u8) -> usize {
    const LANES: usize = 32;
    let mut total = 0usize;
    let mut blocks = buf.chunks_exact(LANES);
    loop {
        let mut acc = [0u8; LANES];
        let mut n = 0;
        for block in blocks.by_ref().take(255) {
            for (a, &x) in acc.iter_mut().zip(block) {
                *a += u8::from(x == b);
            }
            n += 1;
        }
        total += acc.iter().map(|&a| a as usize).sum::<usize>();
        if n < 255 {
            break;
        }
    }
    total + blocks.remainder().iter().filter(|&&x| x == b).count()
}

/// Buffers for CSV units, handed back after decoding and reused: a fresh multi-MB `Vec` is a
/// fresh `mmap` whose every page faults and is zeroed by the kernel before `read` fills it —
/// measured at ~8% of a run's time — while a reused one is already mapped.
#[derive(Default)]
pub struct BufferPool {
    free: std::sync::Mutex<Vec<Vec<u8>>>,
}

/// Buffers kept by a [`BufferPool`]: more than the units in flight is never needed.
const POOL_MAX: usize = 64;

impl BufferPool {
    /// An empty buffer with room for at least `cap` bytes (fallible: no abort on a huge size).
    pub fn get(&self, cap: usize) -> Result<Vec<u8>, CleanError> {
        let mut v = self
            .free
            .lock()
            .ok()
            .and_then(|mut f| f.pop())
            .unwrap_or_default();
        v.clear();
        v.try_reserve(cap)
            .map_err(|_| CleanError::Data(format!("cannot allocate {cap} bytes")))?;
        Ok(v)
    }

    /// Hands a buffer back for reuse.
    pub fn put(&self, v: Vec<u8>) {
        if let Ok(mut f) = self.free.lock() {
            if f.len() < POOL_MAX {
                f.push(v);
            }
        }
    }
}

/// Reads a CSV span's bytes again (pass 2 of a standardize run).
pub fn read_span(path: &Path, offset: u64, len: u64) -> Result<Vec<u8>, CleanError> {
    let file = File::open(path).map_err(|e| io_err(path, e))?;
    let len = usize::try_from(len).map_err(|_| CleanError::Data("span too large".into()))?;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, offset)
        .map_err(|e| io_err(path, e))?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_byte_matches_a_plain_count_across_flushes() {
        // Lengths around the 255-block flush of the u8 counters, all bytes equal (worst case).
        for len in [
            0,
            1,
            31,
            32,
            33,
            255 * 32 - 1,
            255 * 32,
            255 * 32 + 1,
            3 * 255 * 32 + 7,
        ] {
            let all = vec![b'"'; len];
            assert_eq!(count_byte(&all, b'"'), len);
            let mixed: Vec<u8> = (0..len)
                .map(|i| if i % 3 == 0 { b'"' } else { b'x' })
                .collect();
            assert_eq!(
                count_byte(&mixed, b'"'),
                mixed.iter().filter(|&&b| b == b'"').count()
            );
        }
    }

    #[test]
    fn boundary_skips_quoted_newlines() {
        let buf = b"a,b\n1,\"x\ny\"\n2,\"p\nq";
        // The last newline is inside an open quote; the one before it is inside quotes too.
        assert_eq!(record_boundary(buf), Some(12));
        assert_eq!(record_boundary(b"no newline"), None);
    }
}
