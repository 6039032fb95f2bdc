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

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::{BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::compute::cast;
use arrow::csv::ReaderBuilder;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
    RowSelector,
};
use parquet::arrow::ProjectionMask;

use super::CleanError;

/// Records read per CSV file to infer its column types (pandas reads all; Arrow needs a bound).
/// 20 000 rows is a few MB, read once per file, and catches the usual late floats in an
/// integer-looking column.
pub const INFER_RECORDS: usize = 20_000;

/// Rows per decoded record batch inside a unit: big enough to amortise per-batch overhead,
/// small enough that a batch's temporary buffers stay in cache-friendly sizes.
pub const BATCH_ROWS: usize = 64 * 1024;

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

fn wanted_in_dir(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.starts_with('.') || name.starts_with('_') {
        return false;
    }
    let lower = name.to_ascii_lowercase();
    lower.ends_with(".csv") || lower.ends_with(".parquet") || lower.ends_with(".pq")
}

fn walk(dir: &Path, out: &mut BTreeSet<PathBuf>) -> Result<(), CleanError> {
    let entries = std::fs::read_dir(dir).map_err(|e| io_err(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_err(dir, e))?;
        let path = entry.path();
        let ft = entry.file_type().map_err(|e| io_err(&path, e))?;
        if ft.is_dir() {
            let name = entry.file_name();
            if !name.to_string_lossy().starts_with(['.', '_']) {
                walk(&path, out)?;
            }
        } else if wanted_in_dir(&path) {
            out.insert(path);
        }
    }
    Ok(())
}

/// Expands SRC arguments into a sorted, de-duplicated file list. Directories are walked
/// recursively for `*.csv`, `*.parquet` and `*.pq` (names starting with `.` or `_` skipped, as
/// Spark/Dask do for `_SUCCESS` and friends); quoted globs are expanded here.
pub fn expand_inputs(args: &[String]) -> Result<Vec<PathBuf>, CleanError> {
    let mut files = BTreeSet::new();
    for arg in args {
        if arg.contains(['*', '?', '[']) {
            let paths =
                glob::glob(arg).map_err(|e| CleanError::Usage(format!("bad glob '{arg}': {e}")))?;
            let mut any = false;
            for p in paths {
                let p = p.map_err(|e| CleanError::io(e.path().to_path_buf(), e.into()))?;
                if p.is_dir() {
                    walk(&p, &mut files)?;
                } else {
                    files.insert(p);
                }
                any = true;
            }
            if !any {
                return Err(CleanError::Usage(format!("'{arg}' matches no file")));
            }
        } else {
            let p = PathBuf::from(arg);
            let meta = std::fs::metadata(&p).map_err(|e| io_err(&p, e))?;
            if meta.is_dir() {
                let before = files.len();
                walk(&p, &mut files)?;
                if files.len() == before {
                    return Err(CleanError::Usage(format!(
                        "directory '{arg}' holds no .csv, .parquet or .pq file"
                    )));
                }
            } else {
                files.insert(p);
            }
        }
    }
    if files.is_empty() {
        return Err(CleanError::Usage("no input files".into()));
    }
    Ok(files.into_iter().collect())
}

/// Pandas does not parse dates by default; keep them as text. A column that is empty in the
/// sample is float (all NaN), as pandas reads it.
fn pandas_csv_type(dt: &DataType) -> DataType {
    match dt {
        DataType::Null => DataType::Float64,
        DataType::Date32
        | DataType::Date64
        | DataType::Time32(_)
        | DataType::Time64(_)
        | DataType::Timestamp(_, _) => DataType::Utf8,
        other => other.clone(),
    }
}

/// Rows a Parquet footer may claim per byte of its file. Real files stay far below: even a
/// constant column run-length encoded in 20 000-row pages (what current writers emit) costs a
/// page header of ~20 bytes per page, about 1 000 rows per byte. A footer claiming more is
/// lying, and is refused before any size derived from it is used.
pub const MAX_ROWS_PER_FILE_BYTE: u64 = 1 << 16;

/// Checks a Parquet footer against the file it came from: every row count non-negative and
/// their sum within [`MAX_ROWS_PER_FILE_BYTE`] × the file's length, every column chunk's byte
/// range inside the file. `total_byte_size` (uncompressed) is only an estimate and is never
/// trusted for sizes; see [`parquet_spans`].
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

/// The most columns a run of `max_record` (1/[`super::RECORD_SHARE`] of the budget) takes.
pub fn max_columns(max_record: u64) -> usize {
    usize::try_from(max_record.saturating_mul(super::RECORD_SHARE) / COLUMN_BYTES)
        .unwrap_or(usize::MAX)
        .max(1)
}

fn too_many_columns(path: &Path, found: &str, max_record: u64) -> CleanError {
    let limit = max_columns(max_record);
    CleanError::Data(format!(
        "{}: {found} columns; --memory-budget {} allows at most {limit} ({} per column): \
         raise --memory-budget, or split the table",
        path.display(),
        human_bytes(max_record.saturating_mul(super::RECORD_SHARE)),
        human_bytes(COLUMN_BYTES)
    ))
}

