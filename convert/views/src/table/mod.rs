//! Tables (Parquet, CSV) as arrays: a directory with `<column>.npy` per numeric or boolean
//! column, `features.npy` (float32 `[rows, k]`) and `schema.json`.
//!
//! A table is split into *blocks* of rows that can be decoded on their own: Parquet row groups,
//! or runs of [`csv::BLOCK_ROWS`] CSV records found by one indexing pass. Sizes come from the
//! metadata (row counts, and null counts that decide whether an integer column must widen to
//! float64); a read of rows i..j decodes only the blocks it touches and only the columns it
//! needs, and the last rendered blocks are kept ([`CACHE_BYTES`]) so neighbouring reads reuse
//! them.
//!
//! A rendered block is an Arrow [`Buffer`]: for a column whose type is already the `.npy`
//! dtype and which has no nulls (the common case: float64, int64, ...), it is the decoded
//! array's own values buffer, so a read costs the decode and one copy into the caller's
//! buffer, no more. Booleans are unpacked from bits to bytes eight at a time.
//!
//! Sizes are checked once at open: every view's length (rows × row bytes + header) must fit
//! in a `u64` with room to spare ([`MAX_VIEW_BYTES`]), so no later arithmetic can wrap; a table
//! that fails this is a corrupt table (EIO for its views, the mount keeps running).
//!
//! Work per request is bounded and independent of the table's size: a block is found by a
//! binary search of its first rows, the rendered-block cache is a hash map in LRU order
//! (bounded by [`CACHE_BYTES`] and [`CACHE_BLOCKS`]), column files are found by name in a hash
//! map, and `schema.json` is rendered once. (The cache was a list searched front to back: with
//! millions of one-row blocks each lookup walked it, and a 4 KiB read took seconds.) A table has
//! at most [`MAX_COLUMNS`] columns: each is a file and a few hundred bytes of plans, so the
//! limit bounds a table's metadata to tens of MB whatever its header claims.

pub mod csv;
pub mod parquet;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::array::{Array, ArrayRef, AsArray};
use arrow::buffer::Buffer;
use arrow::compute::cast;
use arrow::datatypes::{DataType, Float32Type};
use lru::LruCache;
use serde_json::json;

use crate::error::ViewError;
use crate::source::ByteSource;
use crate::tree::TableFormat;
use crate::view::{read_rows, BytesView, View};
use stagefs_npy::{DType, NpyHeader};

/// Rendered blocks kept for all the process's tables together (bytes): a few row groups of a
/// wide table, or the current blocks of many readers of narrow ones.
pub const CACHE_BYTES: usize = 64 << 20;

/// Rendered blocks kept for all tables (count): many tiny blocks (one-row row groups) must not
/// make the cache itself a cost; 4096 covers several render units of any table.
pub const CACHE_BLOCKS: usize = 4096;

/// Most columns a table view takes. Each column is a file of the table's directory and costs
/// a few hundred bytes of metadata (plan, name, `schema.json` entry); 2^17 keeps a table's
/// metadata within tens of MB, and is past the widest real tables (10^5 columns open fine).
pub const MAX_COLUMNS: usize = 1 << 17;

/// The error for a table of more than [`MAX_COLUMNS`] columns (`what`: where they were found).
pub(crate) fn too_many_columns(rel: &Path, what: &str) -> ViewError {
    ViewError::Unsupported {
        path: rel.to_path_buf(),
        reason: format!(
            "its {what} has more than {MAX_COLUMNS} columns, the most a table view takes (one \
             file per column); select the columns you need first, e.g. with `stagefs convert \
             --to parquet --columns A,B,...`"
        ),
    }
}

/// Largest view a table may have (bytes): 2^62, far past any real table, and far enough
/// below `u64::MAX` that sums of offsets and lengths cannot wrap.
pub const MAX_VIEW_BYTES: u64 = 1 << 62;

/// Longest file name of a column view (bytes): the 255 most file systems take, less room for
/// the hidden temporary name `convert --to npy` writes it under (`.NAME.stagefs-tmp`, 13
/// bytes more) and a little spare.
const NAME_MAX: usize = 255 - 16;

/// Name of the matrix of all numeric columns.
pub const FEATURES: &str = "features.npy";
/// Name of the table description.
pub const SCHEMA: &str = "schema.json";

