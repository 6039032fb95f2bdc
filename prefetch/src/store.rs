//! The on-disk cache: one index log ([`crate::index`]), small blocks packed in segment files
//! ([`crate::segment`]), large files as exact sparse copies (so the kernel can read them through
//! FUSE passthrough), capacity and least-recently-used eviction ([`crate::eviction`]).
//!
//! Layout under the private cache directory ([`CacheDir`]): `v2/index.log`, `v2/segments/<n>`,
//! `v2/files/<n>`, and whatever the filesystem persists beside them (its metadata snapshot).
//!
//! An *entry* caches one thing — a source file's bytes or a rendered view's — under a typed key
//! (the path it stands for) and the [`Version`] of the contents; its *slots* are its blocks
//! (1 MiB of a source file, one render unit of a view). Entries are found by id: the filesystem
//! binds each of its nodes to an entry, and after a remount it re-binds the entries listed in the
//! log by comparing the stored key and version with its snapshot — an entry is only ever served
//! for the path it was stored for, never because a hash matched.
//!
//! Reads return checksummed [`Bytes`]: the block is read once from scratch into fresh
//! (uninitialised) memory, its CRC-32 verified, and handed out without further copies. A
//! mismatch drops the block and is a miss, so corrupt scratch bytes are never served.
//!
//! Opening replays the log through one reused window of [`LOG_WINDOW`] bytes (a record is at
//! most [`MAX_RECORD`]), so a remount of a million-entry cache neither holds the log in memory
//! nor faults in fresh pages for it.
//!
//! Locking: `inner` guards the index state; the log buffer has its own lock, always taken after
//! `inner` or alone. Disk reads and writes of block bytes happen with no lock held.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read, Write};
use std::num::NonZeroUsize;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, RwLock};

use bytes::{Bytes, BytesMut};
use lru::LruCache;
use tracing::{debug, info, warn};

use crate::cachedir::CacheDir;
use crate::error::CacheError;
use crate::eviction::Eviction;
use crate::index::{self, EntryId, KeyKind, Loc, Record, HEADER_LEN, OWN_FILE};
use crate::segment::{self, aligned, punch_hole, SegState, SEGMENT_BYTES};
use crate::source::{lock, read_full_at, Version};
use crate::stats::Stats;
use crate::BLOCK_SIZE;

/// Own data files kept open: enough for the large files being read and staged at once, far
/// below the descriptor limit.
pub const OPEN_DATA_FILES: usize = 256;
/// Name of the format directory; caches of other formats beside it are removed at open.
/// The cache format's directory inside the cache directory (index, segments, files, snapshot).
pub const FORMAT_DIR: &str = "v2";
const INDEX: &str = "index.log";
/// Largest slot the cache stores: a [`Loc`]'s length is a `u32`. One bound, shared by
/// [`CacheStore::insert`] and the log replay, so whatever is stored survives a remount (a
/// rendered image slot of `--image-size` 8192 is 192 MiB; raw blocks are [`BLOCK_SIZE`]).
pub const MAX_SLOT_BYTES: u64 = u32::MAX as u64;
/// Largest index accepted at load: 64 GiB is far beyond any real cache's (≈ 100 B per block).
const MAX_INDEX_BYTES: u64 = 64 << 30;
/// The log is rewritten at load or close when live records are less than this fraction of it.
const COMPACT_BELOW: f64 = 0.5;

/// Where and how big the cache is.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The cache directory (created 0700 if missing; refused if not private).
    pub dir: PathBuf,
    /// Capacity in bytes.
    pub capacity: u64,
}

/// Blocks of an entry.
enum Slots {
    /// One slot (most small files); `len == 0` means absent.
    One(Loc),
    /// Several slots, allocated at the first stored block.
    Many(Box<[Loc]>),
    /// Several slots, none stored yet.
    Empty,
}

const ABSENT: Loc = Loc {
    seg: 0,
    off4k: 0,
    len: 0,
    crc: 0,
};

struct Entry {
    /// Offset of this entry's record in the log (for rewriting the log without keeping keys in
    /// memory: a million paths would cost tens of MB).
    rec_at: u64,
    owner: u32,
    nslots: u32,
    present: u32,
    kind: KeyKind,
    own_file: bool,
    /// Every block verified against its checksum since this mount started (passthrough reads
    /// bypass the daemon, so they are allowed only then).
    verified: bool,
    pins: u32,
    /// Number of the own data file (0 until the first block is stored).
    own_no: u32,
    slots: Slots,
}

impl Entry {
    fn loc(&self, slot: u32) -> Option<Loc> {
        let l = match &self.slots {
            Slots::One(l) if slot == 0 => *l,
            Slots::Many(v) => *v.get(slot as usize)?,
            _ => return None,
        };
        (l.len > 0).then_some(l)
    }

    fn set_loc(&mut self, slot: u32, loc: Loc) {
        if slot >= self.nslots {
            return;
        }
        if self.nslots == 1 {
            self.slots = Slots::One(loc);
            return;
        }
        if matches!(self.slots, Slots::Empty | Slots::One(_)) {
            self.slots = Slots::Many(vec![ABSENT; self.nslots as usize].into_boxed_slice());
        }
        if let Slots::Many(v) = &mut self.slots {
            if let Some(s) = v.get_mut(slot as usize) {
                *s = loc;
            }
        }
    }

    fn locs(&self) -> Vec<(u32, Loc)> {
        match &self.slots {
            Slots::One(l) if l.len > 0 => vec![(0, *l)],
            Slots::Many(v) => v
                .iter()
                .enumerate()
                .filter(|(_, l)| l.len > 0)
                .map(|(i, l)| (i as u32, *l))
                .collect(),
            _ => Vec::new(),
        }
    }

    fn complete(&self) -> bool {
        self.present == self.nslots && self.nslots > 0
    }
}

/// Entries by id, in fixed chunks: a million entries cost a million entries, not the up to
/// twice as many a doubling `Vec` reserves (and no copy of them all when it grows).
#[derive(Default)]
struct Entries {
    chunks: Vec<Vec<Option<Entry>>>,
    len: usize,
}

/// Entries per chunk: 64 Ki × ~56 B ≈ 3.5 MiB, small next to a cache of many files.
const CHUNK: usize = 1 << 16;

