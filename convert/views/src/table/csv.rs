//! CSV tables (with a header line): one pass infers the column types over the whole file (as
//! arrow does with no record limit), a second decodes it in runs of [`BLOCK_ROWS`] records and
//! keeps each run's byte range and the null counts. A block read then decodes just that byte
//! range. Both passes happen once, lazily, when the table is first opened.
//!
//! Wide files: arrow's decoder reserves room for a whole batch (rows × columns field offsets
//! and ~8 bytes per field) before it reads a byte, so a block holds at most
//! [`MAX_BLOCK_FIELDS`] fields: [`block_rows`] narrows blocks as columns grow (10^5 columns
//! give blocks of 10 rows, not 64 Ki rows and a 52 GB reservation). The header is counted
//! (quote-aware, stopping at the limit) before anything is built per column, and a file of
//! more than [`super::MAX_COLUMNS`] columns is refused with a message saying what to do.
//!
//! Long fields: blocks are cut by bytes too. A block's text is held whole twice (by the
//! indexing decoder until the block is flushed, and by a block read, which reads its byte
//! range and decodes it), so 64 Ki records of a 1 MiB text field would be 64 GiB each time.
//! A block of more than one record may span at most [`MAX_BLOCK_BYTES`]; when one grows past
//! that, indexing starts again with blocks of fewer records (at most a sixteenth as many, and
//! no more than the block held when it overflowed), down to blocks of one record, which
//! [`MAX_RECORD_BYTES`] bounds (a field is part of a record, so that is also the per-field
//! bound). Indexing a file of long fields therefore reads it at most five times.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arrow::array::ArrayRef;
use arrow::csv::reader::{Format, ReaderBuilder};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use stagefs_parquet_bounds::HeaderFields;

use super::{BlockReader, ColumnPlan};
use crate::error::ViewError;
use crate::source::{ByteSource, SourceReader};

/// Records per block: 64 Ki rows keep a block's decode around a millisecond per numeric column
/// while the index stays tiny (16 bytes per block).
pub const BLOCK_ROWS: usize = 1 << 16;

/// Fields (rows × columns) one block may hold: the decoder's up-front reservation is about 16
/// bytes per field (an offset and an estimated 8 bytes of text), so 2^20 fields bound it to
/// 16 MiB whatever the width. Tables of up to 16 columns keep full [`BLOCK_ROWS`] blocks.
pub const MAX_BLOCK_FIELDS: usize = 1 << 20;

/// Records per block for a table of `columns` columns: [`BLOCK_ROWS`], narrowed so that a
/// block holds at most [`MAX_BLOCK_FIELDS`] fields, and at least one record.
pub fn block_rows(columns: usize) -> usize {
    (MAX_BLOCK_FIELDS / columns.max(1)).clamp(1, BLOCK_ROWS)
}

/// Bytes read from the source at a time while indexing.
const READ_BYTES: usize = 4 << 20;

/// Longest stretch of input without a complete record (bytes). A stray quote makes the rest
/// of a file one field, which the decoder would buffer whole; past this the table is
/// reported corrupt (EIO for its views) instead of growing the daemon's memory.
pub const MAX_RECORD_BYTES: u64 = 64 << 20;

/// Most bytes of text in a block of more than one record: 64 MiB, so a block read allocates at
/// most this (plus one 4 MiB read of indexing past it) whatever the fields' lengths; honest
/// numeric tables never come near it (64 Ki rows of 16 numbers are ~10 MiB of text).
pub const MAX_BLOCK_BYTES: u64 = 64 << 20;

struct CsvBlocks {
    src: Arc<dyn ByteSource>,
    rel: PathBuf,
    schema: SchemaRef,
    /// Byte range of each block.
    ranges: Vec<(u64, u64)>,
    /// Rows of each block.
    rows: Vec<usize>,
    /// Records per block (the last one may hold fewer).
    block_rows: usize,
    /// The columns that have views (numeric and boolean), increasing: a block is decoded for
    /// all of them at once and kept ([`DecodedBlock`]), since parsing a CSV block costs its
    /// whole text whichever columns are wanted.
    viewed: Vec<usize>,
    last: Mutex<VecDeque<DecodedBlock>>,
}