/// Decodes blocks of rows of one table.
pub(crate) trait BlockReader: Send + Sync {
    /// The columns `cols` (indices into the table's columns, increasing) of block `b`.
    fn read_block(&self, b: usize, cols: &[usize]) -> Result<Vec<ArrayRef>, String>;
    /// Source units (Parquet row groups) block `b` spans; 1 by default.
    fn units(&self, _b: usize) -> u64 {
        1
    }
    /// Bytes of memory the reader's own metadata holds (footer, index, decoded blocks kept).
    fn meta_bytes(&self) -> usize;
}

/// How one source column appears in the view.
#[derive(Clone, Debug)]
pub struct ColumnPlan {
    /// Column name in the source.
    pub name: String,
    /// Arrow type of the source column.
    pub source_type: DataType,
    /// Null values in the column.
    pub nulls: u64,
    /// Element type of its `.npy` file, None when skipped.
    pub dtype: Option<DType>,
    /// Its file name in the table directory, None when skipped.
    pub file: Option<String>,
    /// Why it has no file.
    pub skipped: Option<String>,
}

impl ColumnPlan {
    /// Plans a column of `source_type` with `nulls` nulls.
    pub fn new(name: String, source_type: DataType, nulls: u64) -> Self {
        let widened = |d: DType| if nulls > 0 { DType::F64 } else { d };
        let dtype = match &source_type {
            DataType::Boolean => Some(widened(DType::Bool)),
            DataType::Int8 => Some(widened(DType::I8)),
            DataType::Int16 => Some(widened(DType::I16)),
            DataType::Int32 => Some(widened(DType::I32)),
            DataType::Int64 => Some(widened(DType::I64)),
            DataType::UInt8 => Some(widened(DType::U8)),
            DataType::UInt16 => Some(widened(DType::U16)),
            DataType::UInt32 => Some(widened(DType::U32)),
            DataType::UInt64 => Some(widened(DType::U64)),
            DataType::Float16 => Some(DType::F16),
            DataType::Float32 => Some(DType::F32),
            DataType::Float64 => Some(DType::F64),
            _ => None,
        };
        let skipped = dtype
            .is_none()
            .then(|| format!("type {source_type} is not numeric or boolean"));
        ColumnPlan {
            name,
            source_type,
            nulls,
            dtype,
            file: None,
            skipped,
        }
    }
}

/// Gives every viewed column a distinct file name: the column name with `/` and NUL replaced
/// by `_`, plus `.npy`; names that collide (with each other or with `features.npy` /
/// `schema.json`) get `_<index>` appended. A name too long for a file name (over [`NAME_MAX`]
/// bytes with `.npy`) is cut at a character boundary and gets `_<index>` too, so the column stays
/// readable; `schema.json` maps every column to its file.
fn assign_files(columns: &mut [ColumnPlan]) {
    // A set, not a list: with 10^5 columns a list made this quadratic (seconds per open).
    let mut used: HashSet<String> = [FEATURES.to_string(), SCHEMA.to_string()].into();
    for (i, c) in columns.iter_mut().enumerate() {
        if c.dtype.is_none() {
            continue;
        }
        let base: String = c
            .name
            .chars()
            .map(|ch| if ch == '/' || ch == '\0' { '_' } else { ch })
            .collect();
        let base = if base.is_empty() || base == "." || base == ".." {
            format!("column_{i}")
        } else {
            base
        };
        let mut file = format!("{base}.npy");
        if used.contains(&file) || file.len() > NAME_MAX {
            let suffix = format!("_{i}.npy");
            let mut cut = base.len().min(NAME_MAX - suffix.len());
            while !base.is_char_boundary(cut) {
                cut -= 1;
            }
            file = format!("{}{suffix}", &base[..cut]);
        }
        used.insert(file.clone());
        c.file = Some(file);
    }
}

/// What a cached block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Part {
    Column(usize),
    Features,
}

/// Rendered blocks of every table in the process by (table, block, part), least recently
/// used first out, and their total bytes: one bound however many tables are open (each table
/// had its own 64 MiB, and 12 wide tables held 3 GB).
struct BlockCache {
    map: LruCache<(u64, usize, Part), Buffer>,
    bytes: usize,
}

/// The process's rendered-block cache.
fn block_cache() -> &'static Mutex<BlockCache> {
    static CACHE: std::sync::OnceLock<Mutex<BlockCache>> = std::sync::OnceLock::new();
    CACHE.get_or_init(|| {
        Mutex::new(BlockCache {
            map: LruCache::unbounded(),
            bytes: 0,
        })
    })
}