impl Entries {
    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, e: Option<Entry>) {
        if self.len.is_multiple_of(CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        if let Some(c) = self.chunks.last_mut() {
            c.push(e);
            self.len += 1;
        }
    }

    fn get(&self, i: usize) -> Option<&Option<Entry>> {
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)
    }

    fn get_mut(&mut self, i: usize) -> Option<&mut Option<Entry>> {
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)
    }

    fn iter(&self) -> impl Iterator<Item = &Option<Entry>> {
        self.chunks.iter().flatten()
    }
}

fn lru_key(id: EntryId, slot: u32) -> u64 {
    (u64::from(id) << 32) | u64::from(slot)
}

struct Inner {
    entries: Entries,
    evict: Eviction,
    pinned: HashSet<EntryId>,
    segs: Vec<SegState>,
    /// Segment blocks are appended to (0: none yet).
    active: u32,
    next_own: u32,
    snapshot: u128,
}

struct Log {
    file: File,
    /// Bytes of the log file written so far.
    len: u64,
    /// Records not yet written.
    pending: Vec<u8>,
    /// Bytes of records that no longer describe anything (dropped blocks and entries, and the
    /// records that dropped them): when they are most of the log, it is rewritten.
    garbage: u64,
}

/// Encoded size of a block record, and of an entry record without its key.
const BLOCK_REC: u64 = 31;
const ENTRY_REC: u64 = 55;

/// An entry found in the index at open, for the owner to bind (or forget); its key is
/// [`Loaded::key`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedEntry {
    /// Its id.
    pub id: EntryId,
    /// What it caches.
    pub kind: KeyKind,
    /// Where its key is in [`Loaded`]'s key bytes.
    key_at: usize,
    key_len: u16,
    /// The version of the cached contents.
    pub version: Version,
    /// The owner's node id recorded with it (meaningful if the snapshot is the same).
    pub owner: u32,
    /// Its number of slots.
    pub slots: u32,
    /// Slots stored.
    pub present: u32,
}

/// What [`CacheStore::open`] found: the entries to bind and the snapshot their owners refer to.
/// Keys live in one buffer (not one allocation per entry: a million of those would outlive
/// the binding as heap fragmentation).
#[derive(Debug, Default)]
pub struct Loaded {
    /// The snapshot id recorded in the index (0 if none).
    pub snapshot: u128,
    /// The entries, in id order.
    pub entries: Vec<LoadedEntry>,
    keys: Vec<u8>,
}

impl Loaded {
    /// The key of `e` (the path it stands for).
    pub fn key(&self, e: &LoadedEntry) -> &[u8] {
        self.keys
            .get(e.key_at..e.key_at + usize::from(e.key_len))
            .unwrap_or_default()
    }

    fn push(&mut self, mut e: LoadedEntry, key: &[u8]) {
        e.key_at = self.keys.len();
        e.key_len = key.len().min(index::MAX_KEY) as u16;
        self.keys.extend_from_slice(&key[..usize::from(e.key_len)]);
        self.entries.push(e);
    }

    /// Splits off the entries of `kind` (with their keys).
    pub fn take_kind(&mut self, kind: KeyKind) -> Vec<(LoadedEntry, Vec<u8>)> {
        let mut out = Vec::new();
        let keys = &self.keys;
        self.entries.retain(|e| {
            if e.kind != kind {
                return true;
            }
            let k = keys
                .get(e.key_at..e.key_at + usize::from(e.key_len))
                .unwrap_or_default();
            out.push((e.clone(), k.to_vec()));
            false
        });
        out
    }
}

/// The scratch cache.
pub struct CacheStore {
    /// The cache directory's lock ([`CacheDir::lock`]), held until [`close`](Self::close) or
    /// [`abandon`](Self::abandon).
    lock: Mutex<Option<File>>,
    dir: CacheDir,
    segdir: CacheDir,
    filedir: CacheDir,
    inner: Mutex<Inner>,
    log: Mutex<Log>,
    /// Serialises flushes (the log lock is not held while one writes).
    flushing: Mutex<()>,
    stats: Arc<Stats>,
    seg_files: RwLock<Vec<Option<Arc<File>>>>,
    own_files: Mutex<LruCache<u32, Arc<File>>>,
}

impl CacheStore {
    /// Opens (or creates) the cache in `cfg.dir` and replays its index.
    pub fn open(cfg: &StoreConfig, stats: Arc<Stats>) -> Result<(CacheStore, Loaded), CacheError> {
        let top = CacheDir::open(&cfg.dir)?;
        // Before anything is read or written: another mount of this cache would change both.
        let held = top.lock()?;
        // Caches of older formats (turn 1: one header + data file per source file).
        for old in ["v1"] {
            if top.exists(old) {
                if let Err(e) = top.remove_tree(old) {
                    warn!(error = %e, "could not remove an old cache format");
                }
            }
        }
        let dir = top.subdir(FORMAT_DIR)?;
        let segdir = dir.subdir("segments")?;
        let filedir = dir.subdir("files")?;
        let io_err = |source| CacheError::Dir {
            path: cfg.dir.clone(),
            source,
        };
        // Leftover temporaries of a killed daemon.
        for d in [&dir, &segdir, &filedir] {
            for name in d.list().map_err(io_err)? {
                if name.to_string_lossy().ends_with(".tmp") {
                    let _ = d.remove(&name);
                }
            }
        }
        let cap = NonZeroUsize::new(OPEN_DATA_FILES).unwrap_or(NonZeroUsize::MIN);
        let (file, len) = open_log(&dir).map_err(io_err)?;
        let store = CacheStore {
            lock: Mutex::new(Some(held)),
            dir,
            segdir,
            filedir,
            inner: Mutex::new(Inner {
                entries: Entries::default(),
                evict: Eviction::new(cfg.capacity),
                pinned: HashSet::new(),
                segs: vec![SegState::default()],
                active: 0,
                next_own: 1,
                snapshot: 0,
            }),
            log: Mutex::new(Log {
                file,
                len,
                pending: Vec::new(),
                garbage: 0,
            }),
            flushing: Mutex::new(()),
            stats,
            seg_files: RwLock::new(vec![None]),
            own_files: Mutex::new(LruCache::new(cap)),
        };
        let loaded = store.replay().map_err(io_err)?;
        Ok((store, loaded))
    }

