//! The cache: what the mount keeps on node-local scratch, and the facade the rest of the crate
//! uses — [`CacheStore::read`], [`CacheStore::insert`], pins for passthrough, and
//! [`CacheStore::flush`] / [`CacheStore::close`].
//!
//! Where things are:
//! - `store/entries.rs`: the entry table — what is cached, under which key and
//!   [`Version`](crate::Version), in which slots.
//! - [`cache_log`]: the append-only cache log on disk (records, replay at open, compaction, the
//!   read window). Not to be confused with the filesystem's metadata snapshot file.
//! - [`scratch`]: where bytes live on disk — packed segments and own files, the
//!   segment allocator, hole punching, scratch-full — and `verify_block`, the one checksum
//!   check.
//! - [`eviction`]: the capacity limit, least-recently-used order, and
//!   `make_room`, which applies what it decides.
//!
//! Layout under the private cache directory ([`CacheDir`], locked by one mount at a time):
//! `v2/cache.log`, `v2/segments/<n>`, `v2/files/<n>`, and whatever the filesystem persists
//! beside them (its metadata snapshot).
//!
//! Entries are found by id: the filesystem binds each of its nodes to an entry, and after a
//! remount it re-binds the entries listed in the log by comparing the stored key and version
//! with its snapshot — an entry is only ever served for the path it was stored for, never
//! because a hash matched.
//!
//! Reads return checksummed [`Bytes`]: the block is read once from scratch into fresh
//! (uninitialised) memory, verified, and handed out without further copies. A mismatch drops
//! the block and is a miss, so corrupt scratch bytes are never served.
//!
//! Locking: `inner` guards the entry table, eviction and space state; the log buffer has its
//! own lock, always taken after `inner` or alone. Disk reads and writes of block bytes happen
//! with no lock held.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use lru::LruCache;
use tracing::warn;

use crate::cachedir::CacheDir;
use crate::error::CacheError;
use crate::locks;
use crate::locks::lock;
use crate::stats::Stats;

pub mod cache_log;
mod entries;
pub mod eviction;
pub mod scratch;
pub mod trust;

use cache_log::record::{self, EntryId, KeyKind, Loc, Record};
use cache_log::{append, open_log, Log, OLD_LOG_FILE};
use entries::Entries;
pub use entries::{Loaded, LoadedEntry, MAX_SLOT_BYTES};
use eviction::{lru_key, Eviction};
pub use scratch::verify_block;
use scratch::{aligned, punch_hole, DirectRead, SegState};
pub use trust::{OnTrust, TrustEvent, Trusted};

/// The cache format's directory inside the cache directory (cache log, segments, files,
/// snapshot); caches of other formats beside it are removed at open.
pub const FORMAT_DIR: &str = "v2";

/// Longest a reader's verification waits for the background one of the same copy (8 s): under
/// the direct-open client's reply timeout (10 s), so a client never gives up on an open the
/// daemon is still answering; the client reads through the mount if it does come.
pub const VERIFY_WAIT: Duration = Duration::from_secs(8);

/// Where and how big the cache is.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The cache directory (created 0700 if missing; refused if not private).
    pub dir: PathBuf,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Read blocks back with `O_DIRECT` (where scratch supports it) instead of through the
    /// page cache.
    pub direct_reads: bool,
}

/// The state behind `CacheStore::inner`.
struct Inner {
    entries: Entries,
    evict: Eviction,
    pinned: HashSet<EntryId>,
    segs: Vec<SegState>,
    /// Segment blocks are appended to (0: none yet).
    active: u32,
    next_own: u32,
    snapshot: u128,
    /// The capacity given, and the state of a scratch that ran out of space.
    full: scratch::Full,
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
    /// `O_DIRECT` read descriptors of own files, by number.
    direct_files: Mutex<LruCache<u32, Arc<File>>>,
    /// Whether blocks are read with `O_DIRECT` (configured; off at the first `EINVAL`).
    direct: AtomicBool,
    /// Told of each file whose copy has just become complete ([`Self::set_on_complete`]).
    on_complete: RwLock<Option<OnComplete>>,
    /// Told when a copy becomes trusted or stops being ([`trust`]).
    on_trust: RwLock<Option<OnTrust>>,
    /// Signalled when a verification ends (readers waiting for one, [`trust`]).
    verified_cv: Condvar,
    /// The device of the cache's `files/` directory (where every copy is).
    dev: u64,
}

/// What the store tells of a copy that has just become complete: its entry.
pub type OnComplete = Box<dyn Fn(EntryId) + Send + Sync>;