/// Bytes of rendered blocks held now, by every table of the process (at most [`CACHE_BYTES`]).
pub fn rendered_bytes() -> usize {
    block_cache().lock().map(|c| c.bytes).unwrap_or(0)
}

/// Tables opened in this process, for their keys in the block cache.
static TABLE_IDS: AtomicU64 = AtomicU64::new(0);

/// Work a table has done, for tests and logs: what a read cost, counted not timed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableWork {
    /// Blocks decoded (cache misses).
    pub blocks_decoded: u64,
    /// Parquet row groups (or CSV blocks) those decodes covered.
    pub units_decoded: u64,
}

/// An opened table: metadata parsed once, blocks decoded on demand.
pub struct Table {
    rel: PathBuf,
    format: TableFormat,
    rows: u64,
    columns: Vec<ColumnPlan>,
    /// First row of each block, then the row count: `blocks + 1` entries.
    block_starts: Vec<u64>,
    reader: Box<dyn BlockReader>,
    /// This table's key in the process's block cache.
    id: u64,
    /// Column index by file name.
    by_file: HashMap<String, usize>,
    /// Indices of the columns in `features.npy`.
    features: Vec<usize>,
    /// `schema.json`, rendered once.
    schema: Arc<[u8]>,
    blocks_decoded: AtomicU64,
    units_decoded: AtomicU64,
}

impl Table {
    /// Opens the table at `rel` (reads the Parquet footer, or indexes the CSV).
    pub fn open(
        src: Arc<dyn ByteSource>,
        rel: &Path,
        format: TableFormat,
    ) -> Result<Table, ViewError> {
        let (columns, block_starts, reader) = match format {
            TableFormat::Parquet => parquet::open(src, rel)?,
            TableFormat::Csv => csv::open(src, rel)?,
        };
        Table::new(rel, format, columns, block_starts, reader)
    }