    /// The directory the cache lives in (the filesystem keeps its snapshot there).
    pub fn dir(&self) -> &CacheDir {
        &self.dir
    }

    /// Rebuilds the state from the log, read in windows; rewrites the log when it is mostly
    /// garbage or damaged. Returns the entries for the owner to bind.
    fn replay(&self) -> io::Result<Loaded> {
        let mut inner = lock(&self.inner);
        let (file, log_len) = {
            let log = lock(&self.log);
            (log.file.try_clone()?, log.len)
        };
        let mut win = LogWindow::new(&file, log_len);
        let header = index::parse_header(win.rest()?);
        let snapshot = header.unwrap_or(0);
        let mut keys = Keys::default();
        // Segment files present on scratch, with their sizes (to check block records against).
        let mut seg_sizes: Vec<Option<u64>> = vec![None];
        for name in self.segdir.list()? {
            if let Some(n) = name.to_str().and_then(segment::parse_name) {
                let Ok(size) = self.segdir.open_read(&name).and_then(|f| f.metadata()) else {
                    continue;
                };
                if seg_sizes.len() <= n as usize {
                    seg_sizes.resize(n as usize + 1, None);
                }
                seg_sizes[n as usize] = Some(size.len());
            }
        }
        // A log of another format (or none yet) is ignored and rewritten below.
        if header.is_some() {
            win.advance(HEADER_LEN);
        }
        let mut order: Vec<u64> = Vec::new();
        let mut damaged = false;
        while header.is_some() {
            let at = win.at();
            let rest = win.rest()?;
            if rest.is_empty() {
                break;
            }
            let Some((rec, n)) = index::decode(rest) else {
                damaged = true;
                break;
            };
            match self.apply(&mut inner, &mut keys, &seg_sizes, &mut order, &rec, at) {
                Applied::Ok => {}
                // Stale but harmless; purged by the rewrite below.
                Applied::Skipped => damaged = true,
                Applied::Contradiction => {
                    damaged = true;
                    break;
                }
            }
            win.advance(n);
        }
        let log_len = win.len;
        drop(win);
        // Eviction order: blocks in the order they were last recorded (oldest first); a
        // repeated `put` moves a block to the most recent end.
        let blocks = order.iter().filter_map(|&k| {
            let (id, slot) = ((k >> 32) as u32, k as u32);
            let loc = inner
                .entries
                .get(id as usize)
                .and_then(Option::as_ref)
                .and_then(|e| e.loc(slot))?;
            Some((k, aligned(u64::from(loc.len))))
        });
        let evict = Eviction::from_order(inner.evict.capacity(), order.len(), blocks);
        drop(order);
        inner.evict = evict;
        // Segments: live bytes and allocation ends from the blocks that survived.
        inner.segs = vec![SegState::default(); seg_sizes.len()];
        for (n, size) in seg_sizes.iter().enumerate().skip(1) {
            if let Some(size) = size {
                inner.segs[n].exists = true;
                inner.segs[n].end = aligned(*size);
            }
        }
        let mut max_own = 0;
        for e in inner.entries.iter().flatten() {
            max_own = max_own.max(e.own_no);
        }
        let live: Vec<(u32, u64)> = inner
            .entries
            .iter()
            .flatten()
            .flat_map(|e| e.locs())
            .filter(|(_, l)| l.seg & OWN_FILE == 0)
            .map(|(_, l)| (l.seg, aligned(u64::from(l.len))))
            .collect();
        for (seg, len) in live {
            if let Some(s) = inner.segs.get_mut(seg as usize) {
                s.live += len;
            }
        }
        inner.next_own = max_own + 1;
        // Segments and own files nothing refers to (a killed daemon's last seconds).
        let mut seg_files = vec![None; inner.segs.len()];
        for (n, (seg, file)) in inner.segs.iter_mut().zip(seg_files.iter_mut()).enumerate() {
            if n == 0 || !seg.exists {
                continue;
            }
            if seg.live == 0 {
                let _ = self.segdir.remove(segment::name(n as u32));
                seg.exists = false;
            } else {
                match self.segdir.open_rw(segment::name(n as u32), false) {
                    Ok(f) => *file = Some(Arc::new(f)),
                    Err(_) => seg.exists = false,
                }
            }
        }
        *self.seg_files.write().unwrap_or_else(|p| p.into_inner()) = seg_files;
        let owned: HashSet<u32> = inner
            .entries
            .iter()
            .flatten()
            .filter(|e| e.own_file && e.own_no > 0)
            .map(|e| e.own_no)
            .collect();
        for name in self.filedir.list()? {
            let keep = name
                .to_str()
                .and_then(segment::parse_name)
                .is_some_and(|n| owned.contains(&n));
            if !keep {
                let _ = self.filedir.remove(&name);
            }
        }
        inner.snapshot = snapshot;
        // Capacity lowered since the last mount: reserving nothing evicts down to it.
        if inner.evict.used() > inner.evict.capacity() {
            let state = &mut *inner;
            if let Some(victims) = state.evict.reserve(0, &state.pinned) {
                for v in victims {
                    self.drop_block(state, (v >> 32) as u32, v as u32, false);
                }
            }
        }
        let mut loaded = Loaded {
            snapshot,
            ..Loaded::default()
        };
        let mut key_bytes = 0;
        for (id, k) in keys.meta.iter().enumerate() {
            let (Some((kind, at, len, version)), Some(e)) =
                (k, inner.entries.get(id).and_then(Option::as_ref))
            else {
                continue;
            };
            let key = keys
                .bytes
                .get(*at..*at + usize::from(*len))
                .unwrap_or_default();
            key_bytes += key.len() as u64;
            loaded.push(
                LoadedEntry {
                    id: id as EntryId,
                    kind: *kind,
                    key_at: 0,
                    key_len: 0,
                    version: *version,
                    owner: e.owner,
                    slots: e.nslots,
                    present: e.present,
                },
                key,
            );
        }
        drop(keys);
        let complete = inner
            .entries
            .iter()
            .flatten()
            .filter(|e| e.kind == KeyKind::Raw && e.complete())
            .count();
        self.stats.files_staged.store(complete as u64, Relaxed);
        // Rewrite the log when it is damaged, of another format, or mostly garbage.
        let live = HEADER_LEN as u64
            + loaded.entries.len() as u64 * ENTRY_REC
            + key_bytes
            + inner.evict.len() as u64 * BLOCK_REC;
        let mostly_garbage = (live as f64) < COMPACT_BELOW * log_len as f64;
        if damaged || header.is_none() || mostly_garbage {
            self.rewrite(&mut inner, &mut loaded)?;
        } else {
            lock(&self.log).garbage = log_len.saturating_sub(live);
        }
        info!(
            entries = loaded.entries.len(),
            used = inner.evict.used(),
            damaged,
            "cache index loaded"
        );
        Ok(loaded)
    }