impl CacheStore {
    /// Opens (or creates) the cache in `cfg.dir`, takes its lock and replays its cache log.
    pub fn open(cfg: &StoreConfig, stats: Arc<Stats>) -> Result<(CacheStore, Loaded), CacheError> {
        let top = CacheDir::open(&cfg.dir)?;
        // Before anything is read or written: another mount of this cache would change both.
        let held = top.lock()?;
        // Caches of older formats (v1: one header + data file per source file).
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
        // The log under its earlier name (an older log format, discarded anyway).
        let _ = dir.remove(OLD_LOG_FILE);
        // Leftover temporaries of a killed daemon.
        for d in [&dir, &segdir, &filedir] {
            for name in d.list().map_err(io_err)? {
                if name.to_string_lossy().ends_with(".tmp") {
                    let _ = d.remove(&name);
                }
            }
        }
        // Sized by the descriptor limit (crate::fds).
        let cap = crate::fds::share(crate::fds::DATA_FILES);
        let dev = rustix::fs::fstat(filedir.fd()).map_or(0, |st| st.st_dev);
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
                full: scratch::Full {
                    configured: cfg.capacity,
                    ..Default::default()
                },
            }),
            log: Mutex::new(Log {
                file,
                len,
                pending: Vec::new(),
                garbage: 0,
                trust_pending: false,
            }),
            flushing: Mutex::new(()),
            stats,
            seg_files: RwLock::new(vec![None]),
            own_files: Mutex::new(LruCache::new(cap)),
            direct_files: Mutex::new(LruCache::new(cap)),
            direct: AtomicBool::new(cfg.direct_reads),
            on_complete: RwLock::new(None),
            on_trust: RwLock::new(None),
            verified_cv: Condvar::new(),
            dev,
        };
        let loaded = store.replay().map_err(io_err)?;
        Ok((store, loaded))
    }

    /// The directory the cache lives in (the filesystem keeps its snapshot there).
    pub fn dir(&self) -> &CacheDir {
        &self.dir
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

    /// The snapshot the owners recorded in the cache log refer to.
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
        log.file.write_all_at(&record::header(id), 0)
    }

    /// Slot `slot` of entry `id`, if stored and intact: read once from scratch into fresh
    /// memory and verified against its checksum. A corrupt block is dropped (a miss).
    pub fn read(&self, id: EntryId, slot: u32) -> Option<Bytes> {
        let (loc, whole) = {
            let mut inner = lock(&self.inner);
            let e = inner.entries.get(id as usize)?.as_ref()?;
            let (loc, whole) = (e.loc(slot)?, e.whole);
            inner.evict.touch(lru_key(id, slot));
            (loc, whole)
        };
        // Small copies are read through the page cache, as the direct readers read them.
        let direct = if whole {
            DirectRead::NotDirect
        } else {
            self.read_direct(loc)
        };
        let got = match direct {
            DirectRead::Block(bytes) => Some(bytes),
            DirectRead::Bad => None,
            DirectRead::NotDirect => {
                let (file, off) = self.locate(loc)?;
                scratch::read_verified(&file, off, loc)
            }
        };
        if got.is_some() {
            return got;
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
            self.recheck_full(inner);
            if !self.make_room(inner, space) {
                return false;
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
                            off4k: (off / scratch::ALIGN) as u32,
                            len: len as u32,
                            crc: crc32fast::hash(data),
                        },
                    )
                }
                Err(err) => {
                    self.scratch_full(inner, &err);
                    return false;
                }
            }
        };
        let off = u64::from(loc.off4k) * scratch::ALIGN;
        let space = aligned(len);
        // Space first, then the bytes: a block whose space or write failed is never recorded.
        if let Err(err) =
            scratch::allocate(&file, off, space).and_then(|()| file.write_all_at(data, off))
        {
            punch_hole(&file, off, space);
            let mut inner = lock(&self.inner);
            inner.evict.remove(lru_key(id, slot));
            self.release_space(&mut inner, loc.seg, space);
            self.scratch_full(&mut inner, &err);
            return false;
        }
        let mut inner = lock(&self.inner);
        let (stored, own) = match inner.entries.get_mut(id as usize).and_then(Option::as_mut) {
            Some(e) if e.loc(slot).is_none() => {
                e.set_loc(slot, loc);
                e.present += 1;
                (e.complete() && e.kind == KeyKind::Raw, e.own_file)
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
        drop(inner);
        if stored && own {
            if let Some(tell) = locks::read(&self.on_complete).as_ref() {
                tell(id);
            }
        }
        true
    }

    /// Sets what is told of each large file whose copy becomes complete (the mount verifies
    /// it in the background, so the next epoch's opens find it verified); `None` stops it.
    pub fn set_on_complete(&self, tell: Option<OnComplete>) {
        *locks::write(&self.on_complete) = tell;
    }

    /// For a fully cached large file whose blocks were all verified in this mount: pins it
    /// against eviction and returns a descriptor of its exact copy, for kernel passthrough.
    /// `None` if it is not complete or not yet verified (see [`verify`](Self::verify)). Call
    /// [`unpin`](Self::unpin) when the kernel no longer uses it.
    pub fn pin_passthrough(&self, id: EntryId) -> Option<File> {
        let no = {
            let mut inner = lock(&self.inner);
            let e = inner.entries.get_mut(id as usize)?.as_mut()?;
            if !e.own_file || !e.complete() || !e.verified || e.own_no == 0 || e.whole {
                return None;
            }
            e.pins += 1;
            let no = e.own_no;
            inner.pinned.insert(id);
            no
        };
        match self.filedir.open_read(scratch::name(no)) {
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

    /// Appends the records of changes since the last flush to the cache log. A killed daemon
    /// loses at most what changed since then. The write happens without blocking the cache
    /// (records keep accumulating meanwhile).
    pub fn flush(&self) -> io::Result<()> {
        let _one = lock(&self.flushing);
        let (file, at, batch, trust) = {
            let mut log = lock(&self.log);
            if log.pending.is_empty() {
                return Ok(());
            }
            let batch = std::mem::take(&mut log.pending);
            let at = log.len;
            log.len += batch.len() as u64;
            let trust = std::mem::take(&mut log.trust_pending);
            (log.file.try_clone()?, at, batch, trust)
        };
        // A `Trusted` record vouches for a copy's bytes: they reach the disk first (trust.rs).
        let synced = if trust {
            rustix::fs::syncfs(self.filedir.fd()).map_err(io::Error::from)
        } else {
            Ok(())
        };
        match synced.and_then(|()| file.write_all_at(&batch, at)) {
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
                log.trust_pending |= trust;
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
}
