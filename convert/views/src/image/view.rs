//! The image folder's files. `images.npy` has its exact size from the sample count alone; each
//! slot (one S×S×3 image) is decoded when a read touches it, through the [`ByteSource`], so
//! nothing is decoded before it is read.
//!
//! Reads that cut a slot (a caller's chunk boundary rarely falls on one, the header shifts
//! them) render that slot into a scratch buffer; the last [`PARTIAL_SLOTS`] such slots are kept
//! so that the two chunks sharing a slot decode it once.

use std::collections::{HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::ViewError;
use crate::source::{read_all, ByteSource};
use crate::tree::ImageFolder;
use crate::view::{read_rows, BytesView, View, ViewOptions};
use stagefs_npy::{DType, NpyHeader};

/// Partially read slots kept per view: enough for the boundaries of the chunks a few dozen
/// reader threads have in flight.
const PARTIAL_SLOTS: usize = 32;

/// Image slots per [`View::chunk_len`]: 8 slots (1.2 MB at S=224) amortise the boundary slot
/// and match typical FUSE read-ahead sizes.
const SLOTS_PER_CHUNK: u64 = 8;

/// Largest image file read (bytes): bigger files are reported as unsupported.
const MAX_FILE_BYTES: u64 = 1 << 30;

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
        let result = match read_all(self.src.as_ref(), &path, MAX_FILE_BYTES) {
            Ok(bytes) => super::decode::render(&bytes, self.opts.image_size, out),
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => Err(e.to_string()),
            Err(e) => return Err(ViewError::Io(e)),
        };
        match result {
            Ok(()) => Ok(()),
            Err(reason) => self.bad(i, &path, reason, out),
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
        "classes.txt" => lines(folder.classes.iter().map(String::as_str)),
        "files.txt" => {
            let names: Vec<String> = folder
                .samples
                .iter()
                .map(|(p, _)| p.to_string_lossy().into_owned())
                .collect();
            lines(names.iter().map(String::as_str))
        }
        _ => return None,
    };
    Some(BytesView::new(bytes))
}

fn lines<'a>(items: impl Iterator<Item = &'a str>) -> Vec<u8> {
    let mut out = Vec::new();
    for item in items {
        out.extend_from_slice(item.as_bytes());
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