    /// Applies one replayed record; false if it contradicts the state (the log is damaged).
    fn apply(
        &self,
        inner: &mut Inner,
        keys: &mut Keys,
        seg_sizes: &[Option<u64>],
        order: &mut Vec<u64>,
        rec: &Record<'_>,
        at: u64,
    ) -> Applied {
        let ok = |b: bool| {
            if b {
                Applied::Ok
            } else {
                Applied::Contradiction
            }
        };
        match rec {
            Record::Entry {
                id,
                kind,
                own_file,
                owner,
                slots,
                version,
                key,
            } => {
                // Ids are handed out in order; anything else is not a log we wrote.
                if *id as usize != inner.entries.len()
                    || u64::from(*slots) != slot_bound(*kind, version.size, *slots)
                {
                    return Applied::Contradiction;
                }
                inner.entries.push(Some(Entry {
                    rec_at: at,
                    owner: *owner,
                    nslots: *slots,
                    present: 0,
                    kind: *kind,
                    own_file: *own_file,
                    verified: false,
                    pins: 0,
                    own_no: 0,
                    slots: if *slots > 1 {
                        Slots::Empty
                    } else {
                        Slots::One(ABSENT)
                    },
                }));
                keys.push(*kind, key, *version);
                Applied::Ok
            }
            Record::Block { id, slot, loc } => {
                let Some(Some(e)) = inner.entries.get_mut(*id as usize) else {
                    return ok(false);
                };
                if *slot >= e.nslots || loc.len == 0 || u64::from(loc.len) > MAX_SLOT_BYTES {
                    return ok(false);
                }
                let end = u64::from(loc.off4k) * segment::ALIGN + u64::from(loc.len);
                if loc.seg & OWN_FILE != 0 {
                    let no = loc.seg & !OWN_FILE;
                    if !e.own_file || no == 0 || (e.own_no != 0 && e.own_no != no) {
                        return ok(false);
                    }
                    e.own_no = no;
                } else {
                    // A block past its segment's end was never written (or the segment is
                    // gone): skip it, the rest of the log is fine.
                    let size = seg_sizes.get(loc.seg as usize).copied().flatten();
                    if size.is_none_or(|s| end > s) {
                        return Applied::Skipped;
                    }
                }
                if e.loc(*slot).is_none() {
                    e.present += 1;
                }
                e.set_loc(*slot, *loc);
                order.push(lru_key(*id, *slot));
                Applied::Ok
            }
            Record::DropBlock { id, slot } => {
                let Some(Some(e)) = inner.entries.get_mut(*id as usize) else {
                    return ok(false);
                };
                if e.loc(*slot).is_some() {
                    e.present -= 1;
                    e.set_loc(*slot, ABSENT);
                }
                Applied::Ok
            }
            Record::DropEntry { id } => {
                let Some(slot) = inner.entries.get_mut(*id as usize) else {
                    return ok(false);
                };
                *slot = None;
                keys.drop(*id as usize);
                Applied::Ok
            }
            Record::Bind { id, owner } => {
                let Some(Some(e)) = inner.entries.get_mut(*id as usize) else {
                    return ok(false);
                };
                e.owner = *owner;
                Applied::Ok
            }
        }
    }

    /// Writes a compact log of the live state (ids renumbered densely, blocks in eviction
    /// order so that a replay restores it) to a temporary file and renames it into place.
    /// Ids change, so this runs only before the owner binds anything (at open; `loaded` is
    /// updated to the new ids) or after it is done (at close).
    fn rewrite(&self, inner: &mut Inner, loaded: &mut Loaded) -> io::Result<()> {
        let mut out = index::header(inner.snapshot);
        let mut new_ids = vec![u32::MAX; inner.entries.len()];
        let mut entries = Entries::default();
        for le in &mut loaded.entries {
            let Some(mut e) = inner.entries.get_mut(le.id as usize).and_then(Option::take) else {
                continue;
            };
            if e.present == 0 {
                continue;
            }
            let id = entries.len() as EntryId;
            new_ids[le.id as usize] = id;
            le.id = id;
            e.rec_at = out.len() as u64;
            index::encode(
                &Record::Entry {
                    id,
                    kind: e.kind,
                    own_file: e.own_file,
                    owner: e.owner,
                    slots: e.nslots,
                    version: le.version,
                    key: loaded
                        .keys
                        .get(le.key_at..le.key_at + usize::from(le.key_len))
                        .unwrap_or_default(),
                },
                &mut out,
            );
            entries.push(Some(e));
        }
        // Blocks in eviction order, least recently used first; the eviction index is rebuilt
        // under the new ids.
        let order = inner.evict.keys_lru_first();
        let mut evict = Eviction::new(inner.evict.capacity());
        for k in order {
            let (old, slot) = ((k >> 32) as usize, k as u32);
            let Some(&id) = new_ids.get(old).filter(|i| **i != u32::MAX) else {
                continue;
            };
            let Some(loc) = entries
                .get(id as usize)
                .and_then(Option::as_ref)
                .and_then(|e| e.loc(slot))
            else {
                continue;
            };
            index::encode(&Record::Block { id, slot, loc }, &mut out);
            evict.insert(lru_key(id, slot), aligned(u64::from(loc.len)));
        }
        let (mut f, tmp) = self.dir.create_temp(INDEX)?;
        let written = f.write_all(&out).and_then(|_| f.sync_data());
        if let Err(e) = written {
            let _ = self.dir.remove(&tmp);
            return Err(e);
        }
        self.dir.rename(&tmp, INDEX)?;
        let _ = self.dir.sync();
        let file = self.dir.open_rw(INDEX, false)?;
        loaded.entries.retain(|le| {
            entries.get(le.id as usize).is_some_and(Option::is_some) && le.present > 0
        });
        inner.entries = entries;
        inner.evict = evict;
        let mut log = lock(&self.log);
        log.file = file;
        log.len = out.len() as u64;
        log.garbage = 0;
        log.pending.clear();
        debug!(bytes = out.len(), "cache index rewritten");
        Ok(())
    }

