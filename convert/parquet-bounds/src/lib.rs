//! Memory bounds for decoding untrusted Parquet files, shared by the mount's table views and
//! the cleaning job (`convert --to parquet`); `convert --to npy` renders through the views.
//!
//! The parquet crate allocates a page's buffers from what the page's header declares: a file
//! under 1 KB whose dictionary pages each claimed 2 GiB uncompressed (a few bytes of snappy)
//! made a reader allocate gigabytes per column, and the kernel killed the daemon. So before
//! any row group is decoded, [`scan_chunk`] walks the page headers of every column chunk the
//! decode will read ([`header`], a decoder that does no I/O) and checks each page:
//! - its declared uncompressed size against [`MAX_PAGE_BYTES`];
//! - against its value count × the column's value width, where the physical type fixes a
//!   width (a dictionary of 2 eight-byte values cannot take 2 GiB);
//! - and that it lies inside its column chunk.
//!
//! The buffers the decode will hold at once — per column, its dictionary (compressed and
//! decoded) and its largest page — are then reserved from one process-wide [`budget`]
//! before the decode starts. A decode that cannot get them fails with a reason, which the
//! mount answers with EIO and logs; the process never allocates them.
//!
//! Two small pieces both table readers share ride along, as this is the one crate below both:
//! [`csv_header`], the bounded count of a CSV header's fields (the CSV counterpart of the
//! page checks), and [`read_at`], the positioned read that stops short only at end of file.

pub mod budget;
pub mod csv_header;
pub mod header;
pub mod read_at;
pub mod testing;

use std::ops::Range;

use bytes::Bytes;
use parquet::basic::Type as Physical;
use parquet::file::metadata::{ColumnChunkMetaData, ParquetMetaData};
use parquet::schema::types::ColumnDescriptor;

pub use budget::{MemoryBudget, OverBudget, Reservation};
pub use csv_header::HeaderFields;
use header::{HeaderError, PageKind};
pub use read_at::read_full_at;

/// Largest uncompressed page accepted: 256 MiB. Every current writer cuts pages at about
/// 1 MiB (pyarrow, arrow-rs, parquet-mr, Spark, polars, DuckDB); old writers that put a whole
/// column chunk in one page stay under this for row groups of up to 32 Mi eight-byte values.
/// The 2 GiB pages of a bomb, honest or not, are refused.
pub const MAX_PAGE_BYTES: u64 = 256 << 20;

/// Largest page header accepted: 1 MiB. Headers are tens of bytes; statistics of long strings
/// make them longer, and a header is parsed whole from memory.
pub const MAX_HEADER_BYTES: usize = 1 << 20;

/// Bytes first read for a page header outside a chunk in memory: a header is tens of bytes,
/// so one 4 KiB read covers nearly all (grown ×16 up to [`MAX_HEADER_BYTES`] when not).
const HEADER_WINDOW: usize = 4 << 10;

/// Fixed slack of the values × width check: level and run headers of a small page.
const PAGE_SLACK: u64 = 4 << 10;

/// Most bytes a data page may take per value beyond the value's width: definition and
/// repetition levels in runs of one (2 bytes each) and a dictionary index in a run of one
/// (a header byte and up to 4 bytes).
const PER_VALUE_OVERHEAD: u64 = 9;

/// The bytes of a fixed-width value of `col`, or `None` (byte arrays: any length).
pub fn value_width(col: &ColumnDescriptor) -> Option<u64> {
    match col.physical_type() {
        Physical::BOOLEAN => Some(1),
        Physical::INT32 | Physical::FLOAT => Some(4),
        Physical::INT64 | Physical::DOUBLE => Some(8),
        Physical::INT96 => Some(12),
        Physical::FIXED_LEN_BYTE_ARRAY => u64::try_from(col.type_length()).ok(),
        Physical::BYTE_ARRAY => None,
    }
}

/// What decoding one column chunk holds in memory at once, as its page headers declare.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ChunkCost {
    /// The dictionary page's uncompressed size (0 without one).
    pub dictionary: u64,
    /// The largest data page's uncompressed size.
    pub largest_page: u64,
    /// Pages seen.
    pub pages: u64,
}

impl ChunkCost {
    /// Bytes to reserve: the dictionary twice (its buffer and its decoded values) and one page.
    pub fn bytes(&self) -> u64 {
        self.dictionary
            .saturating_mul(2)
            .saturating_add(self.largest_page)
    }
}

/// Reads `len` bytes at a file offset (fewer only at the end of the file).
pub type ReadAt<'r> = dyn FnMut(u64, usize) -> Result<Bytes, String> + 'r;

