//! The `.npy/` tree inside the mount: tensor views of the source's tables and image folders.
//!
//! The views (from `stagefs-views`) read their inputs through [`MountSource`]: listings from
//! the metadata snapshot, bytes through the same scratch cache and fetcher as ordinary reads, so
//! decoding warms the cache and never bypasses it. Rendered bytes are cached on scratch too, in
//! the same index under a typed key (the view's path under `.npy/`) and a *generation* (a hash
//! of the names, sizes, mtimes and inodes of the view's inputs in the snapshot, plus the render
//! options): a view is rendered once per dataset version, across remounts.
//!
//! Rendering and caching go by the view's *render unit* ([`View::render_unit`]): for an image
//! view one slot, so a random read of one image decodes one image; units go through the
//! fetcher's in-flight de-duplication, so concurrent readers of one unit render it once. A
//! sequential reader's next [`RENDER_AHEAD_BYTES`] are rendered in the background, so it finds
//! them ready; opening, a `stat` or a header read render nothing more (opening a view used to
//! render all of it: 14 MB of 1×1 PNGs became 30 GB of scratch). Units that render to zeros
//! (damaged or empty images) are remembered in memory instead of being stored.
//!
//! A mount's views are prepared on their first use ([`MountViews`]), not at mount: most mounts
//! never open `.npy/`, and preparing reads the view set's metadata from the snapshot.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::hash::Hasher;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

use bytes::Bytes;
use stagefs_prefetch::hash::StableHasher;
use stagefs_prefetch::{EntryId, FileKind, KeyKind, LoadedEntry, Version};
use stagefs_views::{
    ByteSource, EntryKind, SourceEntry, View, ViewError, ViewKind, ViewOptions, ViewSet,
};
use tracing::{debug_span, warn};

use crate::error::FsError;
use crate::files::{Files, ReadData};
use crate::snapshot::{NodeAttr, Snapshot, ROOT};
use stagefs_prefetch::locks::lock;

/// Render-ahead windows waiting for the background renderer; more are dropped (reads render
/// on demand anyway).
const BACKGROUND_QUEUE: usize = 16;

/// How far ahead of a sequential reader of a view the background renderer goes: 32 MiB, about
/// 200 images of 224×224 RGB, enough to keep a reader of ~1 GB/s fed for the time one
/// decode takes on each core, small enough that a header read or an abandoned reader costs
/// at most this much scratch. Nothing is rendered ahead of a first read (a `stat`, a listing
/// or a header read renders only what was asked), nor when the cache has no free room for it
/// (rendering ahead must not evict blocks readers use).
pub const RENDER_AHEAD_BYTES: u64 = 32 << 20;

/// Units of zeros remembered in memory instead of being written to scratch (a damaged or
/// empty image renders as zeros): 2^20 of them cost ~40 MiB at most; past that, such units are
/// rendered again when read. 2,000 zero-byte JPEGs took 290 MB of scratch when stored.
const ZERO_UNITS_MAX: usize = 1 << 20;

/// A [`ByteSource`] over the mount's snapshot and cache.
pub struct MountSource {
    snapshot: Arc<Snapshot>,
    files: Arc<Files>,
}

impl MountSource {
    fn file(&self, rel: &Path) -> io::Result<(u32, NodeAttr)> {
        let node = self
            .snapshot
            .resolve(rel)
            .map_err(io::Error::other)?
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let attr = self
            .snapshot
            .attr(node)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        if attr.kind != FileKind::File {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a regular file", rel.display()),
            ));
        }
        Ok((node, attr))
    }
}