/// Fields of a CSV's first record, counted quote-aware without building anything per field;
/// stops once past `limit` (returns `limit + 1`) or after `max_record` bytes.
fn header_fields(path: &Path, limit: usize, max_record: u64) -> Result<usize, CleanError> {
    let f = File::open(path).map_err(|e| io_err(path, e))?;
    let mut r = BufReader::with_capacity(1 << 16, f).take(max_record);
    let mut buf = [0u8; 1 << 16];
    let (mut fields, mut in_quotes) = (1usize, false);
    loop {
        let n = r.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            return Ok(fields);
        }
        for &b in &buf[..n] {
            match b {
                b'"' => in_quotes = !in_quotes,
                b',' if !in_quotes => {
                    fields += 1;
                    if fields > limit {
                        return Ok(fields);
                    }
                }
                b'\n' if !in_quotes => return Ok(fields),
                _ => {}
            }
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

/// Column names as pandas' `read_csv` gives them: an empty name becomes `Unnamed: <i>`, and
/// a repeated name `a` becomes `a.1`, `a.2`, ..., skipping any name present in the header
/// (`a,a,a.1` → `a, a.2, a.1`; named columns are renamed before unnamed ones), exactly as
/// pandas' `mangle_dupe_names` does. Parquet output cannot hold two columns of one name
/// (pyarrow refuses such a file), so duplicates are renamed rather than refused: the output
/// has the columns pandas would show.
pub fn dedup_names(names: &mut [String]) {
    // Hash lookups, not list scans: a header of 10^6 repeated names was quadratic (minutes).
    let is_unnamed: Vec<bool> = names.iter().map(|n| n.is_empty()).collect();
    for (i, n) in names.iter_mut().enumerate() {
        if n.is_empty() {
            *n = format!("Unnamed: {i}");
        }
    }
    // How many entries of `names` hold each name right now.
    let mut present: HashMap<String, usize> = HashMap::new();
    for n in names.iter() {
        *present.entry(n.clone()).or_default() += 1;
    }
    let order: Vec<usize> = (0..names.len())
        .filter(|&i| !is_unnamed[i])
        .chain((0..names.len()).filter(|&i| is_unnamed[i]))
        .collect();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for i in order {
        let old = names[i].clone();
        let mut col = old.clone();
        let mut cur = counts.get(&col).copied().unwrap_or(0);
        while cur > 0 {
            counts.insert(old.clone(), cur + 1);
            col = format!("{old}.{cur}");
            if present.get(&col).is_some_and(|&n| n > 0) {
                cur += 1;
            } else {
                cur = counts.get(&col).copied().unwrap_or(0);
            }
        }
        counts.insert(col.clone(), cur + 1);
        if col != old {
            if let Some(n) = present.get_mut(&old) {
                *n -= 1;
            }
            *present.entry(col.clone()).or_default() += 1;
        }
        names[i] = col;
    }
}

/// A schema whose duplicate column names are renamed as [`dedup_names`] does.
fn dedup_schema(schema: &SchemaRef) -> SchemaRef {
    let mut names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
    dedup_names(&mut names);
    if names
        .iter()
        .zip(schema.fields())
        .all(|(n, f)| n == f.name())
    {
        return schema.clone();
    }
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .zip(names)
        .map(|(f, n)| f.as_ref().clone().with_name(n))
        .collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

/// What the values of one CSV column looked like so far.
#[derive(Clone, Copy, Default)]
struct Seen {
    bool: bool,
    int: bool,
    float: bool,
    text: bool,
}

impl Seen {
    fn update(&mut self, v: &[u8]) {
        let v = v.trim_ascii();
        if v.is_empty() {
            return;
        }
        if v.eq_ignore_ascii_case(b"true") || v.eq_ignore_ascii_case(b"false") {
            self.bool = true;
            return;
        }
        let Ok(s) = std::str::from_utf8(v) else {
            self.text = true;
            return;
        };
        if s.parse::<i64>().is_ok() {
            self.int = true;
        } else if s.parse::<f64>().is_ok() {
            self.float = true;
        } else {
            self.text = true;
        }
    }

    /// pandas' choice: any text → string; bools alone → bool; ints alone → int64; any
    /// float → float64; nothing seen → float64 (an all-NaN column).
    fn data_type(self) -> DataType {
        match self {
            Seen { text: true, .. } => DataType::Utf8,
            Seen {
                bool: true,
                int: false,
                float: false,
                ..
            } => DataType::Boolean,
            Seen { bool: true, .. } => DataType::Utf8,
            Seen {
                int: true,
                float: false,
                ..
            } => DataType::Int64,
            _ => DataType::Float64,
        }
    }
}

/// Header and column types from the first [`INFER_RECORDS`] records. Records with the wrong
/// number of fields are ignored here (they are reported, with their line, when decoded).
fn infer_csv(path: &Path, reader: impl Read) -> Result<Schema, CleanError> {
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(reader);
    let bad = |e: csv::Error| {
        CleanError::Data(format!(
            "{}: cannot read the CSV header: {e}",
            path.display()
        ))
    };
    let mut record = csv::ByteRecord::new();
    if !rdr.read_byte_record(&mut record).map_err(bad)? {
        return Err(CleanError::Data(format!(
            "{}: empty file (a CSV needs a header line)",
            path.display()
        )));
    }
    // Names as pandas gives them: untrimmed, a UTF-8 byte-order mark dropped.
    let mut names: Vec<String> = record
        .iter()
        .map(|n| String::from_utf8_lossy(n).to_string())
        .collect();
    if let Some(first) = names.first_mut() {
        if let Some(rest) = first.strip_prefix('\u{feff}') {
            *first = rest.to_string();
        }
    }
    dedup_names(&mut names);
    let mut seen = vec![Seen::default(); names.len()];
    let mut n = 0;
    while n < INFER_RECORDS && rdr.read_byte_record(&mut record).map_err(bad)? {
        n += 1;
        if record.len() != names.len() {
            continue;
        }
        for (s, v) in seen.iter_mut().zip(record.iter()) {
            s.update(v);
        }
    }
    Ok(Schema::new(
        names
            .into_iter()
            .zip(seen)
            .map(|(n, s)| Field::new(n, s.data_type(), true))
            .collect::<Vec<_>>(),
    ))
}

/// The common type of one column across files, as pandas' concat would give it.
fn unify_type(a: &DataType, b: &DataType) -> Option<DataType> {
    if a == b {
        return Some(a.clone());
    }
    if a.is_integer() && b.is_integer() {
        return Some(DataType::Int64);
    }
    if (a.is_integer() || a.is_floating()) && (b.is_integer() || b.is_floating()) {
        return Some(DataType::Float64);
    }
    let text =
        |t: &DataType| matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View);
    if text(a) && text(b) {
        return Some(DataType::Utf8);
    }
    None
}

/// One schema for all inputs: same column names in the same order; types unified.
pub fn unify_schemas(inputs: &[Input]) -> Result<SchemaRef, CleanError> {
    let first = &inputs[0];
    let names =
        |s: &Schema| -> Vec<String> { s.fields().iter().map(|f| f.name().clone()).collect() };
    let mut types: Vec<DataType> = first
        .schema
        .fields()
        .iter()
        .map(|f| f.data_type().clone())
        .collect();
    for other in &inputs[1..] {
        if names(&other.schema) != names(&first.schema) {
            return Err(CleanError::Data(format!(
                "{} has columns [{}] but {} has [{}]; all inputs must have the same columns \
                 in the same order",
                other.path.display(),
                names(&other.schema).join(", "),
                first.path.display(),
                names(&first.schema).join(", ")
            )));
        }
        for (i, f) in other.schema.fields().iter().enumerate() {
            types[i] = unify_type(&types[i], f.data_type()).ok_or_else(|| {
                CleanError::Data(format!(
                    "column '{}' is {} in {} but {} in {}",
                    f.name(),
                    types[i],
                    first.path.display(),
                    f.data_type(),
                    other.path.display()
                ))
            })?;
        }
    }
    let fields: Vec<Field> = first
        .schema
        .fields()
        .iter()
        .zip(types)
        .map(|(f, t)| Field::new(f.name(), t, true))
        .collect();
    Ok(Arc::new(Schema::new(fields)))
}

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

/// `n` bytes for people (KiB/MiB/GiB).
fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} bytes"),
    }
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
    if let Some(batches) = super::csv_decode::decode(schema, projection, bytes, header, BATCH_ROWS)
    {
        return Ok(Decoded {
            batches,
            skipped: Vec::new(),
            skipped_count: 0,
        });
    }
    match decode_all(schema, projection, bytes, header, BATCH_ROWS) {
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
    let _buffers = {
        use std::os::unix::fs::FileExt;
        stagefs_parquet_bounds::reserve_decode(
            meta.metadata(),
            rg..rg + 1,
            projection,
            &input.path.display().to_string(),
            &mut |at, len| {
                let mut buf = vec![0u8; len];
                let mut got = 0;
                while got < len {
                    match file.read_at(&mut buf[got..], at + got as u64) {
                        Ok(0) => break,
                        Ok(n) => got += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e.to_string()),
                    }
                }
                buf.truncate(got);
                Ok(bytes::Bytes::from(buf))
            },
        )
        .map_err(|e| data_err(&e))?
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_names_are_mangled_as_pandas_read_csv_does() {
        // Expected lists are pandas 3.1's read_csv column names for these headers.
        let cases: [(&[&str], &[&str]); 5] = [
            (&["a", "a", "b"], &["a", "a.1", "b"]),
            (&["a", "a.1", "a"], &["a", "a.1", "a.2"]),
            (&["a", "a", "a.1"], &["a", "a.2", "a.1"]),
            (&["a", "a", "a", "a.1"], &["a", "a.2", "a.3", "a.1"]),
            (&["", "x", ""], &["Unnamed: 0", "x", "Unnamed: 2"]),
        ];
        for (input, want) in cases {
            let mut names: Vec<String> = input.iter().map(|s| s.to_string()).collect();
            dedup_names(&mut names);
            assert_eq!(names, want, "{input:?}");
        }
    }

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