/// Walks the page headers of the column chunk `chunk` (of a column of values `width` bytes
/// wide, if fixed) and checks each page; see the module notes. `read` gives the file's bytes.
pub fn scan_chunk(
    chunk: &ColumnChunkMetaData,
    width: Option<u64>,
    read: &mut ReadAt<'_>,
) -> Result<ChunkCost, String> {
    let start = chunk
        .dictionary_page_offset()
        .unwrap_or(chunk.data_page_offset());
    let (Ok(start), Ok(len)) = (u64::try_from(start), u64::try_from(chunk.compressed_size()))
    else {
        return Err("a column chunk at a negative offset or of negative size".into());
    };
    let end = start
        .checked_add(len)
        .ok_or("a column chunk past the largest offset")?;
    // Every page header up to the chunk's end: the parquet crate's page reader reads headers
    // until the chunk's bytes run out, not until it has the chunk's values (a header past the
    // values, unchecked, held a list of 2^31 doubles that its Thrift skipper walked at the end
    // of the input for minutes: a fuzzed 347-byte file).
    let want_values = u64::try_from(chunk.num_values()).unwrap_or(0);
    let mut cost = ChunkCost::default();
    let (mut at, mut values) = (start, 0u64);
    while at < end {
        let page = cost.pages;
        let (h, header_len) =
            read_header(at, end, read).map_err(|e| format!("page {page}: {e}"))?;
        let body = u64::try_from(h.compressed).unwrap_or(u64::MAX);
        let next = at
            .checked_add(header_len as u64)
            .and_then(|a| a.checked_add(body))
            .filter(|&n| n <= end)
            .ok_or_else(|| {
                format!("page {page}: its {body} bytes run past the end of its column chunk")
            })?;
        let size = u64::try_from(h.uncompressed).unwrap_or(u64::MAX);
        if size > MAX_PAGE_BYTES {
            return Err(format!(
                "page {page} claims {size} bytes uncompressed, more than the {} MiB a page may \
                 have (writers cut pages at about 1 MiB: rewrite the file with a current writer)",
                MAX_PAGE_BYTES >> 20
            ));
        }
        let n = h.num_values;
        match h.kind {
            PageKind::Dictionary | PageKind::Data | PageKind::DataV2 => {
                let n = n.ok_or_else(|| format!("page {page} has no value count"))?;
                let n = u64::try_from(n).unwrap_or(0);
                let dict = h.kind == PageKind::Dictionary;
                if let Some(w) = width {
                    let per_value = if dict {
                        w
                    } else {
                        w.max(5).saturating_add(PER_VALUE_OVERHEAD)
                    };
                    let most = n.saturating_mul(per_value).saturating_add(PAGE_SLACK);
                    if size > most {
                        return Err(format!(
                            "page {page} claims {size} bytes uncompressed for {n} values of \
                             {w} bytes (at most {most})"
                        ));
                    }
                }
                if dict {
                    cost.dictionary = cost.dictionary.max(size);
                } else {
                    values = values.saturating_add(n);
                    cost.largest_page = cost.largest_page.max(size);
                }
            }
            // Skipped by the reader: read past, never decoded.
            PageKind::Index | PageKind::Other(_) => {}
        }
        cost.pages += 1;
        at = next;
    }
    // Pages holding fewer values than the footer claims: the reader would go on reading
    // "pages" past the chunk's end, out of whatever bytes follow.
    if values < want_values {
        return Err(format!(
            "its pages hold {values} values, the footer claims {want_values}"
        ));
    }
    Ok(cost)
}

/// Reads and decodes the page header at `at` (before `end`, its chunk's end).
fn read_header(
    at: u64,
    end: u64,
    read: &mut ReadAt<'_>,
) -> Result<(header::PageHeader, usize), String> {
    let left = usize::try_from(end - at).unwrap_or(usize::MAX);
    let mut window = HEADER_WINDOW.min(left);
    loop {
        let bytes = read(at, window)?;
        match header::parse(&bytes) {
            Ok(h) => return Ok(h),
            Err(HeaderError::Incomplete) if bytes.len() == window && window < left => {
                if window >= MAX_HEADER_BYTES {
                    return Err(format!(
                        "a page header of more than {} KiB",
                        MAX_HEADER_BYTES >> 10
                    ));
                }
                window = (window * 16).min(left).min(MAX_HEADER_BYTES);
            }
            Err(HeaderError::Incomplete) => {
                return Err("a page header cut off by the end of its column chunk".into())
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The bytes a decode of leaf columns `leaves` over row groups `groups` of `md` holds at once:
/// for each column the costliest of its chunks, summed over the columns (a reader holds one
/// page and one dictionary per column, one row group after another). Every page of those
/// chunks is checked on the way ([`scan_chunk`]).
pub fn decode_cost(
    md: &ParquetMetaData,
    groups: Range<usize>,
    leaves: &[usize],
    read: &mut ReadAt<'_>,
) -> Result<u64, String> {
    let descr = md.file_metadata().schema_descr();
    let mut total = 0u64;
    for &leaf in leaves {
        if leaf >= descr.num_columns() {
            return Err(format!("no leaf column {leaf}"));
        }
        let width = value_width(&descr.column(leaf));
        let mut most = 0u64;
        for rg in groups.clone() {
            let Some(chunk) = md.row_groups().get(rg).and_then(|g| g.columns().get(leaf)) else {
                return Err(format!("row group {rg} has no column {leaf}"));
            };
            let cost = scan_chunk(chunk, width, read).map_err(|e| {
                format!("row group {rg}, column {}: {e}", descr.column(leaf).path())
            })?;
            most = most.max(cost.bytes());
        }
        total = total.saturating_add(most);
    }
    Ok(total)
}

/// The leaf columns under root columns `roots` of `md`'s schema.
pub fn leaves_of(md: &ParquetMetaData, roots: &[usize]) -> Vec<usize> {
    let descr = md.file_metadata().schema_descr();
    (0..descr.num_columns())
        .filter(|&l| roots.contains(&descr.get_column_root_idx(l)))
        .collect()
}

/// Checks and reserves, from the process's budget, what decoding root columns `roots` over
/// row groups `groups` of `md` holds at once. `what` names the decode in the error.
pub fn reserve_decode(
    md: &ParquetMetaData,
    groups: Range<usize>,
    roots: &[usize],
    what: &str,
    read: &mut ReadAt<'_>,
) -> Result<Reservation<'static>, String> {
    let leaves = leaves_of(md, roots);
    let need = decode_cost(md, groups, &leaves, read)?;
    budget::global()
        .reserve(need, what, budget::WAIT)
        .map_err(|e| e.to_string())
}
