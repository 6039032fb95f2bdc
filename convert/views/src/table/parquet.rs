//! Parquet tables: the footer is read once through the [`ByteSource`] (the
//! [`ArrowReaderMetadata`] is kept), a block is a row group, and a block read decodes only that
//! row group and only the projected columns. Null counts come from the column-chunk statistics;
//! a column without them is scanned once at open (its nulls decide its dtype, hence its size).
//! A block read fetches each projected column chunk with one source request and decodes it
//! from memory ([`MAX_PREFETCH`] bounds a chunk), as pyarrow does: the page reader otherwise
//! reads each page header a few bytes at a time, and each of those was a source read (21 490
//! reads for one 80 MB float64 column; the view ran at 0.3× pyarrow).
//!
//! Pages are untrusted too: before a block is decoded, every page header of its column chunks
//! is checked and the buffers they declare are reserved from the process's one decode budget
//! (`stagefs_parquet_bounds`), so a page claiming gigabytes fails its view with EIO instead of
//! being allocated.
//!
//! The footer is untrusted input: before any size taken from it is used, [`check_footer`]
//! holds every row count against the file's length ([`MAX_ROWS_PER_FILE_BYTE`]) and every
//! column chunk's byte range against the file, with checked arithmetic. Decoding asks for at
//! most [`BATCH_ROWS`] rows at a time (the decoder reserves a batch's memory up front), so a
//! lying row count fails its view with EIO when the pages run out, never the process.
//!
//! Many small row groups: a block is a run of consecutive row groups (at most
//! [`BLOCK_GROUPS`] of them and about [`BLOCK_ROWS`] rows), decoded by one reader, whose
//! column chunks are read with as few source requests as their layout allows (ranges closer
//! than [`GAP_BYTES`] are merged, up to [`MAX_PREFETCH`]). So a read costs the blocks it
//! touches, whatever the file's row-group count: a 4 KiB read of a file of 10^5 one-row
//! groups decodes at most three blocks and reads the source a few times (it decoded one row
//! group per row and searched a cache list of millions of entries). The footer is parsed once
//! per open table and only if it is at most [`MAX_FOOTER_BYTES`] with at most
//! [`MAX_ROW_GROUPS`] row groups: parsing costs about ten times the footer's size in memory,
//! so these bound what one file's metadata can cost the mount.

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::ArrayRef;
use arrow::compute::concat;
use bytes::Bytes;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;
use parquet::errors::ParquetError;
use parquet::file::reader::{ChunkReader, Length};

use super::{BlockReader, ColumnPlan};
use crate::error::ViewError;
use crate::source::ByteSource;

/// Rows a footer may claim per byte of the file. Real files stay far below: a constant column
/// run-length encoded in 20 000-row pages (what current writers emit) costs a ~20-byte page
/// header per page, about 1 000 rows per byte. 2^16 leaves room for odd writers and still
/// refuses the 11 KB file claiming 10^12 rows (an 8 TB allocation once).
pub const MAX_ROWS_PER_FILE_BYTE: u64 = 1 << 16;

/// Values (rows × projected columns) one decoded batch may hold: the decoder reserves a
/// batch's buffers before the pages say how many rows there really are, so a footer claiming
/// 1 Mi rows in a file of 10^4 columns must not turn a `features.npy` read into an 80 GB
/// reservation. 2^22 values (32 MiB of float64) keep narrow tables at full [`BATCH_ROWS`].
pub const MAX_BATCH_VALUES: usize = 1 << 22;

/// Largest footer accepted (bytes). A footer is the file's metadata: ~100-200 bytes per
/// column chunk (row groups × columns), parsed into about ten times that. 64 MiB takes
/// 10^5 row groups of dozens of columns (a few hundred MB parsed, once per table) and refuses
/// the footers that cost gigabytes (10^6 row groups × a few columns).
pub const MAX_FOOTER_BYTES: u64 = 64 << 20;