impl MountSource {
    /// Reads up to `len` bytes of `rel` at `offset` through the cache, handing each piece to
    /// `put(bytes before it, piece)`; returns the count (fewer only at end of file). Pieces are
    /// at most 1 MiB: one cache block, or a slice of one.
    fn each_block(
        &self,
        rel: &Path,
        offset: u64,
        len: usize,
        mut put: impl FnMut(usize, &[u8]),
    ) -> io::Result<usize> {
        let (node, attr) = self.file(rel)?;
        let state = self.files.state(node, &attr).map_err(io::Error::other)?;
        let mut done = 0;
        while done < len {
            let want = (len - done).min(1 << 20) as u32;
            let data = self
                .files
                .read(&state, &state.ra, offset + done as u64, want)
                .map_err(io::Error::other)?;
            let data = data.as_ref();
            if data.is_empty() {
                break;
            }
            put(done, data);
            done += data.len();
        }
        Ok(done)
    }
}

impl ByteSource for MountSource {
    fn len(&self, rel: &Path) -> io::Result<u64> {
        Ok(self.file(rel)?.1.size)
    }

    fn read_at(&self, rel: &Path, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.each_block(rel, offset, buf.len(), |done, data| {
            buf[done..done + data.len()].copy_from_slice(data);
        })
    }

    fn read_at_append(
        &self,
        rel: &Path,
        offset: u64,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> io::Result<usize> {
        stagefs_views::source::reserve(buf, len)?;
        // Cache blocks appended as they come: no zeroed staging buffer.
        self.each_block(rel, offset, len, |_, data| buf.extend_from_slice(data))
    }

    fn list_dir(&self, rel: &Path) -> io::Result<Vec<SourceEntry>> {
        let node = self
            .snapshot
            .resolve(rel)
            .map_err(io::Error::other)?
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let mut out = Vec::new();
        self.snapshot
            .read_dir(node, 0, |_, _, name, attr| {
                out.push(SourceEntry {
                    name: name.to_os_string(),
                    kind: match attr.kind {
                        FileKind::File => EntryKind::File,
                        FileKind::Dir => EntryKind::Dir,
                        _ => EntryKind::Other,
                    },
                });
                true
            })
            .map_err(io::Error::other)?;
        Ok(out)
    }
}

/// How a view is cut into render units: a first unit `[0, first)`, then units of `unit` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Units {
    first: u64,
    unit: u64,
    len: u64,
}

impl Units {
    fn of(view: &dyn View) -> Units {
        let len = view.len();
        let first = view.render_unit(0).end.clamp(1, len.max(1));
        let next = view.render_unit(first);
        let unit = (next.end.saturating_sub(next.start)).max(1);
        Units { first, unit, len }
    }

    fn count(&self) -> u32 {
        if self.len == 0 {
            return 0;
        }
        let rest = self.len.saturating_sub(self.first).div_ceil(self.unit);
        u32::try_from(1 + rest).unwrap_or(u32::MAX)
    }

    fn slot(&self, offset: u64) -> u32 {
        if offset < self.first {
            0
        } else {
            u32::try_from(1 + (offset - self.first) / self.unit).unwrap_or(u32::MAX)
        }
    }

    fn range(&self, slot: u32) -> std::ops::Range<u64> {
        if slot == 0 {
            return 0..self.first.min(self.len);
        }
        let start = self.first + u64::from(slot - 1) * self.unit;
        start.min(self.len)..start.saturating_add(self.unit).min(self.len)
    }
}

/// A view opened for reading, with its cache identity.
pub struct OpenView {
    view: Arc<dyn View>,
    entry: EntryId,
    units: Units,
    key: PathBuf,
    /// Where the last read of this open view ended: a read starting there is sequential.
    next: AtomicU64,
    /// The slot up to which rendering ahead was queued.
    ahead: AtomicU32,
}

impl OpenView {
    /// The view's size.
    pub fn len(&self) -> u64 {
        self.units.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.units.len == 0
    }

    /// The source files rendering `range` reads ([`View::sources`]).
    pub fn sources(&self, range: std::ops::Range<u64>, each: &mut dyn FnMut(&Path)) {
        self.view.sources(range, each);
    }
}