    /// Number of entry ids handed out (live or dropped).
    pub fn entries_len(&self) -> usize {
        lock(&self.inner).entries.len()
    }

    /// Bytes cached now.
    pub fn used(&self) -> u64 {
        lock(&self.inner).evict.used()
    }

    /// The capacity in bytes (lowered automatically if scratch runs out of space).
    pub fn capacity(&self) -> u64 {
        lock(&self.inner).evict.capacity()
    }

    /// The snapshot the owners recorded in the index refer to.
    pub fn snapshot(&self) -> u128 {
        lock(&self.inner).snapshot
    }

    /// Records that owner ids now refer to snapshot `id` (written into the log header).
    pub fn set_snapshot(&self, id: u128) -> io::Result<()> {
        let mut inner = lock(&self.inner);
        if inner.snapshot == id {
            return Ok(());
        }
        inner.snapshot = id;
        let log = lock(&self.log);
        log.file.write_all_at(&index::header(id), 0)
    }

    /// Creates an entry for `key` with contents `version`, `slots` blocks, and `owner` (the
    /// caller's node id, recorded so a remount on the same snapshot rebinds it at once).
    /// `own_file`: keep the blocks in an exact copy of the file (large files, passthrough).
    pub fn create(
        &self,
        kind: KeyKind,
        key: &[u8],
        version: Version,
        slots: u32,
        own_file: bool,
        owner: u32,
    ) -> EntryId {
        let mut inner = lock(&self.inner);
        let id = inner.entries.len() as EntryId;
        let mut log = lock(&self.log);
        let rec_at = log.len + log.pending.len() as u64;
        index::encode(
            &Record::Entry {
                id,
                kind,
                own_file,
                owner,
                slots,
                version,
                key,
            },
            &mut log.pending,
        );
        drop(log);
        inner.entries.push(Some(Entry {
            rec_at,
            owner,
            nslots: slots,
            present: 0,
            kind,
            own_file,
            verified: false,
            pins: 0,
            own_no: 0,
            slots: if slots > 1 {
                Slots::Empty
            } else {
                Slots::One(ABSENT)
            },
        }));
        id
    }

    /// Records that entry `id` now belongs to node `owner`.
    pub fn bind(&self, id: EntryId, owner: u32) {
        let mut inner = lock(&self.inner);
        let Some(Some(e)) = inner.entries.get_mut(id as usize) else {
            return;
        };
        if e.owner != owner {
            e.owner = owner;
            append(&self.log, &Record::Bind { id, owner });
        }
    }

    /// Drops entry `id` and everything it caches (its source changed, or nobody owns it).
    pub fn forget(&self, id: EntryId) {
        let mut inner = lock(&self.inner);
        self.forget_locked(&mut inner, id);
    }

    fn forget_locked(&self, inner: &mut Inner, id: EntryId) {
        let Some(e) = inner.entries.get(id as usize).and_then(Option::as_ref) else {
            return;
        };
        if e.pins > 0 {
            return;
        }
        for (slot, _) in e.locs() {
            inner.evict.remove(lru_key(id, slot));
            self.drop_block(inner, id, slot, false);
        }
        if let Some(slot) = inner.entries.get_mut(id as usize) {
            *slot = None;
        }
        append(&self.log, &Record::DropEntry { id });
    }

    /// Whether slot `slot` of entry `id` is stored.
    pub fn contains(&self, id: EntryId, slot: u32) -> bool {
        lock(&self.inner)
            .entries
            .get(id as usize)
            .and_then(Option::as_ref)
            .is_some_and(|e| e.loc(slot).is_some())
    }

    /// Whether every slot of entry `id` is stored.
    pub fn is_complete(&self, id: EntryId) -> bool {
        lock(&self.inner)
            .entries
            .get(id as usize)
            .and_then(Option::as_ref)
            .is_some_and(Entry::complete)
    }

    fn seg_file(&self, n: u32) -> Option<Arc<File>> {
        self.seg_files
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(n as usize)
            .cloned()
            .flatten()
    }

    /// The open own data file `no`; with `create`, made if missing (empty if `fresh_size`).
    fn own_file(&self, no: u32, fresh_size: bool, create: bool) -> io::Result<Arc<File>> {
        if let Some(f) = lock(&self.own_files).get(&no) {
            return Ok(f.clone());
        }
        let f = self.filedir.open_rw(segment::name(no), create)?;
        // A new copy starts empty and grows with the blocks written into it, so that once
        // complete it has exactly the source's size (what passthrough readers see).
        if create && fresh_size {
            f.set_len(0)?;
        }
        let f = Arc::new(f);
        lock(&self.own_files).put(no, f.clone());
        Ok(f)
    }

    /// The file and byte offset holding `loc`.
    fn locate(&self, loc: Loc) -> Option<(Arc<File>, u64)> {
        let off = u64::from(loc.off4k) * segment::ALIGN;
        let file = if loc.seg & OWN_FILE != 0 {
            self.own_file(loc.seg & !OWN_FILE, false, false).ok()?
        } else {
            self.seg_file(loc.seg)?
        };
        Some((file, off))
    }