/// Most row groups accepted: 2^17 is far past real files (a 1 TB file of 128 MiB groups has
/// 8 192) and keeps the per-group index small.
pub const MAX_ROW_GROUPS: usize = 1 << 17;

/// Most row groups one block spans: bounds a block's reader work when row groups are tiny.
pub const BLOCK_GROUPS: usize = 256;

/// Rows a block of several row groups gathers up to (a single row group may be larger).
pub const BLOCK_ROWS: u64 = 1 << 16;

/// Column chunks closer than this in the file are read with one source request (the bytes
/// in between are read and dropped): a request costs far more than 64 KiB on a shared file
/// system.
pub const GAP_BYTES: u64 = 64 << 10;

/// Rows decoded per batch: a row group of 1 Mi rows (pyarrow's default) decodes in one batch
/// and one buffer (handed out without a copy); a larger or lying one in bounded steps.
pub const BATCH_ROWS: usize = 1 << 20;

/// One Parquet file of a [`ByteSource`], as parquet's [`ChunkReader`].
#[derive(Clone)]
struct SourceFile {
    src: Arc<dyn ByteSource>,
    rel: Arc<PathBuf>,
    len: u64,
}

impl Length for SourceFile {
    fn len(&self) -> u64 {
        self.len
    }
}

/// Sequential reads of a [`SourceFile`] (page headers outside a prefetched chunk).
struct SourceRead {
    file: SourceFile,
    pos: u64,
}

impl io::Read for SourceRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.src.read_at(&self.file.rel, self.pos, buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl SourceFile {
    /// `length` bytes at `start`, read in full; the range is checked against the file first.
    fn read_range(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        // Lengths come from page headers and footers: bounded by the file before allocating.
        if start
            .checked_add(length as u64)
            .is_none_or(|end| end > self.len)
        {
            return Err(ParquetError::EOF(format!(
                "{length} bytes at {start} lie past the end of the file ({} bytes)",
                self.len
            )));
        }
        // A source returns fewer bytes only at the end of the file (`ByteSource`'s contract).
        let mut buf = Vec::new();
        let n = self
            .src
            .read_at_append(&self.rel, start, length, &mut buf)
            .map_err(|e| ParquetError::External(Box::new(e)))?;
        if n < length {
            return Err(ParquetError::EOF(format!(
                "file ends at {} bytes, wanted {length} bytes at {start}",
                start + n as u64
            )));
        }
        Ok(Bytes::from(buf))
    }
}

impl ChunkReader for SourceFile {
    type T = io::BufReader<SourceRead>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        // The page reader parses a page header through this reader a few bytes at a time:
        // unbuffered, each of those was a source read (the fuzzer's 2 KB file of thousands of
        // pages cost seconds).
        Ok(io::BufReader::with_capacity(
            HEADER_BUFFER,
            SourceRead {
                file: self.clone(),
                pos: start,
            },
        ))
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        self.read_range(start, length)
    }
}

/// Bytes a page-header read buffers from the source: a header is tens of bytes, a data page
/// typically ~1 MiB, so one read of 16 KiB covers the header without reading much of the page.
const HEADER_BUFFER: usize = 16 << 10;

/// Largest column chunk read in one request and decoded from memory. A chunk of a 1 Mi-row
/// row group of 8-byte values is ~8 MiB; past this bound (a huge row group, or a footer lying
/// about sizes) pages are read one by one instead, so memory stays bounded.
pub const MAX_PREFETCH: u64 = 64 << 20;

/// The projected column chunks of one row group, each read with one source request (the way
/// pyarrow reads them), served to the page reader from memory without copying; anything
/// outside them falls through to the file.
struct RowGroupChunks {
    file: SourceFile,
    chunks: Vec<(u64, Bytes)>,
}

