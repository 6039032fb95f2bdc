//! The `.npy/` tree inside the mount: tensor views of the source's tables and image folders.
//!
//! The views (from `stagefs-views`) read their inputs through [`MountSource`], i.e. through
//! the same scratch cache and fetcher as ordinary reads, so decoding warms the cache and never
//! bypasses it. Rendered bytes are cached on scratch too, in the same store and LRU as raw
//! blocks, under a key derived from the view path and a *generation* (a hash of the source
//! tree's names, sizes and mtimes at scan time plus the image size): a view is rendered once per
//! dataset version, and a remount after the source changed renders afresh. The tree is scanned
//! on the first access to `.npy/`; changes made to the source after that show up at the next
//! mount.

use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;

use stagefs_prefetch::meta::path_key;
use stagefs_prefetch::{block_count, block_len, Fetcher, Signature, Stats, BLOCK_SIZE};
use stagefs_views::{
    ByteSource, EntryKind, SourceEntry, View, ViewError, ViewKind, ViewOptions, ViewSet,
};
use tracing::{debug_span, warn};

/// Prefix of the cache keys of rendered views; no source path starts with a NUL byte.
const RENDER_PREFIX: &str = "\0npy";
/// Blocks rendered together on a miss: a 4 MiB span (≈ 28 slots of 224² images) amortises the
/// images that straddle block boundaries while keeping a random read's latency bounded.
const RENDER_SPAN: u64 = 4;
/// Views waiting for background rendering; more are dropped (reads render on demand anyway).
const BACKGROUND_QUEUE: usize = 16;

/// A [`ByteSource`] over the mount's source, reading through the scratch cache.
pub struct MountSource {
    root: PathBuf,
    fetcher: Fetcher,
}

impl MountSource {
    fn sig(&self, rel: &Path) -> io::Result<Signature> {
        let meta = fs::symlink_metadata(self.root.join(rel))?;
        if !meta.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a regular file", rel.display()),
            ));
        }
        Ok(Signature::of(&meta))
    }
}

impl ByteSource for MountSource {
    fn len(&self, rel: &Path) -> io::Result<u64> {
        Ok(self.sig(rel)?.size)
    }

    fn read_at(&self, rel: &Path, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let sig = self.sig(rel)?;
        let data = self
            .fetcher
            .read(rel, sig, offset, buf.len())
            .map_err(io::Error::other)?;
        buf[..data.len()].copy_from_slice(&data);
        Ok(data.len())
    }

    fn list_dir(&self, rel: &Path) -> io::Result<Vec<SourceEntry>> {
        let mut out = Vec::new();
        for e in fs::read_dir(self.root.join(rel))? {
            let e = e?;
            let t = e.file_type()?;
            let kind = if t.is_file() {
                EntryKind::File
            } else if t.is_dir() {
                EntryKind::Dir
            } else {
                EntryKind::Other
            };
            out.push(SourceEntry {
                name: e.file_name(),
                kind,
            });
        }
        Ok(out)
    }
}

/// A view opened for reading, with its cache identity.
pub struct OpenView {
    view: Arc<dyn View>,
    key_path: PathBuf,
    sig: Signature,
}

/// The `.npy/` namespace of a mount.
pub struct Views {
    set: ViewSet,
    generation: i64,
    fetcher: Fetcher,
    background: SyncSender<Arc<OpenView>>,
}

impl Views {
    /// Scans the source and prepares its views; starts the background renderer.
    pub fn new(
        root: &Path,
        fetcher: Fetcher,
        image_size: u32,
        strict: bool,
    ) -> Result<Arc<Views>, ViewError> {
        let stats = fetcher.stats().clone();
        let on_bad: stagefs_views::view::BadInputHook =
            Arc::new(move |path: &Path, reason: &str| {
                let msg = format!("bad view input {}: {reason}", path.display());
                if !stats.has_error(&msg) {
                    warn!("{msg}");
                    stats.error(msg);
                }
            });
        let opts = ViewOptions {
            image_size,
            strict,
            on_bad: Some(on_bad),
        };
        let src = Arc::new(MountSource {
            root: root.to_path_buf(),
            fetcher: fetcher.clone(),
        });
        let set = ViewSet::new(src, opts)?;
        let generation = generation(root, image_size, strict);
        let (tx, rx) = sync_channel(BACKGROUND_QUEUE);
        let views = Arc::new(Views {
            set,
            generation,
            fetcher,
            background: tx,
        });
        let weak = Arc::downgrade(&views);
        std::thread::Builder::new()
            .name("stagefs-render".into())
            .spawn(move || render_in_background(rx, weak))
            .map_err(ViewError::Io)?;
        Ok(views)
    }

    /// Directory or file (with exact size) at `rel` under `.npy/`.
    pub fn stat(&self, rel: &Path) -> Result<ViewKind, ViewError> {
        self.set.stat(rel)
    }

    /// Entries of the view directory `rel`.
    pub fn read_dir(&self, rel: &Path) -> Result<Vec<(OsString, ViewKind)>, ViewError> {
        Ok(self
            .set
            .read_dir(rel)?
            .into_iter()
            .map(|e| (e.name, e.kind))
            .collect())
    }