    /// Slot `slot` of entry `id`, if stored and intact: read once from scratch into fresh
    /// memory and verified against its checksum. A corrupt block is dropped (a miss).
    pub fn read(&self, id: EntryId, slot: u32) -> Option<Bytes> {
        let loc = {
            let mut inner = lock(&self.inner);
            let loc = inner.entries.get(id as usize)?.as_ref()?.loc(slot)?;
            inner.evict.touch(lru_key(id, slot));
            loc
        };
        let (file, off) = self.locate(loc)?;
        let len = loc.len as usize;
        let mut buf = BytesMut::with_capacity(len);
        let n = read_uninit(&file, &mut buf, len, off);
        if n.as_ref().is_ok_and(|n| *n == len) && crc32fast::hash(&buf) == loc.crc {
            return Some(buf.freeze());
        }
        // Evicted (hole punched) while we read? Only a block still listed is corrupt.
        let mut inner = lock(&self.inner);
        let still = inner
            .entries
            .get(id as usize)
            .and_then(Option::as_ref)
            .and_then(|e| e.loc(slot))
            == Some(loc);
        if still {
            self.stats.corrupt_blocks.fetch_add(1, Relaxed);
            self.stats.error(format!(
                "corrupt cache block {slot} of entry {id} (re-fetched)"
            ));
            warn!(
                entry = id,
                slot, "cache block failed its checksum; re-fetching"
            );
            inner.evict.remove(lru_key(id, slot));
            self.drop_block(&mut inner, id, slot, true);
        }
        None
    }

    /// Stores `data` as slot `slot` of entry `id`; false if it was not stored (no room, write
    /// error, entry gone). Storing a slot already stored is a no-op.
    pub fn insert(&self, id: EntryId, slot: u32, data: &[u8]) -> bool {
        let len = data.len() as u64;
        if len == 0 || len > MAX_SLOT_BYTES {
            return false;
        }
        let (file, loc) = {
            let mut inner = lock(&self.inner);
            let Some(e) = inner.entries.get(id as usize).and_then(Option::as_ref) else {
                return false;
            };
            if slot >= e.nslots {
                return false;
            }
            if e.loc(slot).is_some() {
                return true;
            }
            let own = e.own_file;
            let space = aligned(len);
            let inner = &mut *inner;
            let Some(victims) = inner.evict.reserve(space, &inner.pinned) else {
                return false;
            };
            for v in victims {
                self.drop_block(inner, (v >> 32) as u32, v as u32, false);
            }
            let placed = if own {
                self.place_own(inner, id, slot)
            } else {
                self.place_packed(inner, space)
            };
            match placed {
                Ok(x) => {
                    inner.evict.insert(lru_key(id, slot), space);
                    let (file, seg, off) = x;
                    (
                        file,
                        Loc {
                            seg,
                            off4k: (off / segment::ALIGN) as u32,
                            len: len as u32,
                            crc: crc32fast::hash(data),
                        },
                    )
                }
                Err(err) => {
                    self.write_failed(inner, &err);
                    return false;
                }
            }
        };
        let off = u64::from(loc.off4k) * segment::ALIGN;
        let space = aligned(len);
        if let Err(err) = file.write_all_at(data, off) {
            punch_hole(&file, off, space);
            let mut inner = lock(&self.inner);
            inner.evict.remove(lru_key(id, slot));
            self.release_space(&mut inner, loc.seg, space);
            self.write_failed(&mut inner, &err);
            return false;
        }
        let mut inner = lock(&self.inner);
        let stored = match inner.entries.get_mut(id as usize).and_then(Option::as_mut) {
            Some(e) if e.loc(slot).is_none() => {
                e.set_loc(slot, loc);
                e.present += 1;
                e.complete() && e.kind == KeyKind::Raw
            }
            _ => {
                // Dropped (or stored by someone else) while we wrote: give the space back.
                drop(inner);
                punch_hole(&file, off, space);
                let mut inner = lock(&self.inner);
                inner.evict.remove(lru_key(id, slot));
                self.release_space(&mut inner, loc.seg, space);
                return self.contains(id, slot);
            }
        };
        if stored {
            self.stats.files_staged.fetch_add(1, Relaxed);
        }
        append(&self.log, &Record::Block { id, slot, loc });
        true
    }

    /// Space for a packed block of `space` bytes at the end of the active segment.
    fn place_packed(&self, inner: &mut Inner, space: u64) -> io::Result<(Arc<File>, u32, u64)> {
        let need_new = inner.active == 0
            || inner
                .segs
                .get(inner.active as usize)
                .is_none_or(|s| s.end + space > SEGMENT_BYTES);
        if need_new {
            let n = inner.segs.len() as u32;
            if n >= OWN_FILE {
                return Err(io::Error::other("too many segments"));
            }
            let f = self.segdir.open_rw(segment::name(n), true)?;
            f.set_len(0)?;
            inner.segs.push(SegState {
                end: 0,
                live: 0,
                exists: true,
            });
            let mut files = self.seg_files.write().unwrap_or_else(|p| p.into_inner());
            if files.len() <= n as usize {
                files.resize(n as usize + 1, None);
            }
            files[n as usize] = Some(Arc::new(f));
            drop(files);
            let old = inner.active;
            inner.active = n;
            // The previous segment may already be empty (everything evicted).
            if old != 0 {
                self.release_space(inner, old, 0);
            }
        }
        let n = inner.active;
        let file = self
            .seg_file(n)
            .ok_or_else(|| io::Error::other("segment file missing"))?;
        let seg = &mut inner.segs[n as usize];
        let off = seg.end;
        seg.end += space;
        seg.live += space;
        Ok((file, n, off))
    }

    /// The own data file of entry `id` and the offset of `slot` in it.
    fn place_own(
        &self,
        inner: &mut Inner,
        id: EntryId,
        slot: u32,
    ) -> io::Result<(Arc<File>, u32, u64)> {
        let next = inner.next_own;
        let e = inner
            .entries
            .get_mut(id as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| io::Error::other("entry gone"))?;
        let fresh = e.own_no == 0;
        if fresh {
            e.own_no = next;
        }
        let no = e.own_no;
        if fresh {
            inner.next_own += 1;
        }
        let file = self.own_file(no, fresh, true)?;
        Ok((file, OWN_FILE | no, u64::from(slot) * BLOCK_SIZE))
    }

    /// Gives back `space` bytes of segment `seg` (no-op for own files); deletes a segment left
    /// with nothing in it, unless blocks are still being appended to it.
    fn release_space(&self, inner: &mut Inner, seg: u32, space: u64) {
        if seg & OWN_FILE != 0 {
            return;
        }
        let active = inner.active;
        let Some(s) = inner.segs.get_mut(seg as usize) else {
            return;
        };
        s.live = s.live.saturating_sub(space);
        if s.live == 0 && seg != active && s.exists {
            s.exists = false;
            let _ = self.segdir.remove(segment::name(seg));
            if let Some(f) = self
                .seg_files
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .get_mut(seg as usize)
            {
                *f = None;
            }
        }
    }