    fn new(
        rel: &Path,
        format: TableFormat,
        mut columns: Vec<ColumnPlan>,
        block_starts: Vec<u64>,
        reader: Box<dyn BlockReader>,
    ) -> Result<Table, ViewError> {
        assign_files(&mut columns);
        let rows = block_starts.last().copied().unwrap_or(0);
        // Every view's size must be representable (see MAX_VIEW_BYTES), so that the npy
        // header arithmetic and every offset computed from it cannot wrap.
        let features = columns.iter().filter(|c| c.dtype.is_some()).count() as u64;
        let widest = columns
            .iter()
            .filter_map(|c| c.dtype.map(|d| d.size() as u64))
            .chain([features.saturating_mul(4)])
            .max()
            .unwrap_or(0);
        if rows.checked_mul(widest).is_none_or(|b| b > MAX_VIEW_BYTES) {
            return Err(ViewError::corrupt(
                rel,
                format!("{rows} rows of {widest} bytes make a view larger than 2^62 bytes"),
            ));
        }
        if columns.len() > MAX_COLUMNS {
            return Err(too_many_columns(rel, "schema"));
        }
        let by_file = columns
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((c.file.clone()?, i)))
            .collect();
        let features = (0..columns.len())
            .filter(|&i| columns[i].dtype.is_some())
            .collect();
        let mut t = Table {
            rel: rel.to_path_buf(),
            format,
            rows,
            columns,
            block_starts,
            reader,
            id: TABLE_IDS.fetch_add(1, Ordering::Relaxed),
            by_file,
            features,
            schema: Arc::from(Vec::new()),
            blocks_decoded: AtomicU64::new(0),
            units_decoded: AtomicU64::new(0),
        };
        t.schema = t.render_schema_json().into();
        Ok(t)
    }

    /// Bytes of memory this table's metadata holds (column plans, file names, block index,
    /// `schema.json`, the reader's footer or index): what a cache of open tables counts.
    pub fn meta_bytes(&self) -> usize {
        let plans: usize = self
            .columns
            .iter()
            .map(|c| {
                std::mem::size_of::<ColumnPlan>()
                    + c.name.len()
                    + c.skipped.as_ref().map_or(0, String::len)
                    // The file name, and its copy and slot in `by_file`.
                    + c.file.as_ref().map_or(0, |f| 2 * f.len() + 48)
            })
            .sum();
        plans
            + self.block_starts.len() * 8
            + self.features.len() * 8
            + self.schema.len()
            + self.reader.meta_bytes()
    }

    /// Blocks and source units decoded so far (cache misses), for tests and logs.
    pub fn work(&self) -> TableWork {
        TableWork {
            blocks_decoded: self.blocks_decoded.load(Ordering::Relaxed),
            units_decoded: self.units_decoded.load(Ordering::Relaxed),
        }
    }

    /// Number of blocks (Parquet: runs of row groups; CSV: runs of records).
    pub fn blocks(&self) -> usize {
        self.block_starts.len().saturating_sub(1)
    }

    /// Number of rows.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// The columns, in source order.
    pub fn columns(&self) -> &[ColumnPlan] {
        &self.columns
    }

    fn feature_cols(&self) -> &[usize] {
        &self.features
    }

    fn column_header(&self, c: usize) -> Option<NpyHeader> {
        Some(NpyHeader::new(self.columns[c].dtype?, vec![self.rows]))
    }

    fn features_header(&self) -> NpyHeader {
        NpyHeader::new(
            DType::F32,
            vec![self.rows, self.feature_cols().len() as u64],
        )
    }

    /// `schema.json`: rows, and per column its name, dtype and file or why it was skipped.
    pub fn schema_json(&self) -> Vec<u8> {
        self.schema.to_vec()
    }

    fn render_schema_json(&self) -> Vec<u8> {
        let cols: Vec<serde_json::Value> = self
            .columns
            .iter()
            .map(|c| match (&c.file, c.dtype) {
                (Some(file), Some(dtype)) => json!({
                    "name": c.name, "source_type": c.source_type.to_string(), "nulls": c.nulls,
                    "dtype": dtype.name(), "file": file,
                }),
                _ => json!({
                    "name": c.name, "source_type": c.source_type.to_string(), "nulls": c.nulls,
                    "skipped": c.skipped.clone().unwrap_or_default(),
                }),
            })
            .collect();
        let features: Vec<&str> = self
            .feature_cols()
            .iter()
            .map(|&i| self.columns[i].name.as_str())
            .collect();
        let doc = json!({
            "source": self.rel.to_string_lossy(),
            "format": match self.format { TableFormat::Parquet => "parquet", TableFormat::Csv => "csv" },
            "rows": self.rows,
            "columns": cols,
            "features": { "file": FEATURES, "dtype": "float32", "columns": features },
        });
        let mut out = serde_json::to_vec_pretty(&doc).unwrap_or_default();
        out.push(b'\n');
        out
    }

    /// The files of the table's directory with their sizes, in listing order.
    pub fn entries(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (i, c) in self.columns.iter().enumerate() {
            if let (Some(file), Some(h)) = (&c.file, self.column_header(i)) {
                out.push((file.clone(), h.file_len()));
            }
        }
        out.push((FEATURES.to_string(), self.features_header().file_len()));
        out.push((SCHEMA.to_string(), self.schema.len() as u64));
        out
    }

    /// The view of file `name` of this table's directory.
    pub fn view(self: &Arc<Self>, name: &str) -> Option<Arc<dyn View>> {
        if name == SCHEMA {
            return Some(Arc::new(BytesView::new(self.schema_json())));
        }
        if name == FEATURES {
            let header = self.features_header();
            return Some(Arc::new(TableView::new(
                self.clone(),
                Part::Features,
                header,
            )));
        }
        let c = *self.by_file.get(name)?;
        let header = self.column_header(c)?;
        Some(Arc::new(TableView::new(
            self.clone(),
            Part::Column(c),
            header,
        )))
    }

    fn corrupt(&self, reason: impl ToString) -> ViewError {
        ViewError::corrupt(&self.rel, reason)
    }

    /// Rendered bytes of `part` for block `b`, from the cache or decoded now.
    fn block(&self, b: usize, part: Part) -> Result<Buffer, ViewError> {
        if let Ok(mut cache) = block_cache().lock() {
            if let Some(v) = cache.map.get(&(self.id, b, part)) {
                return Ok(v.clone());
            }
        }
        self.blocks_decoded.fetch_add(1, Ordering::Relaxed);
        self.units_decoded
            .fetch_add(self.reader.units(b), Ordering::Relaxed);
        let rows = usize::try_from(self.block_starts[b + 1] - self.block_starts[b])
            .map_err(|_| self.corrupt(format!("block {b} has too many rows")))?;
        let bytes = match part {
            Part::Column(c) => {
                let dtype = self.columns[c]
                    .dtype
                    .ok_or_else(|| self.corrupt("internal: skipped column"))?;
                let arrays = self
                    .reader
                    .read_block(b, &[c])
                    .map_err(|e| self.corrupt(e))?;
                let arr = arrays
                    .first()
                    .ok_or_else(|| self.corrupt("block has no column"))?;
                if arr.len() != rows {
                    return Err(self.corrupt(format!(
                        "row group {b} has {} rows, metadata says {rows}",
                        arr.len()
                    )));
                }
                column_bytes(arr, dtype).map_err(|e| self.corrupt(e))?
            }
            Part::Features => {
                let cols = self.feature_cols();
                let arrays = if cols.is_empty() {
                    Vec::new()
                } else {
                    self.reader
                        .read_block(b, cols)
                        .map_err(|e| self.corrupt(e))?
                };
                features_bytes(&arrays, rows).map_err(|e| self.corrupt(e))?
            }
        };
        if let Ok(mut cache) = block_cache().lock() {
            if let Some(old) = cache.map.put((self.id, b, part), bytes.clone()) {
                cache.bytes -= old.len();
            }
            cache.bytes += bytes.len();
            while cache.bytes > CACHE_BYTES || cache.map.len() > CACHE_BLOCKS {
                let Some((_, old)) = cache.map.pop_lru() else {
                    break;
                };
                cache.bytes -= old.len();
            }
        }
        Ok(bytes)
    }

    /// Renders rows `[first, first + n)` of `part` (`row_bytes` each) into `out`.
    fn fill(
        &self,
        part: Part,
        row_bytes: u64,
        first: u64,
        n: u64,
        out: &mut [u8],
    ) -> Result<(), ViewError> {
        let mut row = first;
        let end = first + n;
        let mut pos = 0usize;
        while row < end {
            // Block containing `row`: the last start <= row.
            let b = self
                .block_starts
                .partition_point(|&s| s <= row)
                .saturating_sub(1);
            let (bs, be) = (self.block_starts[b], self.block_starts[b + 1]);
            let rendered = self.block(b, part)?;
            let take = be.min(end) - row;
            // In range: rows * row_bytes <= MAX_VIEW_BYTES was checked at open, and `out`
            // holds n rows.
            let from = usize::try_from((row - bs) * row_bytes)
                .map_err(|_| self.corrupt("block too large for this machine"))?;
            let len = usize::try_from(take * row_bytes)
                .map_err(|_| self.corrupt("block too large for this machine"))?;
            let src = rendered
                .as_slice()
                .get(from..from + len)
                .ok_or_else(|| self.corrupt("block shorter than its rows"))?;
            let dst = out
                .get_mut(pos..pos + len)
                .ok_or_else(|| self.corrupt("internal: read past the caller's buffer"))?;
            dst.copy_from_slice(src);
            pos += len;
            row += take;
        }
        Ok(())
    }
}