/// Decoded blocks kept per CSV table: one per thread rendering neighbouring pieces of a file
/// (`convert` renders a file's chunks in parallel), at most 4 × 2^20 values (32 MiB).
const DECODED_BLOCKS: usize = 4;

/// The viewed columns of a decoded block: with 10^4 columns, each column file decoded the
/// block's whole text again (10^4 × the text; minutes for a 3 MB file). A block holds at
/// most [`MAX_BLOCK_FIELDS`] fields, so this keeps at most 2^20 values (8 MiB of numbers).
struct DecodedBlock {
    block: usize,
    arrays: Vec<ArrayRef>,
}

impl CsvBlocks {
    /// Columns `cols` of block `b`, from the last decoded block when it is `b`.
    fn read_cached(&self, b: usize, cols: &[usize]) -> Result<Vec<ArrayRef>, String> {
        let pick = |arrays: &[ArrayRef]| -> Option<Vec<ArrayRef>> {
            cols.iter()
                .map(|c| {
                    let at = self.viewed.binary_search(c).ok()?;
                    arrays.get(at).cloned()
                })
                .collect()
        };
        if let Ok(last) = self.last.lock() {
            if let Some(d) = last.iter().find(|d| d.block == b) {
                if let Some(out) = pick(&d.arrays) {
                    return Ok(out);
                }
            }
        }
        if !cols.iter().all(|c| self.viewed.binary_search(c).is_ok()) {
            return self.read(b, cols);
        }
        let arrays = self.read(b, &self.viewed)?;
        let out = pick(&arrays).ok_or("internal: column not decoded")?;
        if let Ok(mut last) = self.last.lock() {
            if last.len() >= DECODED_BLOCKS {
                last.pop_front();
            }
            last.push_back(DecodedBlock { block: b, arrays });
        }
        Ok(out)
    }

    fn read(&self, b: usize, cols: &[usize]) -> Result<Vec<ArrayRef>, String> {
        let (start, end) = *self.ranges.get(b).ok_or("no such block")?;
        let len = usize::try_from(end - start).map_err(|_| "block too large")?;
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(len)
            .map_err(|_| format!("cannot allocate {len} bytes"))?;
        bytes.resize(len, 0);
        let n = self
            .src
            .read_at(&self.rel, start, &mut bytes)
            .map_err(|e| e.to_string())?;
        if n != bytes.len() {
            return Err("file is shorter than when it was indexed".into());
        }
        let mut dec = ReaderBuilder::new(self.schema.clone())
            .with_header(false)
            .with_batch_size(self.rows[b].max(1))
            .with_projection(cols.to_vec())
            .build_decoder();
        let mut pos = 0;
        loop {
            let used = dec.decode(&bytes[pos..]).map_err(|e| e.to_string())?;
            pos += used;
            if used == 0 || pos == bytes.len() {
                break;
            }
        }
        dec.decode(&[]).map_err(|e| e.to_string())?;
        let batch = dec
            .flush()
            .map_err(|e| e.to_string())?
            .ok_or("block decoded to nothing")?;
        Ok(batch.columns().to_vec())
    }
}

impl BlockReader for CsvBlocks {
    fn meta_bytes(&self) -> usize {
        let fields: usize = self
            .schema
            .fields()
            .iter()
            .map(|f| std::mem::size_of::<Field>() + f.name().len())
            .sum();
        // Decoded blocks are kept, up to DECODED_BLOCKS of them: counted at what they may
        // grow to (values of 8 bytes and their validity bits), not at what is decoded yet.
        let widest = self.rows.iter().copied().max().unwrap_or(0);
        let values = widest
            .saturating_mul(self.viewed.len())
            .min(MAX_BLOCK_FIELDS);
        let kept = DECODED_BLOCKS.min(self.rows.len()) * values * 9;
        fields + self.ranges.len() * 16 + self.rows.len() * 8 + self.viewed.len() * 8 + kept
    }

    fn read_block(&self, b: usize, cols: &[usize]) -> Result<Vec<ArrayRef>, String> {
        match catch_unwind(AssertUnwindSafe(|| self.read_cached(b, cols))) {
            Ok(r) => r.map_err(|e| format!("block {b} (blocks of {} rows): {e}", self.block_rows)),
            Err(_) => Err(format!("CSV decoder panicked on block {b}")),
        }
    }
}

