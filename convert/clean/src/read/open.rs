//! Opening one input: its format detected and its schema read, with every size an untrusted
//! file claims checked before anything is allocated from it.
//!
//! A file starting with the Parquet magic is Parquet: its footer length is bounded by the
//! record share of `--memory-budget` before the footer is parsed, then its row counts and
//! column chunk ranges are checked against the file's length ([`check_parquet_footer`]).
//! Anything else is CSV: the header's fields are counted (quote-aware, bounded) before types
//! are inferred ([`super::schema`]). Either way a table wider than the budget allows
//! ([`max_columns`]) is refused with the numbers to change.

use std::fs::File;
use std::io::{BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use arrow::datatypes::{Field, Schema};
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use stagefs_parquet_bounds::HeaderFields;

use super::schema::{dedup_schema, infer_csv, pandas_csv_type};
use super::{human_bytes, io_err, Input, Kind};
use crate::CleanError;

/// Rows a Parquet footer may claim per byte of its file. Real files stay far below: even a
/// constant column run-length encoded in 20 000-row pages (what current writers emit) costs a
/// page header of ~20 bytes per page, about 1 000 rows per byte. A footer claiming more is
/// lying, and is refused before any size derived from it is used.
pub const MAX_ROWS_PER_FILE_BYTE: u64 = 1 << 16;

/// Checks a Parquet footer against the file it came from: every row count non-negative and
/// their sum within [`MAX_ROWS_PER_FILE_BYTE`] × the file's length, every column chunk's byte
/// range inside the file. `total_byte_size` (uncompressed) is only an estimate and is never
/// trusted for sizes; see [`parquet_spans`](super::parquet_spans).
pub fn check_parquet_footer(
    meta: &parquet::file::metadata::ParquetMetaData,
    file_len: u64,
) -> Result<u64, String> {
    let limit = file_len.saturating_mul(MAX_ROWS_PER_FILE_BYTE);
    let mut rows = 0u64;
    for (i, rg) in meta.row_groups().iter().enumerate() {
        let n = u64::try_from(rg.num_rows())
            .map_err(|_| format!("row group {i} claims {} rows", rg.num_rows()))?;
        rows = rows.checked_add(n).filter(|&r| r <= limit).ok_or_else(|| {
            format!(
                "the footer claims more than {limit} rows in a file of {file_len} bytes \
                     (row group {i} claims {n})"
            )
        })?;
        for (j, c) in rg.columns().iter().enumerate() {
            // Not `byte_range()`: it asserts (panics) on negative offsets.
            let start = c.dictionary_page_offset().unwrap_or(c.data_page_offset());
            let len = c.compressed_size();
            let inside = u64::try_from(start)
                .ok()
                .zip(u64::try_from(len).ok())
                .and_then(|(s, l)| s.checked_add(l))
                .is_some_and(|end| end <= file_len);
            if !inside {
                return Err(format!(
                    "row group {i} column {j}: bytes {start}+{len} lie outside the file \
                     ({file_len} bytes)"
                ));
            }
        }
    }
    Ok(rows)
}

/// Memory the job needs per column, whatever the rows: the schema and inference state, a
/// decoder builder per unit in flight and a Parquet column writer (page and statistics
/// buffers) per row group being encoded. 64 KiB is a generous measure of these, so
/// `--memory-budget` / [`COLUMN_BYTES`] columns keep the job within its budget.
pub const COLUMN_BYTES: u64 = 64 << 10;

/// The most columns a run of `max_record` (1/[`crate::RECORD_SHARE`] of the budget) takes.
pub fn max_columns(max_record: u64) -> usize {
    usize::try_from(max_record.saturating_mul(crate::RECORD_SHARE) / COLUMN_BYTES)
        .unwrap_or(usize::MAX)
        .max(1)
}

fn too_many_columns(path: &Path, found: &str, max_record: u64) -> CleanError {
    let limit = max_columns(max_record);
    CleanError::Data(format!(
        "{}: {found} columns; --memory-budget {} allows at most {limit} ({} per column): \
         raise --memory-budget, or split the table",
        path.display(),
        human_bytes(max_record.saturating_mul(crate::RECORD_SHARE)),
        human_bytes(COLUMN_BYTES)
    ))
}

/// Fields of a CSV's first record, counted quote-aware without building anything per field;
/// stops once past `limit` (returns `limit + 1`) or after `max_record` bytes.
fn header_fields(path: &Path, limit: usize, max_record: u64) -> Result<usize, CleanError> {
    let f = File::open(path).map_err(|e| io_err(path, e))?;
    let mut r = BufReader::with_capacity(1 << 16, f).take(max_record);
    let mut buf = [0u8; 1 << 16];
    let mut scan = HeaderFields::new(limit);
    loop {
        let n = r.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            return Ok(scan.fields());
        }
        if let Some(fields) = scan.feed(&buf[..n]) {
            return Ok(fields);
        }
    }
}

