//! Decoding one work unit into record batches of the unified schema.
//!
//! CSV: the fast decoder of [`crate::csv_decode`] first, then arrow-csv ([`decode_all`]);
//! only when both fail is the unit re-read record by record to name the bad line and, with
//! `--bad-rows skip`, to drop the bad records and decode the rest. Parquet: the unit's page
//! headers are checked and their buffers reserved from the process's decode budget
//! (`stagefs_parquet_bounds::reserve_decode`) before the parquet crate reads the selected
//! rows; columns are put in projection order and cast to the unified types. A panic inside
//! the parquet crate (some corrupt files) fails the unit with the file's name.

use std::fs::File;
use std::path::Path;

use arrow::array::RecordBatch;
use arrow::compute::cast;
use arrow::csv::ReaderBuilder;
use arrow::datatypes::{DataType, SchemaRef};
use parquet::arrow::arrow_reader::{ParquetRecordBatchReaderBuilder, RowSelection, RowSelector};
use parquet::arrow::ProjectionMask;

use super::schema::INFER_RECORDS;
use super::{count_lines_before, io_err, Input};
use crate::CleanError;

/// Rows per decoded record batch inside a unit: big enough to amortise per-batch overhead,
/// small enough that a batch's temporary buffers stay in cache-friendly sizes.
pub const BATCH_ROWS: usize = 64 * 1024;

/// How CSV decoding treats malformed rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadRows {
    /// Fail, naming the file and line.
    Error,
    /// Drop them, count them and warn about the first few.
    Skip,
}

/// What decoding a CSV unit produced.
pub struct Decoded {
    /// Record batches, in row order.
    pub batches: Vec<RecordBatch>,
    /// Malformed rows dropped (`--bad-rows skip`), with a description of the first few.
    pub skipped: Vec<String>,
    /// Total number of skipped rows.
    pub skipped_count: u64,
}

/// Decodes a unit with arrow-csv: the reference path the fast one falls back to.
pub fn decode_all(
    schema: &SchemaRef,
    projection: Option<&Vec<usize>>,
    bytes: &[u8],
    header: bool,
    batch_rows: usize,
) -> Result<Vec<RecordBatch>, arrow::error::ArrowError> {
    let mut builder = ReaderBuilder::new(schema.clone())
        .with_header(header)
        .with_batch_size(batch_rows);
    if let Some(p) = projection {
        builder = builder.with_projection(p.clone());
    }
    let mut decoder = builder.build_decoder();
    let mut batches = Vec::new();
    let mut pos = 0;
    loop {
        let n = decoder.decode(&bytes[pos..])?;
        pos += n;
        if decoder.capacity() == 0 || n == 0 {
            if let Some(b) = decoder.flush()? {
                batches.push(b);
            }
        }
        if n == 0 && pos >= bytes.len() {
            break;
        }
    }
    Ok(batches)
}

/// Decodes one CSV unit with the unified `schema` (all file columns) and `projection`.
/// `offset` is the unit's byte offset in `path`, used only to name lines in errors.
pub fn decode_csv(
    path: &Path,
    schema: &SchemaRef,
    projection: Option<&Vec<usize>>,
    bytes: &[u8],
    offset: u64,
    header: bool,
    bad_rows: BadRows,
) -> Result<Decoded, CleanError> {
    // The fast decoder, then arrow-csv; only a unit both refuse is read record by record.
    let whole = crate::csv_decode::decode(schema, projection, bytes, header, BATCH_ROWS)
        .map(Ok)
        .unwrap_or_else(|| decode_all(schema, projection, bytes, header, BATCH_ROWS));
    match whole {
        Ok(batches) => Ok(Decoded {
            batches,
            skipped: Vec::new(),
            skipped_count: 0,
        }),
        Err(_) => slow_decode(path, schema, projection, bytes, offset, header, bad_rows),
    }
}

/// The record-by-record path: finds each bad record, names its line, and either fails or
/// decodes the good records only.
fn slow_decode(
    path: &Path,
    schema: &SchemaRef,
    projection: Option<&Vec<usize>>,
    bytes: &[u8],
    offset: u64,
    header: bool,
    bad_rows: BadRows,
) -> Result<Decoded, CleanError> {
    let lines_before = count_lines_before(path, offset)?;
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(bytes);
    let mut record = csv::ByteRecord::new();
    let mut good: Vec<u8> = Vec::with_capacity(bytes.len());
    let mut skipped = Vec::new();
    let mut skipped_count = 0u64;
    let mut first = true;
    let ncols = schema.fields().len();
    loop {
        let start = rdr.position().byte() as usize;
        let more = rdr
            .read_byte_record(&mut record)
            .map_err(|e| CleanError::Data(format!("{}: unreadable CSV: {e}", path.display())))?;
        if !more {
            break;
        }
        let end = (rdr.position().byte() as usize).min(bytes.len());
        let raw = &bytes[start..end];
        if std::mem::take(&mut first) && header {
            continue;
        }
        let line = lines_before + memchr::memchr_iter(b'\n', &bytes[..start]).count() as u64 + 1;
        let problem = if record.len() != ncols {
            Some(format!("expected {ncols} fields, found {}", record.len()))
        } else {
            explain(schema, &record)
        };
        match problem {
            None => {
                good.extend_from_slice(raw);
                if !raw.ends_with(b"\n") {
                    good.push(b'\n');
                }
            }
            Some(why) => {
                let msg = format!("{}: line {line}: {why}", path.display());
                if bad_rows == BadRows::Error {
                    return Err(CleanError::Data(format!(
                        "{msg} (fix the file, or pass --bad-rows skip to drop malformed rows)"
                    )));
                }
                skipped_count += 1;
                if skipped.len() < 5 {
                    skipped.push(msg);
                }
            }
        }
    }
    let batches = decode_all(schema, projection, &good, false, BATCH_ROWS)
        .map_err(|e| CleanError::Data(format!("{}: {e}", path.display())))?;
    Ok(Decoded {
        batches,
        skipped,
        skipped_count,
    })
}

