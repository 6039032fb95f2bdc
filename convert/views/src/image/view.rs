//! The image folder's files. `images.npy` has its exact size from the sample count alone; each
//! slot (one S×S×3 image) is decoded when a read touches it, through the [`ByteSource`], so
//! nothing is decoded before it is read.
//!
//! Random access: [`View::render_unit`] of an offset is the one slot holding it (the `.npy`
//! header is a unit of its own), so a reader that wants one image costs one decode. Reads that
//! cut a slot (a caller's block boundary rarely falls on one, the header shifts them) render
//! that slot into a scratch buffer; the last [`PARTIAL_SLOTS`] such slots are kept so that the
//! two blocks sharing a slot decode it once.
//!
//! `files.txt` and `classes.txt` hold the names' exact bytes, one per line (names containing a
//! newline are never samples, see `tree`), so distinct names never collide: a non-UTF-8 name
//! reads back in Python with `errors="surrogateescape"` equal to what `os.listdir` returns.

use std::cell::RefCell;
use std::collections::{HashSet, VecDeque};
use std::ops::Range;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::ViewError;
use crate::source::{read_all_into, ByteSource};
use crate::tree::ImageFolder;
use crate::view::{read_rows, BytesView, View, ViewOptions};
use stagefs_npy::{DType, NpyHeader};

/// Partially read slots kept per view: enough for the boundaries of the chunks a few dozen
/// reader threads have in flight.
const PARTIAL_SLOTS: usize = 32;

/// Image slots per [`View::chunk_len`]: 8 slots (1.2 MB at S=224) amortise the boundary slot
/// and match typical FUSE read-ahead sizes.
const SLOTS_PER_CHUNK: u64 = 8;

/// Largest image file read (bytes): bigger files are reported as unsupported. A file is read
/// whole before decoding; 256 MiB holds any real photograph or an 8192² PNG of noise.
const MAX_FILE_BYTES: u64 = 256 << 20;

/// File buffers larger than this are freed after the image rather than kept for the next.
const RETAIN_FILE_BYTES: usize = 1 << 20;