impl RowGroupChunks {
    /// The chunk holding `[start, start + len)`, as an offset into it. `start` must lie inside
    /// the chunk, not at its end: chunks of adjacent columns touch, and the next column's
    /// first page header is read from `start` = the end of the previous chunk.
    fn find(&self, start: u64, len: u64) -> Option<(&Bytes, usize)> {
        self.chunks.iter().find_map(|(at, bytes)| {
            let off = start.checked_sub(*at)?;
            let end = off.checked_add(len)?;
            (off < bytes.len() as u64 && end <= bytes.len() as u64).then_some((bytes, off as usize))
        })
    }
}

impl Length for RowGroupChunks {
    fn len(&self) -> u64 {
        self.file.len
    }
}

/// A page-header reader over a prefetched chunk or the file.
enum ChunkRead {
    Memory(bytes::buf::Reader<Bytes>),
    File(io::BufReader<SourceRead>),
}

impl io::Read for ChunkRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            ChunkRead::Memory(r) => r.read(buf),
            ChunkRead::File(r) => r.read(buf),
        }
    }
}

impl ChunkReader for RowGroupChunks {
    type T = ChunkRead;

    fn get_read(&self, start: u64) -> parquet::errors::Result<ChunkRead> {
        match self.find(start, 0) {
            Some((bytes, off)) => {
                use bytes::Buf;
                Ok(ChunkRead::Memory(bytes.slice(off..).reader()))
            }
            None => self.file.get_read(start).map(ChunkRead::File),
        }
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        match self.find(start, length as u64) {
            Some((bytes, off)) => Ok(bytes.slice(off..off + length)),
            None => self.file.read_range(start, length),
        }
    }
}

/// Decodes runs of row groups of one Parquet file.
struct ParquetBlocks {
    file: SourceFile,
    meta: ArrowReaderMetadata,
    /// First row group of each block, then the row-group count: `blocks + 1` entries.
    groups: Vec<usize>,
}

impl ParquetBlocks {
    /// Reads the column chunks of `cols` (root columns) in row groups `rgs`: ranges closer
    /// than [`GAP_BYTES`] are merged into one request of at most [`MAX_PREFETCH`]; a chunk
    /// larger than that is left to the page reader. Ranges were checked by [`check_footer`].
    fn prefetch(
        &self,
        rgs: std::ops::Range<usize>,
        cols: &[usize],
    ) -> parquet::errors::Result<Vec<(u64, Bytes)>> {
        let descr = self.meta.parquet_schema();
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for rg in &self.meta.metadata().row_groups()[rgs] {
            for (leaf, c) in rg.columns().iter().enumerate() {
                if leaf >= descr.num_columns() || !cols.contains(&descr.get_column_root_idx(leaf)) {
                    continue;
                }
                let start = c.dictionary_page_offset().unwrap_or(c.data_page_offset());
                let (Ok(start), Ok(len)) =
                    (u64::try_from(start), u64::try_from(c.compressed_size()))
                else {
                    continue;
                };
                if len == 0 || len > MAX_PREFETCH {
                    continue;
                }
                ranges.push((start, start + len));
            }
        }
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (start, end) in ranges {
            match merged.last_mut() {
                Some(last)
                    if start <= last.1.saturating_add(GAP_BYTES)
                        && end.max(last.1) - last.0 <= MAX_PREFETCH =>
                {
                    last.1 = last.1.max(end);
                }
                _ => merged.push((start, end)),
            }
        }
        merged
            .into_iter()
            .map(|(start, end)| Ok((start, self.file.read_range(start, (end - start) as usize)?)))
            .collect()
    }