/// One file of a table directory: `<column>.npy` or `features.npy`.
struct TableView {
    table: Arc<Table>,
    part: Part,
    header: NpyHeader,
    header_bytes: Vec<u8>,
}

impl TableView {
    fn new(table: Arc<Table>, part: Part, header: NpyHeader) -> Self {
        let header_bytes = header.encode();
        TableView {
            table,
            part,
            header,
            header_bytes,
        }
    }

    fn row_bytes(&self) -> u64 {
        self.header.row_bytes()
    }
}

impl View for TableView {
    fn len(&self) -> u64 {
        self.header.file_len()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize, ViewError> {
        let row_bytes = self.row_bytes();
        read_rows(
            &self.header_bytes,
            row_bytes,
            self.table.rows,
            offset,
            buf,
            &|first, n, out| self.table.fill(self.part, row_bytes, first, n, out),
        )
    }

    fn chunk_len(&self) -> u64 {
        // One average block of rows, at least 64 KiB.
        let blocks = (self.table.block_starts.len().max(2) - 1) as u64;
        (self.table.rows / blocks * self.row_bytes()).max(64 << 10)
    }
}

/// A zeroed byte vector of `len`, or an error instead of an abort when memory is short.
fn alloc_bytes(len: usize) -> Result<Vec<u8>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| format!("cannot allocate {len} bytes"))?;
    v.resize(len, 0);
    Ok(v)
}

