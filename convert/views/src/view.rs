//! The [`View`] abstraction: a virtual file whose size is known up front and any byte range of
//! which is rendered on demand, plus the options and small helpers every view shares.

use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use crate::error::ViewError;
use crate::image::DecodeSettings;

/// Default [`View::render_unit`]: 1 MiB-aligned blocks, the mount's cache block size.
pub const DEFAULT_RENDER_UNIT: u64 = 1 << 20;

/// Called with (source path, reason) for every corrupt or unsupported input a view meets.
pub type BadInputHook = Arc<dyn Fn(&Path, &str) + Send + Sync>;

/// A virtual file: exact size up front, any byte range rendered on demand.
pub trait View: Send + Sync {
    /// Size in bytes; never changes for the life of the view.
    fn len(&self) -> u64;
    /// Fills `buf` with the bytes at `offset`; returns fewer than `buf.len()` only at end of file.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize, ViewError>;
    /// Natural render granularity in bytes (e.g. a few image slots or one row group), so the
    /// caller can cache rendered chunks of this size.
    fn chunk_len(&self) -> u64;
    /// The natural render unit containing byte `offset`: the smallest range that is rendered
    /// as a whole anyway (one image slot of `images.npy`, its header on its own), so the mount
    /// can render and cache by unit and a random read decodes only what it touches. Empty at
    /// or past the end. Default: the 1 MiB-aligned block holding `offset`.
    fn render_unit(&self, offset: u64) -> Range<u64> {
        let len = self.len();
        if offset >= len {
            return len..len;
        }
        let start = offset - offset % DEFAULT_RENDER_UNIT;
        start..(start + DEFAULT_RENDER_UNIT).min(len)
    }
    /// Calls `each` with every source file (relative to the source root) that rendering the
    /// bytes in `range` reads, each read whole, so a node's declared part of a view can be
    /// staged from the source before it is read. Default: none (a table's view reads parts of
    /// one file, which is staged with the tree).
    fn sources(&self, _range: Range<u64>, _each: &mut dyn FnMut(&Path)) {}
    /// True for a zero-length view.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How views are rendered.
#[derive(Clone)]
pub struct ViewOptions {
    /// Side S of the S×S image crops.
    pub image_size: u32,
    /// A corrupt image fails the read ([`ViewError::Corrupt`]) instead of reading as zeros.
    pub strict: bool,
    /// Told about every corrupt or unsupported input (images and tables).
    pub on_bad: Option<BadInputHook>,
    /// How images are decoded: fast or exact mode, pixel cap, the shared decode budget.
    pub decode: DecodeSettings,
    /// Bytes of table metadata a [`ViewSet`](crate::ViewSet) keeps parsed (least recently
    /// used tables out first); [`DEFAULT_TABLE_META_BYTES`] by default.
    pub table_meta_bytes: usize,
}

/// Table metadata a view set keeps parsed, by default: 256 MiB, a hundred tables of a
/// thousand columns or two of 10^5 columns; past it the least recently used table is dropped
/// and parsed again when next used (its rendered blocks are bounded apart, see
/// [`crate::table::CACHE_BYTES`]).
pub const DEFAULT_TABLE_META_BYTES: usize = 256 << 20;

/// Default side S of image crops (torchvision's usual 224).
pub const DEFAULT_IMAGE_SIZE: u32 = 224;

/// Largest side S accepted (`--image-size`): one slot is then 3·S² = 192 MiB.
pub const MAX_IMAGE_SIZE: u32 = 8192;

impl Default for ViewOptions {
    fn default() -> Self {
        ViewOptions {
            image_size: DEFAULT_IMAGE_SIZE,
            strict: false,
            on_bad: None,
            decode: DecodeSettings::default(),
            table_meta_bytes: DEFAULT_TABLE_META_BYTES,
        }
    }
}

/// Checks an `--image-size` value: 1..=[`MAX_IMAGE_SIZE`].
pub fn check_image_size(size: u64) -> Result<u32, String> {
    match u32::try_from(size) {
        Ok(s) if (1..=MAX_IMAGE_SIZE).contains(&s) => Ok(s),
        _ => Err(format!(
            "image size {size} is out of range: S must be 1..={MAX_IMAGE_SIZE} (slots are S×S×3 bytes)"
        )),
    }
}

impl fmt::Debug for ViewOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ViewOptions")
            .field("image_size", &self.image_size)
            .field("strict", &self.strict)
            .field("on_bad", &self.on_bad.is_some())
            .field("decode", &self.decode)
            .field("table_meta_bytes", &self.table_meta_bytes)
            .finish()
    }
}