thread_local! {
    /// One file buffer per thread, reused from image to image.
    static FILE_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// `images.npy` of one image folder.
pub struct ImagesView {
    src: Arc<dyn ByteSource>,
    folder: Arc<ImageFolder>,
    opts: ViewOptions,
    header: Vec<u8>,
    slot_bytes: u64,
    partial: Mutex<VecDeque<(u64, Arc<Vec<u8>>)>>,
    reported: Mutex<HashSet<u64>>,
}

impl ImagesView {
    /// The view of `folder`'s images at `opts.image_size`.
    pub fn new(src: Arc<dyn ByteSource>, folder: Arc<ImageFolder>, opts: ViewOptions) -> Self {
        let s = u64::from(opts.image_size);
        let header = NpyHeader::new(DType::U8, vec![folder.samples.len() as u64, s, s, 3]).encode();
        ImagesView {
            src,
            folder,
            opts,
            header,
            slot_bytes: s * s * 3,
            partial: Mutex::new(VecDeque::new()),
            reported: Mutex::new(HashSet::new()),
        }
    }

    /// Source path of sample `i`, relative to the dataset root.
    fn source_path(&self, i: u64) -> Option<PathBuf> {
        let (p, _) = self.folder.samples.get(i as usize)?;
        Some(self.folder.rel.join(p))
    }

    /// Renders sample `i` into `out` (`slot_bytes` long): pixels, or zeros for a bad image.
    fn render_slot(&self, i: u64, out: &mut [u8]) -> Result<(), ViewError> {
        let Some(path) = self.source_path(i) else {
            return Err(ViewError::NotFound(PathBuf::from(format!(
                "images.npy slot {i}"
            ))));
        };
        let _span = tracing::debug_span!("decode", path = %path.display()).entered();
        let result = FILE_BUF.with(|cell| {
            let mut buf = cell.borrow_mut();
            let result = match read_all_into(self.src.as_ref(), &path, MAX_FILE_BYTES, &mut buf) {
                Ok(()) => {
                    super::decode::render_with(&buf, self.opts.image_size, &self.opts.decode, out)
                        .map_err(SlotError::Bad)
                }
                Err(e) if is_bad_input(&e) => Err(SlotError::Bad(e.to_string())),
                Err(e) => Err(SlotError::Io(e)),
            };
            if buf.capacity() > RETAIN_FILE_BYTES {
                *buf = Vec::new();
            }
            result
        });
        match result {
            Ok(()) => Ok(()),
            Err(SlotError::Bad(reason)) => self.bad(i, &path, reason, out),
            // The mount passes the source's errno on; the slot is not "bad", just unreadable now.
            Err(SlotError::Io(e)) => Err(ViewError::Io(e)),
        }
    }

    fn bad(&self, i: u64, path: &Path, reason: String, out: &mut [u8]) -> Result<(), ViewError> {
        let first = self
            .reported
            .lock()
            .map(|mut r| r.insert(i))
            .unwrap_or(true);
        if first {
            self.opts.report_bad(path, &reason);
        }
        if self.opts.strict {
            return Err(ViewError::corrupt(path, reason));
        }
        out.fill(0);
        Ok(())
    }

    /// Renders `n` slots from `first` into `out`, using the partial-slot cache for single slots.
    fn fill(&self, first: u64, n: u64, out: &mut [u8]) -> Result<(), ViewError> {
        if n == 1 && out.len() as u64 == self.slot_bytes {
            if let Some(hit) = self.cached(first) {
                out.copy_from_slice(&hit);
                return Ok(());
            }
            self.render_slot(first, out)?;
            if let Ok(mut cache) = self.partial.lock() {
                if cache.len() >= PARTIAL_SLOTS {
                    cache.pop_front();
                }
                cache.push_back((first, Arc::new(out.to_vec())));
            }
            return Ok(());
        }
        for (k, slot) in out.chunks_exact_mut(self.slot_bytes as usize).enumerate() {
            self.render_slot(first + k as u64, slot)?;
        }
        Ok(())
    }

    fn cached(&self, i: u64) -> Option<Arc<Vec<u8>>> {
        let cache = self.partial.lock().ok()?;
        cache.iter().find(|(k, _)| *k == i).map(|(_, v)| v.clone())
    }
}

/// ENAMETOOLONG on Linux (the crate has no libc dependency).
const ENAMETOOLONG: i32 = 36;

/// Read errors that are the input's fault and will not go away on a retry: an oversized file,
/// a file that is unreadable (another user's 0600), gone or has a name too long. Its slot is a
/// bad input (zeros, reported), not a failed read of the whole view.
fn is_bad_input(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{InvalidData, InvalidInput, NotFound, PermissionDenied};
    matches!(
        e.kind(),
        InvalidData | InvalidInput | NotFound | PermissionDenied
    ) || e.raw_os_error() == Some(ENAMETOOLONG)
}

/// Why a slot could not be rendered.
enum SlotError {
    /// The image is corrupt, unsupported or too large: a zero slot (or EIO when strict).
    Bad(String),
    /// Reading the source failed.
    Io(std::io::Error),
}

impl View for ImagesView {
    fn len(&self) -> u64 {
        self.header.len() as u64 + self.slot_bytes * self.folder.samples.len() as u64
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize, ViewError> {
        let rows = self.folder.samples.len() as u64;
        read_rows(
            &self.header,
            self.slot_bytes,
            rows,
            offset,
            buf,
            &|first, n, out| self.fill(first, n, out),
        )
    }

    fn chunk_len(&self) -> u64 {
        self.slot_bytes * SLOTS_PER_CHUNK
    }

    fn render_unit(&self, offset: u64) -> Range<u64> {
        let (h, len) = (self.header.len() as u64, self.len());
        if offset >= len {
            return len..len;
        }
        if offset < h {
            return 0..h;
        }
        let slot = (offset - h) / self.slot_bytes;
        let start = h + slot * self.slot_bytes;
        start..start + self.slot_bytes
    }

    fn sources(&self, range: Range<u64>, each: &mut dyn FnMut(&Path)) {
        let h = self.header.len() as u64;
        if range.end <= h || self.slot_bytes == 0 {
            return;
        }
        let first = range.start.saturating_sub(h) / self.slot_bytes;
        let end = (range.end - h)
            .div_ceil(self.slot_bytes)
            .min(self.folder.samples.len() as u64);
        for i in first..end {
            if let Some(path) = self.source_path(i) {
                each(&path);
            }
        }
    }
}

/// The small files of an image folder: `labels.npy`, `classes.txt`, `files.txt`; None for other
/// names (`images.npy` is an [`ImagesView`]).
pub fn image_file_view(folder: &ImageFolder, name: &str) -> Option<BytesView> {
    let bytes = match name {
        "labels.npy" => {
            let mut b = NpyHeader::new(DType::I64, vec![folder.samples.len() as u64]).encode();
            for (_, label) in &folder.samples {
                b.extend_from_slice(&label.to_le_bytes());
            }
            b
        }
        "classes.txt" => lines(folder.classes.iter().map(|c| c.as_bytes())),
        "files.txt" => lines(folder.samples.iter().map(|(p, _)| p.as_os_str().as_bytes())),
        _ => return None,
    };
    Some(BytesView::new(bytes))
}

fn lines<'a>(items: impl Iterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    for item in items {
        out.extend_from_slice(item);
        out.push(b'\n');
    }
    out
}

/// Bytes of `images.npy` for `samples` images of side `size` (without building the view).
pub fn images_len(samples: u64, size: u32) -> u64 {
    let s = u64::from(size);
    let header = NpyHeader::new(DType::U8, vec![samples, s, s, 3]);
    header.encoded_len() + samples * s * s * 3
}
