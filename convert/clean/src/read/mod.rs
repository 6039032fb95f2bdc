//! Inputs: expanding SRC (directories, files, globs), reading schemas up front, cutting files
//! into work units, and decoding a unit into record batches.
//!
//! A work unit is what one thread handles at a time and becomes one Parquet row group:
//! - CSV: a byte range of about `chunk` bytes cut after a record's newline. The cut is made
//!   outside quotes (quote parity is tracked with `memchr`, so a quoted field containing a
//!   newline is never split). One reader thread reads files sequentially (the fastest access
//!   pattern for shared file systems) and hands ranges to the decoding threads.
//! - Parquet: a row group, or a slice of one when it is larger than `chunk` uncompressed.
//!
//! CSV follows pandas' defaults where Arrow allows it cheaply: an empty field is null (NaN),
//! types are inferred from the first [`INFER_RECORDS`] records of each file and unified across
//! files (integers with floats → Float64), and dates stay strings (pandas does not parse dates
//! unless asked).
//!
//! Malformed rows are found by decoding the whole unit fast; only when that fails is the unit
//! re-split record by record to name the file and line, and, with `--bad-rows skip`, to drop
//! the bad records and keep the rest.
//!
//! One file per job, in the order a run meets them:
//! - `inputs.rs`: SRC arguments (directories, files, globs) expanded into the file list.
//! - `open.rs`: each file opened, its format detected, and hostile footers or headers refused
//!   before anything sized by them is read.
//! - `schema.rs`: CSV column types inferred, duplicate names renamed as pandas does, and one
//!   schema unified across all inputs.
//! - `units.rs`: files cut into work units (CSV byte ranges, Parquet row-group slices).
//! - `decode.rs`: a unit decoded into record batches of the unified schema.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use arrow::datatypes::SchemaRef;
use parquet::arrow::arrow_reader::ArrowReaderMetadata;

use crate::CleanError;

mod decode;
mod inputs;
mod open;
mod schema;
mod units;

pub use decode::{decode_all, decode_csv, decode_parquet, BadRows, Decoded, BATCH_ROWS};
pub use inputs::expand_inputs;
pub use open::{
    check_parquet_footer, max_columns, open_input, COLUMN_BYTES, MAX_ROWS_PER_FILE_BYTE,
};
pub use schema::{dedup_names, unify_schemas, INFER_RECORDS};
pub use units::{csv_chunks, parquet_spans, read_span, BufferPool, Span};

/// Format of one input file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Comma-separated text with a header line.
    Csv,
    /// Apache Parquet.
    Parquet,
}

/// One input file, with its schema as read from disk.
#[derive(Clone, Debug)]
pub struct Input {
    /// Path as found.
    pub path: PathBuf,
    /// Format.
    pub kind: Kind,
    /// Size in bytes.
    pub size: u64,
    /// Schema before unification.
    pub schema: SchemaRef,
    /// Parquet metadata, loaded once and shared by all units of the file.
    pub parquet: Option<ArrowReaderMetadata>,
}

fn io_err(path: &Path, e: std::io::Error) -> CleanError {
    CleanError::io(path.to_path_buf(), e)
}

/// `n` bytes for people (KiB/MiB/GiB).
fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} bytes"),
    }
}

fn count_lines_before(path: &Path, offset: u64) -> Result<u64, CleanError> {
    let mut f = BufReader::with_capacity(1 << 20, File::open(path).map_err(|e| io_err(path, e))?)
        .take(offset);
    let mut buf = vec![0u8; 1 << 20];
    let mut lines = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            return Ok(lines);
        }
        lines += memchr::memchr_iter(b'\n', &buf[..n]).count() as u64;
    }
}