    fn write_failed(&self, inner: &mut Inner, err: &io::Error) {
        self.stats.cache_full_events.fetch_add(1, Relaxed);
        if matches!(err.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)) {
            // Scratch is smaller than promised: cap the cache at what it holds now.
            let used = inner.evict.used();
            inner.evict.set_capacity(used);
            warn!(
                used,
                "scratch is full; capping the cache at its current size, reads go to the source"
            );
        } else {
            warn!(error = %err, "cache write failed; serving from the source");
        }
    }

    /// Releases a block's disk space and unlists it (the eviction index is the caller's).
    fn drop_block(&self, inner: &mut Inner, id: EntryId, slot: u32, corrupt: bool) {
        let Some(e) = inner.entries.get_mut(id as usize).and_then(Option::as_mut) else {
            return;
        };
        let Some(loc) = e.loc(slot) else {
            return;
        };
        let was_complete = e.complete() && e.kind == KeyKind::Raw;
        e.set_loc(slot, ABSENT);
        e.present -= 1;
        e.verified = false;
        let empty_own = e.own_file && e.present == 0 && e.pins == 0;
        let own_no = e.own_no;
        if was_complete {
            self.stats.files_staged.fetch_sub(1, Relaxed);
        }
        if !corrupt {
            self.stats.blocks_evicted.fetch_add(1, Relaxed);
        }
        append(&self.log, &Record::DropBlock { id, slot });
        let space = aligned(u64::from(loc.len));
        if empty_own {
            lock(&self.own_files).pop(&own_no);
            let _ = self.filedir.remove(segment::name(own_no));
            if let Some(e) = inner.entries.get_mut(id as usize).and_then(Option::as_mut) {
                e.own_no = 0;
            }
            return;
        }
        if let Some((file, off)) = self.locate(loc) {
            punch_hole(&file, off, space);
        }
        self.release_space(inner, loc.seg, space);
    }

    /// For a fully cached large file whose blocks were all verified in this mount: pins it
    /// against eviction and returns a descriptor of its exact copy, for kernel passthrough.
    /// `None` if it is not complete or not yet verified (see [`verify`](Self::verify)). Call
    /// [`unpin`](Self::unpin) when the kernel no longer uses it.
    pub fn pin_passthrough(&self, id: EntryId) -> Option<File> {
        let no = {
            let mut inner = lock(&self.inner);
            let e = inner.entries.get_mut(id as usize)?.as_mut()?;
            if !e.own_file || !e.complete() || !e.verified || e.own_no == 0 {
                return None;
            }
            e.pins += 1;
            let no = e.own_no;
            inner.pinned.insert(id);
            no
        };
        match self.filedir.open_read(segment::name(no)) {
            Ok(f) => Some(f),
            Err(_) => {
                self.unpin(id);
                None
            }
        }
    }

    /// Releases one pin taken by [`pin_passthrough`](Self::pin_passthrough).
    pub fn unpin(&self, id: EntryId) {
        let mut inner = lock(&self.inner);
        let done = match inner.entries.get_mut(id as usize).and_then(Option::as_mut) {
            Some(e) => {
                e.pins = e.pins.saturating_sub(1);
                e.pins == 0
            }
            None => true,
        };
        if done {
            inner.pinned.remove(&id);
        }
    }

    /// Verifies every stored block of entry `id` against its checksum, dropping bad ones;
    /// true if the entry is complete and intact (then passthrough may serve it). Meant for a
    /// background thread: it reads the whole entry.
    pub fn verify(&self, id: EntryId) -> bool {
        let locs = {
            let inner = lock(&self.inner);
            match inner.entries.get(id as usize).and_then(Option::as_ref) {
                Some(e) if e.complete() => e.locs(),
                _ => return false,
            }
        };
        for (slot, _) in locs {
            if self.read(id, slot).is_none() {
                return false;
            }
        }
        let mut inner = lock(&self.inner);
        match inner.entries.get_mut(id as usize).and_then(Option::as_mut) {
            Some(e) if e.complete() => {
                e.verified = true;
                true
            }
            _ => false,
        }
    }

    /// Appends the records of changes since the last flush to the index log. A killed daemon
    /// loses at most what changed since then. The write happens without blocking the cache
    /// (records keep accumulating meanwhile).
    pub fn flush(&self) -> io::Result<()> {
        let _one = lock(&self.flushing);
        let (file, at, batch) = {
            let mut log = lock(&self.log);
            if log.pending.is_empty() {
                return Ok(());
            }
            let batch = std::mem::take(&mut log.pending);
            let at = log.len;
            log.len += batch.len() as u64;
            (log.file.try_clone()?, at, batch)
        };
        match file.write_all_at(&batch, at) {
            Ok(()) => Ok(()),
            Err(e) => {
                // A torn tail would hide every later record at replay: cut it off and put the
                // batch back in front of what accumulated since, so offsets stay right.
                let _ = file.set_len(at);
                let mut log = lock(&self.log);
                let mut pending = batch;
                pending.append(&mut log.pending);
                log.pending = pending;
                log.len = at;
                Err(e)
            }
        }
    }

    /// Flushes, rewrites the log compactly if it is mostly garbage, and releases the cache
    /// directory's lock: call at unmount (nothing may be stored after it).
    pub fn close(&self) -> io::Result<()> {
        let closed = self.close_log();
        self.abandon();
        closed
    }

    /// Releases the cache directory's lock without writing anything, as a killed process
    /// would (what the last [`flush`](Self::flush) wrote is all a later open finds).
    pub fn abandon(&self) {
        lock(&self.lock).take();
    }

    fn close_log(&self) -> io::Result<()> {
        self.flush()?;
        let mut inner = lock(&self.inner);
        let (len, garbage) = {
            let log = lock(&self.log);
            (log.len, log.garbage)
        };
        if (garbage as f64) < (1.0 - COMPACT_BELOW) * len as f64 {
            return Ok(());
        }
        // Keys are read back from the log (they are not kept in memory).
        let mut buf = Vec::new();
        {
            let log = lock(&self.log);
            let mut f = &log.file;
            use std::io::Seek;
            f.seek(io::SeekFrom::Start(0))?;
            f.take(len).read_to_end(&mut buf)?;
        }
        let mut loaded = Loaded {
            snapshot: inner.snapshot,
            ..Loaded::default()
        };
        for (id, e) in inner.entries.iter().enumerate() {
            let Some(e) = e else { continue };
            if let Some((
                Record::Entry {
                    kind, key, version, ..
                },
                _,
            )) = buf.get(e.rec_at as usize..).and_then(index::decode)
            {
                loaded.push(
                    LoadedEntry {
                        id: id as EntryId,
                        kind,
                        key_at: 0,
                        key_len: 0,
                        version,
                        owner: e.owner,
                        slots: e.nslots,
                        present: e.present,
                    },
                    key,
                );
            }
        }
        self.rewrite(&mut inner, &mut loaded)
    }
}