/// Unpacks Arrow's LSB-first bits into one byte (0 or 1) per value.
fn unpack_bools(bits: &arrow::buffer::BooleanBuffer) -> Result<Vec<u8>, String> {
    // Eight values at a time: each input byte becomes eight output bytes via a table.
    const SPREAD: [u64; 256] = {
        let mut t = [0u64; 256];
        let mut i = 0;
        while i < 256 {
            let mut v = 0u64;
            let mut bit = 0;
            while bit < 8 {
                if i & (1 << bit) != 0 {
                    v |= 1 << (8 * bit);
                }
                bit += 1;
            }
            t[i] = v;
            i += 1;
        }
        t
    };
    let len = bits.len();
    let mut out = alloc_bytes(len)?;
    let chunks = bits.bit_chunks();
    let mut pos = 0;
    for word in chunks.iter() {
        for (k, byte) in word.to_le_bytes().iter().enumerate() {
            let at = pos + 8 * k;
            out[at..at + 8].copy_from_slice(&SPREAD[*byte as usize].to_le_bytes());
        }
        pos += 64;
    }
    let rem = chunks.remainder_bits();
    for k in 0..chunks.remainder_len() {
        out[pos + k] = ((rem >> k) & 1) as u8;
    }
    Ok(out)
}

/// Little-endian bytes of `arr` as `dtype`; nulls become NaN (floats) or 0. Without nulls
/// and without a cast this is the array's own values buffer (no copy).
fn column_bytes(arr: &ArrayRef, dtype: DType) -> Result<Buffer, String> {
    let target = arrow_type(dtype);
    let arr = if arr.data_type() == &target {
        arr.clone()
    } else {
        cast(arr, &target).map_err(|e| format!("cannot convert to {}: {e}", dtype.name()))?
    };
    let nulls = arr.nulls().filter(|n| n.null_count() > 0).cloned();
    if dtype == DType::Bool {
        let bools = arr.as_boolean();
        let mut out = unpack_bools(bools.values())?;
        if let Some(n) = &nulls {
            for i in (0..arr.len()).filter(|&i| n.is_null(i)) {
                out[i] = 0;
            }
        }
        return Ok(Buffer::from_vec(out));
    }
    // The values buffer, already offset to the array's first element.
    let values = arr.to_data().buffers()[0].clone();
    let size = dtype.size();
    let values = values.slice_with_length(arr.offset() * size, arr.len() * size);
    let Some(nulls) = nulls else {
        return Ok(values);
    };
    let fill: &[u8] = match dtype {
        DType::F16 => &[0x00, 0x7E],
        DType::F32 => &f32::NAN.to_le_bytes(),
        DType::F64 => &f64::NAN.to_le_bytes(),
        DType::Bool | DType::I8 | DType::U8 => &[0],
        DType::I16 | DType::U16 => &[0; 2],
        DType::I32 | DType::U32 => &[0; 4],
        DType::I64 | DType::U64 => &[0; 8],
    };
    let mut out = alloc_bytes(values.len())?;
    out.copy_from_slice(values.as_slice());
    for i in (0..arr.len()).filter(|&i| nulls.is_null(i)) {
        out[i * size..(i + 1) * size].copy_from_slice(fill);
    }
    Ok(Buffer::from_vec(out))
}

/// Row-major float32 bytes of `arrays` (all `rows` long); nulls become NaN.
fn features_bytes(arrays: &[ArrayRef], rows: usize) -> Result<Buffer, String> {
    let k = arrays.len();
    let len = rows
        .checked_mul(k)
        .and_then(|n| n.checked_mul(4))
        .ok_or("features block too large")?;
    let mut out = alloc_bytes(len)?;
    for (j, arr) in arrays.iter().enumerate() {
        if arr.len() != rows {
            return Err(format!("column has {} rows, expected {rows}", arr.len()));
        }
        let f =
            cast(arr, &DataType::Float32).map_err(|e| format!("cannot convert to float32: {e}"))?;
        let f = f.as_primitive::<Float32Type>();
        let values = f.values();
        let nulls = f.nulls().filter(|n| n.null_count() > 0);
        for r in 0..rows {
            let v = match nulls {
                Some(n) if n.is_null(r) => f32::NAN,
                _ => values[r],
            };
            let at = (r * k + j) * 4;
            out[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
    }
    Ok(Buffer::from_vec(out))
}

fn arrow_type(dtype: DType) -> DataType {
    match dtype {
        DType::Bool => DataType::Boolean,
        DType::I8 => DataType::Int8,
        DType::I16 => DataType::Int16,
        DType::I32 => DataType::Int32,
        DType::I64 => DataType::Int64,
        DType::U8 => DataType::UInt8,
        DType::U16 => DataType::UInt16,
        DType::U32 => DataType::UInt32,
        DType::U64 => DataType::UInt64,
        DType::F16 => DataType::Float16,
        DType::F32 => DataType::Float32,
        DType::F64 => DataType::Float64,
    }
}