/// Names the first field of a record that does not fit its column's type.
fn explain(schema: &SchemaRef, record: &csv::ByteRecord) -> Option<String> {
    for (field, raw) in schema.fields().iter().zip(record.iter()) {
        let v = String::from_utf8_lossy(raw);
        let t = v.trim();
        if t.is_empty() {
            continue;
        }
        let ok = match field.data_type() {
            DataType::Int64 => t.parse::<i64>().is_ok(),
            DataType::Float64 => t.parse::<f64>().is_ok() || t.eq_ignore_ascii_case("nan"),
            DataType::Boolean => t.eq_ignore_ascii_case("true") || t.eq_ignore_ascii_case("false"),
            _ => true,
        };
        if !ok {
            return Some(format!(
                "column '{}': '{v}' is not {} (the type read from the file's first {INFER_RECORDS} \
                 rows)",
                field.name(),
                field.data_type()
            ));
        }
    }
    None
}

/// Decodes one Parquet unit: the selected rows, projected and cast to the unified schema.
pub fn decode_parquet(
    input: &Input,
    rg: usize,
    skip: usize,
    take: usize,
    projection: &[usize],
    target: &SchemaRef,
) -> Result<Vec<RecordBatch>, CleanError> {
    // The parquet crate panics on some corrupt files (a dictionary-encoded page without a
    // dictionary page: "Decoder for dict should have been set"); a bad input must fail the
    // job with its name, not abort it with a panic.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        decode_parquet_inner(input, rg, skip, take, projection, target)
    }))
    .unwrap_or_else(|_| {
        Err(CleanError::Data(format!(
            "{}: row group {rg}: the Parquet reader panicked on this file (corrupt?)",
            input.path.display()
        )))
    })
}

fn decode_parquet_inner(
    input: &Input,
    rg: usize,
    skip: usize,
    take: usize,
    projection: &[usize],
    target: &SchemaRef,
) -> Result<Vec<RecordBatch>, CleanError> {
    let data_err = |e: &dyn std::fmt::Display| {
        CleanError::Data(format!("{}: row group {rg}: {e}", input.path.display()))
    };
    let Some(meta) = input.parquet.clone() else {
        return Err(data_err(&"not a Parquet file"));
    };
    let file = File::open(&input.path).map_err(|e| io_err(&input.path, e))?;
    // Page headers checked and their buffers reserved from the process's one decode budget
    // before the parquet crate allocates from them (the views' bound: a 1 KB file's pages
    // claimed 2 GiB each). Held until this row group's decode is done.
    let _buffers = stagefs_parquet_bounds::reserve_decode(
        meta.metadata(),
        rg..rg + 1,
        projection,
        &input.path.display().to_string(),
        &mut |at, len| {
            let mut buf = vec![0u8; len];
            let got = stagefs_parquet_bounds::read_full_at(&file, &mut buf, at)
                .map_err(|e| e.to_string())?;
            buf.truncate(got);
            Ok(bytes::Bytes::from(buf))
        },
    )
    .map_err(|e| data_err(&e))?;
    let mask = ProjectionMask::roots(meta.parquet_schema(), projection.iter().copied());
    let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(file, meta)
        .with_row_groups(vec![rg])
        .with_row_selection(RowSelection::from(vec![
            RowSelector::skip(skip),
            RowSelector::select(take),
        ]))
        .with_projection(mask)
        .with_batch_size(BATCH_ROWS)
        .build()
        .map_err(|e| data_err(&e))?;
    // The decoded batch has the projected columns in file order; the target wants them in
    // projection order. By position, not by name: names may repeat in a Parquet file.
    let mut sorted = projection.to_vec();
    sorted.sort_unstable();
    let at: Vec<usize> = projection
        .iter()
        .map(|p| sorted.partition_point(|s| s < p))
        .collect();
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| data_err(&e))?;
        let cols = target
            .fields()
            .iter()
            .zip(&at)
            .map(|(f, &idx)| {
                if idx >= batch.num_columns() {
                    return Err(data_err(&"fewer columns than the schema"));
                }
                let c = batch.column(idx);
                if c.data_type() == f.data_type() {
                    Ok(c.clone())
                } else {
                    cast(c, f.data_type()).map_err(|e| data_err(&e))
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.push(RecordBatch::try_new(target.clone(), cols).map_err(|e| data_err(&e))?);
    }
    Ok(out)
}