    fn read(&self, b: usize, cols: &[usize]) -> Result<Vec<ArrayRef>, String> {
        let mask = ProjectionMask::roots(self.meta.parquet_schema(), cols.iter().copied());
        let (first, end) = match (self.groups.get(b), self.groups.get(b + 1)) {
            (Some(&f), Some(&e)) if f < e => (f, e),
            _ => return Err(format!("no block {b}")),
        };
        let mut rows = 0usize;
        for rg in &self.meta.metadata().row_groups()[first..end] {
            let n = usize::try_from(rg.num_rows()).map_err(|_| "negative row count")?;
            rows = rows.saturating_add(n);
        }
        let per_batch = (MAX_BATCH_VALUES / cols.len().max(1)).clamp(1, BATCH_ROWS);
        let rows = rows.clamp(1, per_batch);
        let chunks = RowGroupChunks {
            file: self.file.clone(),
            chunks: self.prefetch(first..end, cols).map_err(|e| e.to_string())?,
        };
        // Every page header of the decode is checked, and the buffers they declare reserved,
        // before the parquet crate allocates anything from them (a 1 KB file claimed 2 GiB
        // per column). Held until the decode's buffers are gone.
        let _buffers = stagefs_parquet_bounds::reserve_decode(
            self.meta.metadata(),
            first..end,
            cols,
            &self.file.rel.display().to_string(),
            &mut |at, len| chunks.get_bytes(at, len).map_err(|e| e.to_string()),
        )?;
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(chunks, self.meta.clone())
            .with_projection(mask)
            .with_row_groups((first..end).collect())
            .with_batch_size(rows)
            .build()
            .map_err(|e| e.to_string())?;
        let mut parts: Vec<Vec<ArrayRef>> = vec![Vec::new(); cols.len()];
        for batch in reader {
            let batch = batch.map_err(|e| e.to_string())?;
            if batch.num_columns() != cols.len() {
                return Err(format!(
                    "decoded {} columns, wanted {}",
                    batch.num_columns(),
                    cols.len()
                ));
            }
            for (j, col) in batch.columns().iter().enumerate() {
                parts[j].push(col.clone());
            }
        }
        parts
            .into_iter()
            .map(|p| match p.len() {
                1 => Ok(p[0].clone()),
                _ => {
                    let refs: Vec<&dyn arrow::array::Array> =
                        p.iter().map(|a| a.as_ref()).collect();
                    if refs.is_empty() {
                        return Err("row group decoded to nothing".into());
                    }
                    concat(&refs).map_err(|e| e.to_string())
                }
            })
            .collect()
    }
}

impl BlockReader for ParquetBlocks {
    fn read_block(&self, b: usize, cols: &[usize]) -> Result<Vec<ArrayRef>, String> {
        match catch_unwind(AssertUnwindSafe(|| self.read(b, cols))) {
            Ok(r) => r,
            Err(_) => Err(format!("Parquet decoder panicked on block {b}")),
        }
    }

    fn meta_bytes(&self) -> usize {
        self.meta.metadata().memory_size() + self.groups.len() * 8
    }

    fn units(&self, b: usize) -> u64 {
        match (self.groups.get(b), self.groups.get(b + 1)) {
            (Some(&f), Some(&e)) => e.saturating_sub(f) as u64,
            _ => 0,
        }
    }
}

/// Cuts row groups into blocks (see the module notes): `starts` holds the first row of each
/// row group and then the row count. Returns the first row group of each block then the
/// row-group count, and the first row of each block then the row count.
pub fn blocks_of(starts: &[u64]) -> (Vec<usize>, Vec<u64>) {
    let groups = starts.len().saturating_sub(1);
    let (mut firsts, mut rows) = (vec![0usize], vec![0u64]);
    let mut first = 0usize;
    for g in 0..groups {
        let next = g + 1;
        let block_rows = starts[next] - starts[first];
        let next_rows = starts.get(next + 1).map(|&e| e - starts[next]);
        let full = next - first >= BLOCK_GROUPS
            || next_rows.is_none_or(|n| block_rows.saturating_add(n) > BLOCK_ROWS);
        if full {
            firsts.push(next);
            rows.push(starts[next]);
            first = next;
        }
    }
    (firsts, rows)
}