impl ViewOptions {
    /// Reports a bad input to the hook, if any.
    pub fn report_bad(&self, path: &Path, reason: &str) {
        if let Some(hook) = &self.on_bad {
            hook(path, reason);
        }
    }
}

/// A small view held entirely in memory (headers, labels, text listings, schema.json).
#[derive(Clone, Debug)]
pub struct BytesView {
    bytes: Arc<[u8]>,
}

impl BytesView {
    /// A view of `bytes`.
    pub fn new(bytes: Vec<u8>) -> Self {
        BytesView {
            bytes: bytes.into(),
        }
    }
}

impl View for BytesView {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize, ViewError> {
        Ok(copy_from(&self.bytes, offset, buf))
    }

    fn chunk_len(&self) -> u64 {
        self.bytes.len().max(1) as u64
    }
}

/// Copies `data[offset..]` into `buf` as far as both go; returns the bytes copied.
pub(crate) fn copy_from(data: &[u8], offset: u64, buf: &mut [u8]) -> usize {
    let Ok(start) = usize::try_from(offset) else {
        return 0;
    };
    if start >= data.len() {
        return 0;
    }
    let n = buf.len().min(data.len() - start);
    buf[..n].copy_from_slice(&data[start..start + n]);
    n
}

/// Renders rows `[first, first + n)` into a buffer of exactly `n` rows.
pub(crate) type RowFill<'a> = dyn Fn(u64, u64, &mut [u8]) -> Result<(), ViewError> + 'a;

/// Renders `[offset, offset + buf.len())` of a `.npy` file made of `header` followed by
/// `rows` fixed-size records of `row_bytes`, calling `fill(first_row, out)` for aligned runs of
/// whole rows that `out` receives. Partial rows at either end are rendered into a scratch row.
pub(crate) fn read_rows(
    header: &[u8],
    row_bytes: u64,
    rows: u64,
    offset: u64,
    buf: &mut [u8],
    fill: &RowFill<'_>,
) -> Result<usize, ViewError> {
    let total = header.len() as u64 + row_bytes * rows;
    if offset >= total || buf.is_empty() {
        return Ok(0);
    }
    let want = (buf.len() as u64).min(total - offset) as usize;
    let buf = &mut buf[..want];
    let mut pos = 0usize; // bytes of buf done
    let mut off = offset;
    if off < header.len() as u64 {
        pos = copy_from(header, off, buf);
        off += pos as u64;
    }
    if pos == want || row_bytes == 0 {
        return Ok(want);
    }
    let data_off = off - header.len() as u64;
    let mut row = data_off / row_bytes;
    let within = data_off % row_bytes;
    // A partial first row.
    if within != 0 {
        let mut scratch = vec![0u8; row_bytes as usize];
        fill(row, 1, &mut scratch)?;
        let n = copy_from(&scratch, within, &mut buf[pos..]);
        pos += n;
        row += 1;
    }
    // Whole rows straight into the caller's buffer.
    let whole = ((want - pos) as u64) / row_bytes;
    if whole > 0 {
        let end = pos + (whole * row_bytes) as usize;
        fill(row, whole, &mut buf[pos..end])?;
        pos = end;
        row += whole;
    }
    // A partial last row.
    if pos < want {
        let mut scratch = vec![0u8; row_bytes as usize];
        fill(row, 1, &mut scratch)?;
        let n = want - pos;
        buf[pos..].copy_from_slice(&scratch[..n]);
        pos = want;
    }
    Ok(pos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_rows_matches_flat_rendering() {
        let header = vec![7u8; 64];
        let rows = 9u64;
        let row_bytes = 5u64;
        let fill = |first: u64, n: u64, out: &mut [u8]| -> Result<(), ViewError> {
            assert_eq!(out.len() as u64, n * row_bytes);
            for (i, b) in out.iter_mut().enumerate() {
                *b = (first * row_bytes + i as u64) as u8;
            }
            Ok(())
        };
        let mut flat = header.clone();
        flat.extend((0..rows * row_bytes).map(|i| i as u8));
        for off in 0..flat.len() as u64 + 3 {
            for len in [0usize, 1, 3, 5, 7, 64, 200] {
                let mut buf = vec![0u8; len];
                let n = read_rows(&header, row_bytes, rows, off, &mut buf, &fill).unwrap();
                let expect = copy_from(&flat, off, &mut vec![0u8; len]);
                assert_eq!(n, expect);
                if n > 0 {
                    assert_eq!(&buf[..n], &flat[off as usize..off as usize + n]);
                }
            }
        }
    }
}