    /// Opens the view file `rel`, queueing it for rendering in the background.
    pub fn open(&self, rel: &Path) -> Result<Arc<OpenView>, ViewError> {
        let view = self.set.open(rel)?;
        let mut key_path = PathBuf::from(RENDER_PREFIX);
        key_path.push(rel);
        let sig = Signature {
            size: view.len(),
            mtime_ns: self.generation,
            ino: 0,
        };
        let open = Arc::new(OpenView {
            view,
            key_path,
            sig,
        });
        if block_count(open.sig.size) > 1 {
            // Full queue: skip; demand reads still render what they need.
            let _ = self.background.try_send(open.clone());
        }
        Ok(open)
    }

    /// Reads `len` bytes at `offset` of an open view: rendered blocks from the cache, the rest
    /// rendered now (a few blocks at a time) and cached.
    pub fn read(&self, v: &OpenView, offset: u64, len: usize) -> Result<Vec<u8>, ViewError> {
        let end = (offset + len as u64).min(v.sig.size);
        if offset >= end {
            return Ok(Vec::new());
        }
        let stats = self.fetcher.stats();
        let store = self.fetcher.store();
        let mut out = Vec::with_capacity((end - offset) as usize);
        let mut block = vec![0u8; BLOCK_SIZE as usize];
        let mut idx = offset / BLOCK_SIZE;
        while idx * BLOCK_SIZE < end {
            let bstart = idx * BLOCK_SIZE;
            let lo = (offset.max(bstart) - bstart) as usize;
            let hi = (end.min(bstart + BLOCK_SIZE) - bstart) as usize;
            if store
                .read_block(&v.key_path, v.sig, idx, &mut block)
                .is_some()
            {
                out.extend_from_slice(&block[lo..hi]);
                idx += 1;
                continue;
            }
            let rendered = self.render(v, idx, stats)?;
            for (i, chunk) in rendered.chunks(BLOCK_SIZE as usize).enumerate() {
                let b = idx + i as u64;
                let bstart = b * BLOCK_SIZE;
                if bstart >= end {
                    break;
                }
                let lo = (offset.max(bstart) - bstart) as usize;
                let hi = ((end.min(bstart + BLOCK_SIZE) - bstart) as usize).min(chunk.len());
                out.extend_from_slice(&chunk[lo..hi]);
            }
            idx += block_count(rendered.len() as u64).max(1);
        }
        stats.view_bytes.fetch_add(out.len() as u64, Relaxed);
        Ok(out)
    }

    /// Renders blocks from `first` on (a span of them, missing ones only up to the first cached
    /// one), caches them and returns their bytes.
    fn render(&self, v: &OpenView, first: u64, stats: &Stats) -> Result<Vec<u8>, ViewError> {
        let store = self.fetcher.store();
        let total = block_count(v.sig.size);
        let mut n = 1;
        while n < RENDER_SPAN && first + n < total && !store.contains(&v.key_path, v.sig, first + n)
        {
            n += 1;
        }
        let start = first * BLOCK_SIZE;
        let len: u64 = (first..first + n).map(|b| block_len(v.sig.size, b)).sum();
        let _span =
            debug_span!("render", view = %v.key_path.display(), offset = start, len).entered();
        let mut buf = vec![0u8; len as usize];
        let got = v.view.read_at(start, &mut buf)?;
        buf.truncate(got);
        for (i, chunk) in buf.chunks(BLOCK_SIZE as usize).enumerate() {
            store.insert_block(&v.key_path, v.sig, first + i as u64, chunk);
        }
        stats.views_rendered.fetch_add(1, Relaxed);
        Ok(buf)
    }
}

/// Renders opened views front to back so that later reads find them cached.
fn render_in_background(rx: Receiver<Arc<OpenView>>, views: std::sync::Weak<Views>) {
    for v in rx {
        let Some(views) = views.upgrade() else { return };
        let store = views.fetcher.store().clone();
        let total = block_count(v.sig.size);
        let mut idx = 0;
        while idx < total {
            if store.contains(&v.key_path, v.sig, idx) {
                idx += 1;
                continue;
            }
            match views.render(&v, idx, views.fetcher.stats()) {
                Ok(bytes) => idx += block_count(bytes.len() as u64).max(1),
                // Errors surface to readers of those bytes; stop rendering this view.
                Err(_) => break,
            }
        }
    }
}

/// A hash of every source file's path, size and mtime, plus the render options.
fn generation(root: &Path, image_size: u32, strict: bool) -> i64 {
    fn walk(root: &Path, rel: &Path, h: &mut u64) {
        let Ok(dir) = fs::read_dir(root.join(rel)) else {
            return;
        };
        let mut entries: Vec<_> = dir.flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let child = rel.join(e.file_name());
            let Ok(meta) = e.metadata() else { continue };
            *h ^= path_key(&child).rotate_left(17)
                ^ meta.size().wrapping_mul(0x9e37_79b9)
                ^ (meta.mtime_nsec() as u64)
                ^ (meta.mtime() as u64).rotate_left(32);
            *h = h.wrapping_mul(0x0000_0100_0000_01b3);
            if meta.is_dir() {
                walk(root, &child, h);
            }
        }
    }
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ u64::from(image_size) ^ (u64::from(strict) << 40);
    walk(root, Path::new(""), &mut h);
    h as i64
}