type Opened = (Vec<ColumnPlan>, Vec<u64>, Box<dyn BlockReader>);

/// A reader that fails once a record runs past [`MAX_RECORD_BYTES`]: it tracks the parity of
/// quotes (a doubled quote inside a field keeps it) and the bytes since the last newline seen
/// outside quotes. Type inference reads the whole file through the `csv` crate, which would
/// otherwise buffer a never-closed quoted field whole.
struct RecordGuard<R> {
    inner: R,
    in_quotes: bool,
    since_newline: u64,
}

impl<R> RecordGuard<R> {
    fn new(inner: R) -> Self {
        RecordGuard {
            inner,
            in_quotes: false,
            since_newline: 0,
        }
    }
}

impl<R: std::io::Read> std::io::Read for RecordGuard<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        for &b in &buf[..n] {
            self.since_newline += 1;
            match b {
                b'"' => self.in_quotes = !self.in_quotes,
                b'\n' if !self.in_quotes => self.since_newline = 0,
                _ => {}
            }
        }
        if self.since_newline > MAX_RECORD_BYTES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "a record longer than {} MiB (a stray '\"' opening a field that never \
                     closes?)",
                    MAX_RECORD_BYTES >> 20
                ),
            ));
        }
        Ok(n)
    }
}

/// Opens (infers and indexes) the CSV file at `rel`.
pub(crate) fn open(src: Arc<dyn ByteSource>, rel: &Path) -> Result<Opened, ViewError> {
    match catch_unwind(AssertUnwindSafe(|| open_inner(src.clone(), rel))) {
        Ok(r) => r,
        Err(_) => Err(ViewError::corrupt(rel, "CSV reader panicked on this file")),
    }
}

/// Fields of the header line (the first record), counted quote-aware without building
/// anything per field; stops once the count passes `limit`, so a hostile 64 MiB header costs
/// one bounded scan. Returns the count (or `limit + 1`).
fn header_fields(src: &dyn ByteSource, rel: &Path, limit: usize) -> Result<usize, ViewError> {
    let mut buf = vec![0u8; 64 << 10];
    let mut pos = 0u64;
    let mut scan = HeaderFields::new(limit);
    loop {
        let n = src.read_at(rel, pos, &mut buf)?;
        if n == 0 {
            return Ok(scan.fields());
        }
        if let Some(fields) = scan.feed(&buf[..n]) {
            return Ok(fields);
        }
        pos += n as u64;
        if pos > MAX_RECORD_BYTES {
            // The record guard below reports this with its own message.
            return Ok(scan.fields());
        }
    }
}

fn open_inner(src: Arc<dyn ByteSource>, rel: &Path) -> Result<Opened, ViewError> {
    let bad = |e: String| ViewError::corrupt(rel, e);
    let len = src.len(rel)?;
    if header_fields(src.as_ref(), rel, super::MAX_COLUMNS)? > super::MAX_COLUMNS {
        return Err(super::too_many_columns(rel, "header line"));
    }
    let (schema, _) = Format::default()
        .with_header(true)
        .infer_schema(
            RecordGuard::new(SourceReader::new(src.as_ref(), rel, 0)),
            None,
        )
        .map_err(|e| bad(format!("cannot infer CSV columns: {e}")))?;
    let schema = Arc::new(schema);

    // Where the header line ends: decode one record as text.
    let text_schema = Arc::new(Schema::new(
        schema
            .fields()
            .iter()
            .map(|f| Field::new(f.name(), DataType::Utf8, true))
            .collect::<Vec<_>>(),
    ));
    let mut header = ReaderBuilder::new(text_schema)
        .with_header(false)
        .with_batch_size(1)
        .build_decoder();
    let mut buf = vec![0u8; READ_BYTES];
    let mut data_start = 0u64;
    loop {
        let n = src.read_at(rel, data_start, &mut buf)?;
        let used = header
            .decode(&buf[..n])
            .map_err(|e| bad(format!("bad CSV header: {e}")))?;
        data_start += used as u64;
        if header.capacity() == 0 || n == 0 {
            break;
        }
    }

    let mut per_block = block_rows(schema.fields().len());
    let (nulls, ranges, rows, starts) = loop {
        match index(
            src.as_ref(),
            rel,
            &schema,
            data_start,
            len,
            per_block,
            &mut buf,
        )? {
            Indexed::Done(ix) => break ix,
            Indexed::TooLong { records } => {
                // At most a sixteenth as many records, and no more than fitted: at most five
                // passes from 64 Ki records per block down to one.
                per_block = (per_block / 16).min(records).max(1);
            }
        }
    };
    let columns: Vec<ColumnPlan> = schema
        .fields()
        .iter()
        .zip(&nulls)
        .map(|(f, &n)| ColumnPlan::new(f.name().clone(), f.data_type().clone(), n))
        .collect();
    let viewed = (0..columns.len())
        .filter(|&i| columns[i].dtype.is_some())
        .collect();
    let blocks = CsvBlocks {
        src,
        rel: rel.to_path_buf(),
        schema,
        ranges,
        rows,
        block_rows: per_block,
        viewed,
        last: Mutex::new(VecDeque::new()),
    };
    Ok((columns, starts, Box::new(blocks)))
}