/// A mount's views, prepared on first use and shared by the request path and the read-order
/// hints ([`crate::hints`]).
pub struct MountViews {
    snapshot: Arc<Snapshot>,
    files: Arc<Files>,
    opts: ViewOptions,
    /// The views once prepared: read without a lock by every view request after that.
    ready: OnceLock<Arc<Views>>,
    /// Held while the views are prepared (one preparation at a time; a failed one is tried
    /// again by the next request).
    preparing: Mutex<()>,
    /// View entries an earlier mount left in the cache, until the views take them.
    loaded: Mutex<Vec<(LoadedEntry, Vec<u8>)>>,
}

impl MountViews {
    /// The views of `snapshot` over `files`, rendered with `opts`; nothing is prepared yet.
    pub fn new(snapshot: Arc<Snapshot>, files: Arc<Files>, opts: ViewOptions) -> MountViews {
        MountViews {
            snapshot,
            files,
            opts,
            ready: OnceLock::new(),
            preparing: Mutex::new(()),
            loaded: Mutex::new(Vec::new()),
        }
    }

    /// Hands over the view entries an earlier mount left in the cache (bound once the listing
    /// is complete), for the views to reuse when they are prepared.
    pub fn set_loaded(&self, loaded: Vec<(LoadedEntry, Vec<u8>)>) {
        *lock(&self.loaded) = loaded;
    }

    /// The views, prepared on first use (from the snapshot: no source listing).
    pub fn get(&self) -> Result<Arc<Views>, FsError> {
        if let Some(v) = self.ready.get() {
            return Ok(v.clone());
        }
        let _preparing = lock(&self.preparing);
        if let Some(v) = self.ready.get() {
            return Ok(v.clone());
        }
        let loaded = std::mem::take(&mut *lock(&self.loaded));
        let v = Views::new(
            self.snapshot.clone(),
            self.files.clone(),
            self.opts.clone(),
            loaded,
        )?;
        Ok(self.ready.get_or_init(|| v).clone())
    }
}

/// The `.npy/` namespace of a mount.
pub struct Views {
    set: ViewSet,
    snapshot: Arc<Snapshot>,
    files: Arc<Files>,
    options_hash: u64,
    /// View entries left by earlier mounts, by key: reused when the generation matches.
    loaded: Mutex<HashMap<Vec<u8>, (EntryId, Version)>>,
    /// Entries of views opened in this mount.
    opened: Mutex<HashMap<PathBuf, (EntryId, Version)>>,
    background: SyncSender<(Arc<OpenView>, u32, u32)>,
    /// Read bits each image folder's view files may carry ([`Views::folder_read_bits`]), by
    /// folder: one walk of the folder per mount.
    folder_bits: Mutex<HashMap<PathBuf, u16>>,
    /// Units that rendered to zeros, kept here instead of on scratch (at most
    /// [`ZERO_UNITS_MAX`]).
    zero_units: RwLock<HashSet<(EntryId, u32)>>,
    /// How many units `zero_units` holds: while none, a read looks at no lock for them.
    zero_count: AtomicUsize,
    /// Zeros served for those units (grown to the largest unit seen, sliced per read).
    zeros: Mutex<Bytes>,
}

/// The read bits (of `0o444`) of the classes of users — as seen from `owner`'s uid and gid —
/// that may read `a`: a file needs read, a directory read and search (its names are listed in
/// `files.txt`, its images read). Conservative: the owner class gets the bit from `a`'s owner
/// bits only if it owns `a`, else from the other bits; the group class likewise from `a`'s
/// group bits only if `a` has the folder's group.
fn readable_bits(a: &NodeAttr, owner: &NodeAttr) -> u16 {
    let need: u16 = if a.kind == FileKind::Dir { 0o5 } else { 0o4 };
    let class = |shift: u16| (a.perm >> shift) & need == need;
    let other = class(0);
    let group = other || (a.gid == owner.gid && class(3));
    let user = other || (a.uid == owner.uid && class(6));
    (u16::from(user) << 8) | (u16::from(group) << 5) | (u16::from(other) << 2)
}