/// The footer length of a Parquet file (its last 8 bytes), refused past `max` bytes before
/// the footer is parsed (parsing costs about ten times its size).
fn check_footer_len(f: &File, path: &Path, size: u64, max: u64) -> Result<(), CleanError> {
    let mut tail = [0u8; 8];
    f.read_exact_at(&mut tail, size - 8)
        .map_err(|e| io_err(path, e))?;
    let footer = u64::from(u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]));
    if footer > max {
        return Err(CleanError::Data(format!(
            "{}: the Parquet footer is {}, more than the {} (1/8 of --memory-budget) accepted: \
             too many row groups × columns; rewrite the file with fewer, larger row groups, or \
             raise --memory-budget",
            path.display(),
            human_bytes(footer),
            human_bytes(max)
        )));
    }
    Ok(())
}

/// Opens one input: detects the format (Parquet magic, else CSV) and reads its schema.
/// `max_record` bounds the bytes read to infer a CSV's types (a stray quote makes the rest of
/// a file one record; it must not be read into memory whole).
pub fn open_input(path: &Path, max_record: u64) -> Result<Input, CleanError> {
    let mut f = File::open(path).map_err(|e| io_err(path, e))?;
    let size = f.metadata().map_err(|e| io_err(path, e))?.len();
    let mut magic = [0u8; 4];
    let is_parquet = size >= 8 && f.read_exact(&mut magic).is_ok() && &magic == b"PAR1";
    if is_parquet {
        let bad = |e: &dyn std::fmt::Display| {
            CleanError::Data(format!(
                "{}: cannot read Parquet footer: {e}",
                path.display()
            ))
        };
        check_footer_len(&f, path, size, max_record)?;
        let meta = ArrowReaderMetadata::load(&f, ArrowReaderOptions::new()).map_err(|e| bad(&e))?;
        check_parquet_footer(meta.metadata(), size).map_err(|e| bad(&e))?;
        let columns = meta.schema().fields().len();
        if columns > max_columns(max_record) {
            return Err(too_many_columns(
                path,
                &format!("it has {columns}"),
                max_record,
            ));
        }
        let schema = dedup_schema(meta.schema());
        return Ok(Input {
            path: path.to_path_buf(),
            kind: Kind::Parquet,
            size,
            schema,
            parquet: Some(meta),
        });
    }
    let limit = max_columns(max_record);
    if header_fields(path, limit, max_record)? > limit {
        return Err(too_many_columns(
            path,
            &format!("its header has over {limit}"),
            max_record,
        ));
    }
    let f = File::open(path).map_err(|e| io_err(path, e))?;
    let schema = infer_csv(path, BufReader::with_capacity(1 << 20, f).take(max_record))?;
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| Field::new(f.name(), pandas_csv_type(f.data_type()), true))
        .collect();
    Ok(Input {
        path: path.to_path_buf(),
        kind: Kind::Csv,
        size,
        schema: Arc::new(Schema::new(fields)),
        parquet: None,
    })
}