/// What one indexing pass found: per column its nulls, each block's byte range and rows, and
/// the first row of each block (with the total at the end).
type Index = (Vec<u64>, Vec<(u64, u64)>, Vec<usize>, Vec<u64>);

/// How an indexing pass ended.
enum Indexed {
    /// Every record indexed.
    Done(Index),
    /// A block of several records ran past [`MAX_BLOCK_BYTES`] after `records` of them.
    TooLong {
        /// Records the overlong block had completed.
        records: usize,
    },
}

/// Indexes the records from `data_start` in blocks of `per_block` records (see the module
/// docs), reading through `buf`.
fn index(
    src: &dyn ByteSource,
    rel: &Path,
    schema: &SchemaRef,
    data_start: u64,
    len: u64,
    per_block: usize,
    buf: &mut [u8],
) -> Result<Indexed, ViewError> {
    let bad = |e: String| ViewError::corrupt(rel, e);
    let mut dec = ReaderBuilder::new(schema.clone())
        .with_header(false)
        .with_batch_size(per_block)
        .build_decoder();
    let mut nulls = vec![0u64; schema.fields().len()];
    let mut ranges = Vec::new();
    let mut rows = Vec::new();
    let mut starts = vec![0u64];
    let mut block_start = data_start;
    let mut consumed = data_start;
    // Where the decoder last completed a record (see MAX_RECORD_BYTES).
    let mut progress_at = data_start;
    let (mut filled, mut pos) = (0usize, 0usize);
    let mut file_pos = data_start;
    loop {
        if pos == filled && file_pos < len {
            filled = src.read_at(rel, file_pos, buf)?;
            file_pos += filled as u64;
            pos = 0;
        }
        let input = &buf[pos..filled];
        let before = dec.capacity();
        let used = dec
            .decode(input)
            .map_err(|e| bad(format!("bad CSV record: {e}")))?;
        pos += used;
        consumed += used as u64;
        if dec.capacity() != before {
            progress_at = consumed;
        } else if consumed - progress_at > MAX_RECORD_BYTES {
            return Err(bad(format!(
                "no complete record in the {} MiB after byte {progress_at} (a stray '\"' \
                 opening a field that never closes?)",
                MAX_RECORD_BYTES >> 20
            )));
        }
        // A block of several records past its byte bound: index again with smaller blocks.
        if per_block > 1 && consumed - block_start > MAX_BLOCK_BYTES {
            return Ok(Indexed::TooLong {
                records: per_block - dec.capacity(),
            });
        }
        let at_end = input.is_empty();
        if dec.capacity() == 0 || at_end {
            if let Some(batch) = dec
                .flush()
                .map_err(|e| bad(format!("bad CSV record: {e}")))?
            {
                for (j, col) in batch.columns().iter().enumerate() {
                    nulls[j] += col.null_count() as u64;
                }
                ranges.push((block_start, consumed));
                rows.push(batch.num_rows());
                starts.push(starts[starts.len() - 1] + batch.num_rows() as u64);
                block_start = consumed;
            }
            if at_end {
                break;
            }
        }
    }
    Ok(Indexed::Done((nulls, ranges, rows, starts)))
}