/// The footer's length from the file's last 8 bytes, refused past [`MAX_FOOTER_BYTES`]
/// before anything is parsed. A file too short or without the magic is left to the parser,
/// which says so.
fn check_footer_len(file: &SourceFile) -> Result<(), String> {
    if file.len < 8 {
        return Ok(());
    }
    let tail = file
        .read_range(file.len - 8, 8)
        .map_err(|e| format!("cannot read the Parquet footer: {e}"))?;
    if &tail[4..] != b"PAR1" {
        return Ok(());
    }
    let footer = u64::from(u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]));
    if footer > MAX_FOOTER_BYTES {
        return Err(format!(
            "its footer (metadata) is {footer} bytes, more than the {} MiB a table view \
             accepts: too many row groups × columns; rewrite it with fewer, larger row groups \
             (e.g. pyarrow's write_table(..., row_group_size=1_000_000))",
            MAX_FOOTER_BYTES >> 20
        ));
    }
    Ok(())
}

type Opened = (Vec<ColumnPlan>, Vec<u64>, Box<dyn BlockReader>);

/// Opens the Parquet file at `rel`: footer, column plans, row-group boundaries.
pub(crate) fn open(src: Arc<dyn ByteSource>, rel: &Path) -> Result<Opened, ViewError> {
    let len = src.len(rel)?;
    let file = SourceFile {
        src,
        rel: Arc::new(rel.to_path_buf()),
        len,
    };
    match catch_unwind(AssertUnwindSafe(|| open_inner(file))) {
        Ok(r) => r.map_err(|e| ViewError::corrupt(rel, e)),
        Err(_) => Err(ViewError::corrupt(
            rel,
            "Parquet reader panicked on this file",
        )),
    }
}

/// Checks a footer against the file it came from; returns the first row of each row group
/// and then the row count (`row groups + 1` entries). See the module notes.
pub fn check_footer(
    md: &parquet::file::metadata::ParquetMetaData,
    file_len: u64,
) -> Result<Vec<u64>, String> {
    let limit = file_len.saturating_mul(MAX_ROWS_PER_FILE_BYTE);
    let mut starts = Vec::new();
    starts
        .try_reserve_exact(md.num_row_groups() + 1)
        .map_err(|_| "too many row groups")?;
    starts.push(0u64);
    let mut rows = 0u64;
    for (i, rg) in md.row_groups().iter().enumerate() {
        let n = u64::try_from(rg.num_rows())
            .map_err(|_| format!("row group {i} claims {} rows", rg.num_rows()))?;
        rows = rows.checked_add(n).filter(|&r| r <= limit).ok_or_else(|| {
            format!(
                "the footer claims more than {limit} rows for a file of {file_len} bytes \
                     (row group {i}: {n} rows)"
            )
        })?;
        starts.push(rows);
        for (j, c) in rg.columns().iter().enumerate() {
            // Not `byte_range()`: it panics on a negative offset.
            let start = c.dictionary_page_offset().unwrap_or(c.data_page_offset());
            let inside = u64::try_from(start)
                .ok()
                .zip(u64::try_from(c.compressed_size()).ok())
                .and_then(|(s, l)| s.checked_add(l))
                .is_some_and(|end| end <= file_len);
            if !inside {
                return Err(format!(
                    "row group {i} column {j}: {} bytes at {start} lie outside the file \
                     ({file_len} bytes)",
                    c.compressed_size()
                ));
            }
        }
    }
    Ok(starts)
}