impl Views {
    /// Prepares the views of the snapshot (listing from memory) and starts the background
    /// renderer. `loaded`: view entries an earlier mount left in the cache.
    pub fn new(
        snapshot: Arc<Snapshot>,
        files: Arc<Files>,
        opts: ViewOptions,
        loaded: Vec<(LoadedEntry, Vec<u8>)>,
    ) -> Result<Arc<Views>, ViewError> {
        let stats = files.fetcher().stats().clone();
        let on_bad: stagefs_views::view::BadInputHook =
            Arc::new(move |path: &Path, reason: &str| {
                let msg = format!("bad view input {}: {reason}", path.display());
                if !stats.has_error(&msg) {
                    warn!("{msg}");
                    stats.error(msg);
                }
            });
        // Everything that changes rendered bytes is part of the cache identity.
        let mut h = StableHasher::default();
        h.write_u32(opts.image_size);
        h.write_u8(u8::from(opts.strict));
        h.write_u8(u8::from(opts.decode.fast));
        h.write_u64(opts.decode.max_pixels);
        h.write_u64(opts.decode.budget.total());
        let options_hash = h.finish();
        let opts = ViewOptions {
            on_bad: Some(on_bad),
            ..opts
        };
        let src = Arc::new(MountSource {
            snapshot: snapshot.clone(),
            files: files.clone(),
        });
        let set = ViewSet::new(src, opts)?;
        let (tx, rx) = sync_channel(BACKGROUND_QUEUE);
        let views = Arc::new(Views {
            set,
            snapshot,
            files,
            options_hash,
            loaded: Mutex::new(
                loaded
                    .into_iter()
                    .map(|(e, key)| (key, (e.id, e.version)))
                    .collect(),
            ),
            opened: Mutex::new(HashMap::new()),
            background: tx,
            folder_bits: Mutex::new(HashMap::new()),
            zero_units: RwLock::new(HashSet::new()),
            zero_count: AtomicUsize::new(0),
            zeros: Mutex::new(Bytes::new()),
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

    /// The source node a view path stands for: `.npy/<p>` is derived from source `<p>`, and a
    /// view file `.npy/<p>/<f>` from its directory's input `<p>` (a table or an image folder).
    pub fn input_of(&self, rel: &Path, is_dir: bool) -> Option<NodeAttr> {
        let input = if is_dir { rel } else { rel.parent()? };
        let node = if input.as_os_str().is_empty() {
            ROOT
        } else {
            self.snapshot.resolve(input).ok()??
        };
        self.snapshot.attr(node)
    }

    /// The read bits (of `0o444`) the view files of the folder `dir` (an image folder: every
    /// image under it is an input) may carry: a class of users may read `images.npy`,
    /// `labels.npy`, `files.txt` and `classes.txt` only if it may read every image under
    /// `dir` and list every directory on the way (the folder itself included). A 0600 image
    /// or a 0700 subfolder narrows them to the owner, as a 0600 table narrows its columns.
    /// Directories above `dir` need no check: the kernel walks the view directories above,
    /// which carry their inputs' bits. Computed once per folder (the snapshot is fixed; under
    /// `--revalidate` a mode changed later is seen by the next mount).
    pub fn folder_read_bits(&self, dir: &Path, owner: &NodeAttr) -> u16 {
        if let Some(&bits) = lock(&self.folder_bits).get(dir) {
            return bits;
        }
        let node = if dir.as_os_str().is_empty() {
            Some(ROOT)
        } else {
            self.snapshot.resolve(dir).ok().flatten()
        };
        let mut bits = 0o444u16;
        let mut stack: Vec<u32> = node.into_iter().collect();
        while let Some(n) = stack.pop() {
            let Some(a) = self.snapshot.attr(n) else {
                continue;
            };
            bits &= readable_bits(&a, owner);
            if bits == 0 {
                break;
            }
            if a.kind == FileKind::Dir {
                let _ = self.snapshot.read_dir(n, 0, |_, id, _, _| {
                    stack.push(id);
                    true
                });
            }
        }
        lock(&self.folder_bits).insert(dir.to_path_buf(), bits);
        bits
    }

    /// A hash of every input of view directory `dir` (names, sizes, mtimes, ctimes, inodes) and
    /// the render options: the cache key part that changes when any input does.
    fn generation(&self, dir: &Path) -> i64 {
        let mut h = StableHasher::default();
        h.write_u64(self.options_hash);
        let node = if dir.as_os_str().is_empty() {
            Some(ROOT)
        } else {
            self.snapshot.resolve(dir).ok().flatten()
        };
        let mut stack: Vec<u32> = node.into_iter().collect();
        while let Some(n) = stack.pop() {
            if let Some(a) = self.snapshot.attr(n) {
                h.write_u64(a.size);
                h.write_i64(a.mtime_ns);
                h.write_i64(a.ctime_ns);
                h.write_u64(a.ino);
                if a.kind == FileKind::Dir {
                    let _ = self.snapshot.read_dir(n, 0, |_, id, name, _| {
                        h.write(name.as_bytes());
                        stack.push(id);
                        true
                    });
                }
            }
        }
        h.finish() as i64
    }

    /// Opens the view file `rel`, queueing it for rendering in the background.
    pub fn open(&self, rel: &Path) -> Result<Arc<OpenView>, ViewError> {
        let view = self.set.open(rel)?;
        let units = Units::of(view.as_ref());
        let version = Version {
            size: units.len,
            mtime_ns: self.generation(rel.parent().unwrap_or(Path::new(""))),
            ctime_ns: 0,
            ino: 0,
        };
        let key = rel.to_path_buf();
        let store = self.files.fetcher().store();
        let known = lock(&self.opened).get(&key).copied();
        let entry = match known {
            Some((id, v)) if v == version => id,
            _ => {
                let reused = lock(&self.loaded).remove(key.as_os_str().as_bytes());
                match reused {
                    Some((id, v)) if v == version => id,
                    other => {
                        if let Some((id, _)) = other {
                            store.forget(id);
                        }
                        store.create(
                            KeyKind::View,
                            key.as_os_str().as_bytes(),
                            version,
                            units.count(),
                            false,
                            0,
                        )
                    }
                }
            }
        };
        lock(&self.opened).insert(key.clone(), (entry, version));
        Ok(Arc::new(OpenView {
            view,
            entry,
            units,
            key,
            next: AtomicU64::new(0),
            ahead: AtomicU32::new(0),
        }))
    }

    /// `n` zero bytes, without a new zeroed buffer per read.
    fn zeros(&self, n: usize) -> Bytes {
        let mut z = lock(&self.zeros);
        if z.len() < n {
            *z = Bytes::from(vec![0u8; n]);
        }
        z.slice(..n)
    }

    /// After a read of `offset..end` of `v`: if it continued the previous read, queue the
    /// units up to [`RENDER_AHEAD_BYTES`] past it for the background renderer (once the
    /// reader is half-way through what was queued before).
    fn render_ahead(&self, v: &Arc<OpenView>, offset: u64, end: u64) {
        let prev = v.next.swap(end, Relaxed);
        if offset == 0 || offset != prev || end >= v.units.len {
            return;
        }
        let from = v.units.slot(end);
        let to = v
            .units
            .slot(end.saturating_add(RENDER_AHEAD_BYTES).min(v.units.len - 1))
            .saturating_add(1);
        let queued = v.ahead.load(Relaxed);
        let half = (to - from) / 2;
        if queued > from.saturating_add(half) {
            return;
        }
        v.ahead.store(to, Relaxed);
        // Full queue: skip; demand reads still render what they need.
        let _ = self.background.try_send((v.clone(), from.max(queued), to));
    }

    /// Unit `slot` of an open view: from the cache, else rendered now (once, however many
    /// readers ask at the same time) and cached.
    /// A unit of zeros (a damaged or empty image) is remembered in memory, not stored.
    fn unit(&self, v: &OpenView, slot: u32) -> Result<Bytes, ViewError> {
        let range = v.units.range(slot);
        let len = (range.end - range.start) as usize;
        // Lock-free while no unit of zeros is known (every honest dataset); then a shared
        // read lock, never an exclusive one, on the read path.
        if self.zero_count.load(Relaxed) > 0
            && self
                .zero_units
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(&(v.entry, slot))
        {
            return Ok(self.zeros(len));
        }
        let fetcher = self.files.fetcher();
        let got = fetcher.get_or_make(v.entry, slot, || {
            let _span =
                debug_span!("render", view = %v.key.display(), offset = range.start).entered();
            let mut buf = vec![0u8; len];
            let n = v.view.read_at(range.start, &mut buf)?;
            buf.truncate(n);
            fetcher.stats().views_rendered.fetch_add(1, Relaxed);
            if n > 0 && buf.iter().all(|&b| b == 0) {
                let mut zero = self
                    .zero_units
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                if zero.len() < ZERO_UNITS_MAX {
                    zero.insert((v.entry, slot));
                    self.zero_count.store(zero.len(), Relaxed);
                    return Ok::<_, ViewError>((self.zeros(n), false));
                }
            }
            Ok((Bytes::from(buf), true))
        })?;
        Ok(got.data)
    }

    /// Reads `len` bytes at `offset` of an open view.
    pub fn read(&self, v: &Arc<OpenView>, offset: u64, len: usize) -> Result<ReadData, ViewError> {
        let end = offset.saturating_add(len as u64).min(v.units.len);
        if offset < end {
            let stats = self.files.fetcher().stats();
            stats.view_bytes.fetch_add(end - offset, Relaxed);
        }
        let data = self.render(v, offset, len)?;
        self.render_ahead(v, offset, end);
        Ok(data)
    }

    /// Bytes `offset..offset + len` of an open view, rendered and cached if they are not yet,
    /// without counting them as served (read-order hints render ahead of readers this way).
    pub fn render(&self, v: &OpenView, offset: u64, len: usize) -> Result<ReadData, ViewError> {
        let end = offset.saturating_add(len as u64).min(v.units.len);
        if offset >= end {
            return Ok(ReadData::Gathered(Vec::new()));
        }
        let first = v.units.slot(offset);
        let last = v.units.slot(end - 1);
        let cut = |slot: u32, data: &Bytes| {
            let r = v.units.range(slot);
            let lo = (offset.max(r.start) - r.start) as usize;
            let hi = ((end.min(r.end) - r.start) as usize).min(data.len());
            lo.min(hi)..hi
        };
        if first == last {
            let data = self.unit(v, first)?;
            let r = cut(first, &data);
            return Ok(ReadData::Slice(data.slice(r)));
        }
        let mut out = Vec::with_capacity((end - offset) as usize);
        for slot in first..=last {
            let data = self.unit(v, slot)?;
            out.extend_from_slice(&data[cut(slot, &data)]);
        }
        Ok(ReadData::Gathered(out))
    }
}

/// Renders the windows queued by [`Views::render_ahead`], skipping units already cached, and
/// stops a window when the cache has no free room left for it.
fn render_in_background(rx: Receiver<(Arc<OpenView>, u32, u32)>, views: std::sync::Weak<Views>) {
    for (v, from, to) in rx {
        let Some(views) = views.upgrade() else { return };
        let store = views.files.fetcher().store().clone();
        for slot in from..to.min(v.units.count()) {
            if store.contains(v.entry, slot) {
                continue;
            }
            let r = v.units.range(slot);
            if store.used().saturating_add(r.end - r.start) > store.capacity() {
                break;
            }
            // Errors surface to readers of those bytes; stop rendering this view.
            if views.unit(&v, slot).is_err() {
                break;
            }
        }
    }
}