/// Appends one record to the pending log buffer (and counts it as live data).
fn append(log: &Mutex<Log>, rec: &Record<'_>) {
    let mut log = lock(log);
    let start = log.pending.len();
    index::encode(rec, &mut log.pending);
    let own = (log.pending.len() - start) as u64;
    // What this record makes obsolete, itself included (approximately, for entries' keys).
    log.garbage += match rec {
        Record::Block { .. } | Record::Entry { .. } => 0,
        Record::DropBlock { .. } => own + BLOCK_REC,
        Record::DropEntry { .. } => own + ENTRY_REC,
        Record::Bind { .. } => own,
    };
}

/// Keys of the entries met while replaying, in one buffer.
#[derive(Default)]
struct Keys {
    bytes: Vec<u8>,
    meta: Vec<Option<(KeyKind, usize, u16, Version)>>,
}

impl Keys {
    fn push(&mut self, kind: KeyKind, key: &[u8], version: Version) {
        let len = key.len().min(index::MAX_KEY);
        self.meta
            .push(Some((kind, self.bytes.len(), len as u16, version)));
        self.bytes.extend_from_slice(&key[..len]);
    }

    fn drop(&mut self, id: usize) {
        if let Some(k) = self.meta.get_mut(id) {
            *k = None;
        }
    }
}

/// What replaying one record did.
enum Applied {
    Ok,
    /// A stale record that refers to space no longer there (safe to skip).
    Skipped,
    /// A record the log's own history contradicts: the rest of the log is not trusted.
    Contradiction,
}

/// Number of slots an entry of `kind` and `size` may have: exactly the 1 MiB blocks of a raw
/// file; a view's own unit count (bounded by its size: no unit is empty).
fn slot_bound(kind: KeyKind, size: u64, slots: u32) -> u64 {
    match kind {
        KeyKind::Raw => size.div_ceil(BLOCK_SIZE),
        KeyKind::View if u64::from(slots) <= size.max(1) => u64::from(slots),
        KeyKind::View => u64::MAX,
    }
}

/// Opens the index log (creating it with an empty header); returns it and its length.
fn open_log(dir: &CacheDir) -> io::Result<(File, u64)> {
    let f = dir.open_rw(INDEX, true)?;
    let len = f.metadata()?.len();
    if len > MAX_INDEX_BYTES {
        return Err(io::Error::other(format!(
            "cache index is {len} bytes, larger than any cache could need: remove the cache directory"
        )));
    }
    Ok((f, len))
}

/// Bytes of the log read at a time during replay, through one reused buffer: the whole log
/// read at once (157 MB for 1.28 M files) cost a remount ~0.3 s of CPU in first-touch page
/// faults alone, and as much again in peak memory.
const LOG_WINDOW: usize = 4 << 20;

/// The longest record the format can hold (a `u16` body length, its prefix and CRC): a
/// window refills before fewer bytes than this are left, so a record is never cut.
const MAX_RECORD: usize = 2 + u16::MAX as usize + 4;

/// The first `len` bytes of the index log, read in order through a window of
/// [`LOG_WINDOW`] bytes.
struct LogWindow<'f> {
    file: &'f File,
    len: u64,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    base: u64,
    /// Next unread byte of `buf`.
    pos: usize,
    /// End of valid bytes in `buf`.
    end: usize,
}

impl<'f> LogWindow<'f> {
    fn new(file: &'f File, len: u64) -> Self {
        LogWindow {
            file,
            len,
            buf: vec![0; LOG_WINDOW],
            base: 0,
            pos: 0,
            end: 0,
        }
    }

    /// The unread bytes, refilled first so that at least [`MAX_RECORD`] of them are there
    /// unless the log ends sooner; empty at the end.
    fn rest(&mut self) -> io::Result<&[u8]> {
        let file_end = self.base + self.end as u64;
        if self.end - self.pos < MAX_RECORD && file_end < self.len {
            self.buf.copy_within(self.pos..self.end, 0);
            self.base += self.pos as u64;
            self.end -= self.pos;
            self.pos = 0;
            let want = (self.buf.len() - self.end).min((self.len - file_end) as usize);
            let got = read_full_at(
                self.file,
                &mut self.buf[self.end..self.end + want],
                file_end,
            )?;
            if got < want {
                // The log ended sooner than its length said (truncated meanwhile): it ends here.
                self.len = file_end + got as u64;
            }
            self.end += got;
        }
        Ok(&self.buf[self.pos..self.end])
    }

    /// File offset of the next unread byte.
    fn at(&self) -> u64 {
        self.base + self.pos as u64
    }

    fn advance(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.end);
    }
}

/// Reads `len` bytes at `off` into the uninitialised capacity of `buf`.
fn read_uninit(file: &File, buf: &mut BytesMut, len: usize, off: u64) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    buf.reserve(len);
    let mut done = 0;
    while done < len {
        let spare = &mut buf.spare_capacity_mut()[..len - done];
        // SAFETY: pread writes at most `spare.len()` bytes into the spare capacity; only the
        // bytes it reports written are marked initialised below.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                spare.as_mut_ptr().cast(),
                spare.len(),
                (off + done as u64) as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        // SAFETY: the kernel initialised `n` more bytes.
        unsafe { buf.set_len(done + n as usize) };
        done += n as usize;
    }
    Ok(done)
}