fn open_inner(file: SourceFile) -> Result<Opened, String> {
    check_footer_len(&file)?;
    let meta = ArrowReaderMetadata::load(&file, ArrowReaderOptions::new())
        .map_err(|e| format!("cannot read the Parquet footer: {e}"))?;
    let md = meta.metadata().clone();
    if md.num_row_groups() > MAX_ROW_GROUPS {
        return Err(format!(
            "it has {} row groups, more than the {MAX_ROW_GROUPS} a table view accepts; \
             rewrite it with fewer, larger row groups (e.g. pyarrow's \
             write_table(..., row_group_size=1_000_000))",
            md.num_row_groups()
        ));
    }
    if meta.schema().fields().len() > super::MAX_COLUMNS {
        return Err(format!(
            "it has {} columns, more than the {} a table view takes (one file per column); \
             select the columns you need first, e.g. with `stagefs convert --to parquet \
             --columns A,B,...`",
            meta.schema().fields().len(),
            super::MAX_COLUMNS
        ));
    }
    let group_starts = check_footer(&md, file.len)?;
    let (groups, starts) = blocks_of(&group_starts);
    drop(group_starts);
    let schema = meta.schema().clone();
    let descr = meta.parquet_schema();
    let blocks = ParquetBlocks {
        file,
        meta: meta.clone(),
        groups,
    };
    let mut columns = Vec::with_capacity(schema.fields().len());
    for (i, field) in schema.fields().iter().enumerate() {
        let mut plan = ColumnPlan::new(field.name().clone(), field.data_type().clone(), 0);
        if plan.dtype.is_some() {
            let leaves: Vec<usize> = (0..descr.num_columns())
                .filter(|&l| descr.get_column_root_idx(l) == i)
                .collect();
            let nulls = match leaves.as_slice() {
                [leaf] if descr.column(*leaf).max_def_level() == 0 => Some(0),
                [leaf] => md
                    .row_groups()
                    .iter()
                    .map(|rg| {
                        rg.column(*leaf)
                            .statistics()
                            .and_then(|s| s.null_count_opt())
                    })
                    .sum::<Option<u64>>(),
                _ => None,
            };
            let nulls = match nulls {
                Some(n) => n,
                None => {
                    let mut n = 0u64;
                    for b in 0..blocks.groups.len().saturating_sub(1) {
                        let arrays = blocks.read(b, &[i])?;
                        n += arrays.first().map(|a| a.null_count() as u64).unwrap_or(0);
                    }
                    n
                }
            };
            plan = ColumnPlan::new(field.name().clone(), field.data_type().clone(), nulls);
        }
        columns.push(plan);
    }
    Ok((columns, starts, Box::new(blocks)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use parquet::file::metadata::{
        ColumnChunkMetaData, FileMetaData, ParquetMetaData, RowGroupMetaData,
    };
    use parquet::schema::parser::parse_message_type;
    use parquet::schema::types::SchemaDescriptor;

    #[test]
    fn parquet_row_counts_summing_past_u64_are_refused() {
        let schema = parse_message_type("message m { required double x; }").expect("schema");
        let descr = Arc::new(SchemaDescriptor::new(Arc::new(schema)));
        let group = || {
            RowGroupMetaData::builder(descr.clone())
                .set_num_rows(i64::MAX)
                .set_column_metadata(vec![ColumnChunkMetaData::builder(descr.column(0))
                    .build()
                    .expect("column")])
                .build()
                .expect("row group")
        };
        let md = ParquetMetaData::new(
            FileMetaData::new(1, 0, None, None, descr.clone(), None),
            vec![group(), group(), group()],
        );
        // Even with no length limit (a file of u64::MAX bytes), the sum must not wrap.
        let e = check_footer(&md, u64::MAX).expect_err("three i64::MAX row counts overflow u64");
        assert!(e.contains("claims more than"), "{e}");
        // Two of them fit in a u64 and pass the arithmetic; the limit is the file's length.
        let md2 = ParquetMetaData::new(
            FileMetaData::new(1, 0, None, None, descr.clone(), None),
            vec![group(), group()],
        );
        assert_eq!(
            check_footer(&md2, u64::MAX).expect("fits").last(),
            Some(&(u64::MAX - 1))
        );
        assert!(check_footer(&md2, 11_000).is_err());
    }
}
