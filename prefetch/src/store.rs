//! The on-disk cache: one sparse data file and one [`EntryHeader`] per cached source file, under
//! `DIR/v1/<xx>/<key>.{data,meta}` (256 fan-out directories keep directory sizes small).
//!
//! Reads verify the block's CRC-32 before returning bytes; a mismatch drops the block and is a
//! miss. Headers are kept in memory and flushed by [`CacheStore::flush`] (periodically and at
//! unmount), so a killed daemon loses at most the blocks cached since the last flush, never
//! correctness. Loading reads only the headers: no scan of block data at mount time.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::num::NonZeroUsize;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::cachedir::CacheDir;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use lru::LruCache;
use tracing::{debug, warn};

use crate::error::CacheError;
use crate::eviction::{BlockKey, Eviction};
use crate::meta::{path_key, EntryHeader, FORMAT_VERSION};
use crate::source::{lock, Signature};
use crate::stats::Stats;
use crate::{block_count, block_len, BLOCK_SIZE};

/// Data-file descriptors kept open: enough for the files being read and staged at once, far
/// below the usual limit of 1024 descriptors per process.
pub const OPEN_DATA_FILES: usize = 256;

/// Where and how big the cache is.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The cache directory (created if missing).
    pub dir: PathBuf,
    /// Capacity in bytes.
    pub capacity: u64,
}

struct Entry {
    path: String,
    sig: Signature,
    crcs: Vec<Option<u32>>,
    present: u64,
    dirty: bool,
    pins: u32,
    /// Every block's checksum was verified since the mount started (needed before passthrough).
    verified: bool,
    last_used: u64,
}

impl Entry {
    /// Whether this entry was stored for `rel`: a 64-bit key hash is not identity, and a
    /// colliding (or planted) entry must never serve another file's bytes.
    fn is_for(&self, rel: &Path) -> bool {
        rel.to_str() == Some(self.path.as_str())
    }
}

struct Inner {
    entries: HashMap<u64, Entry>,
    evict: Eviction,
    pinned: HashSet<u64>,
}

/// The scratch cache.
pub struct CacheStore {
    root: CacheDir,
    inner: Mutex<Inner>,
    stats: Arc<Stats>,
    seq: AtomicU64,
    /// Lock order: `inner` before `open`, never the reverse.
    open: Mutex<LruCache<u64, Arc<File>>>,
}

impl CacheStore {
    /// Opens (or creates) the cache in `cfg.dir`, loading the headers of a previous mount.
    pub fn open(cfg: &StoreConfig, stats: Arc<Stats>) -> Result<CacheStore, CacheError> {
        let root = CacheDir::open(&cfg.dir)?.subdir(&format!("v{FORMAT_VERSION}"))?;
        // Fail now, with the directory's name, rather than on the first block write.
        root.create_temp(".probe")
            .and_then(|(_, name)| root.remove(name))
            .map_err(|source| CacheError::Dir {
                path: cfg.dir.clone(),
                source,
            })?;
        let store = CacheStore {
            root,
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                evict: Eviction::new(cfg.capacity),
                pinned: HashSet::new(),
            }),
            stats,
            seq: AtomicU64::new(1),
            open: Mutex::new(LruCache::new(
                NonZeroUsize::new(OPEN_DATA_FILES).unwrap_or(NonZeroUsize::MIN),
            )),
        };
        store.load();
        Ok(store)
    }

    /// The fan-out directory of `key` and the names of its data file and header in it.
    fn paths(&self, key: u64) -> io::Result<(CacheDir, String, String)> {
        let dir = self
            .root
            .subdir(&format!("{:02x}", key & 0xff))
            .map_err(io::Error::other)?;
        Ok((dir, format!("{key:016x}.data"), format!("{key:016x}.meta")))
    }

    /// Loads every header left by earlier mounts; drops headers without data and stale formats.
    fn load(&self) {
        let mut headers = Vec::new();
        let Ok(dirs) = self.root.list() else {
            return;
        };
        for bucket in dirs {
            let Some(dir) = bucket.to_str().and_then(|b| self.root.subdir(b).ok()) else {
                continue;
            };
            let Ok(files) = dir.list() else {
                continue;
            };
            for name in files {
                let p = Path::new(&name);
                match p.extension().and_then(|e| e.to_str()) {
                    Some("meta") => {}
                    Some("tmp") => {
                        let _ = dir.remove(&name);
                        continue;
                    }
                    _ => continue,
                }
                let data = p.with_extension("data");
                let key = p
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .and_then(|s| u64::from_str_radix(s, 16).ok());
                match (key, EntryHeader::load(&dir, &name)) {
                    (Some(key), Some(h)) if dir.exists(&data) => headers.push((key, h)),
                    _ => {
                        let _ = dir.remove(&name);
                        let _ = dir.remove(&data);
                    }
                }
            }
        }
        headers.sort_by_key(|(_, h)| h.last_used);
        let max_seq = headers.last().map_or(0, |(_, h)| h.last_used);
        self.seq.store(max_seq + 1, Relaxed);
        let mut inner = lock(&self.inner);
        for (key, h) in headers {
            let mut present = 0;
            for (idx, crc) in h.crcs.iter().enumerate() {
                if crc.is_some() {
                    present += 1;
                    inner
                        .evict
                        .insert((key, idx as u32), block_len(h.sig.size, idx as u64));
                }
            }
            let complete = present == block_count(h.sig.size);
            if complete {
                self.stats.files_staged.fetch_add(1, Relaxed);
            }
            inner.entries.insert(
                key,
                Entry {
                    path: h.path,
                    sig: h.sig,
                    crcs: h.crcs,
                    present,
                    dirty: false,
                    pins: 0,
                    verified: false,
                    last_used: h.last_used,
                },
            );
        }
        if inner.evict.used() > inner.evict.capacity() {
            // Capacity lowered since the last mount: reserving nothing evicts down to it.
            if let Some(victims) = inner.evict.reserve(0, &HashSet::new()) {
                for v in victims {
                    self.drop_block(&mut inner, v);
                }
            }
        }
        debug!(
            entries = inner.entries.len(),
            used = inner.evict.used(),
            "cache loaded"
        );
    }

    /// Bytes cached now.
    pub fn used(&self) -> u64 {
        lock(&self.inner).evict.used()
    }

    /// The capacity in bytes (lowered automatically if scratch runs out of space).
    pub fn capacity(&self) -> u64 {
        lock(&self.inner).evict.capacity()
    }

    /// Whether block `idx` of `rel` (with contents `sig`) is cached.
    pub fn contains(&self, rel: &Path, sig: Signature, idx: u64) -> bool {
        let key = path_key(rel);
        let inner = lock(&self.inner);
        inner.entries.get(&key).is_some_and(|e| {
            e.sig == sig && e.is_for(rel) && e.crcs.get(idx as usize).is_some_and(Option::is_some)
        })
    }

    /// Whether every block of `rel` (with contents `sig`) is cached.
    pub fn is_complete(&self, rel: &Path, sig: Signature) -> bool {
        let key = path_key(rel);
        let inner = lock(&self.inner);
        inner
            .entries
            .get(&key)
            .is_some_and(|e| e.sig == sig && e.is_for(rel) && e.present == block_count(sig.size))
    }

    /// Reads block `idx` into `buf` (at least the block's length) if it is cached and its
    /// checksum verifies; returns the block's length.
    pub fn read_block(
        &self,
        rel: &Path,
        sig: Signature,
        idx: u64,
        buf: &mut [u8],
    ) -> Option<usize> {
        let key = path_key(rel);
        let len = block_len(sig.size, idx) as usize;
        let (file, crc) = {
            let mut inner = lock(&self.inner);
            let seq = self.seq.fetch_add(1, Relaxed);
            let e = inner.entries.get_mut(&key)?;
            if e.sig != sig || !e.is_for(rel) {
                return None;
            }
            let crc = (*e.crcs.get(idx as usize)?)?;
            e.last_used = seq;
            let file = self.data_file(e, key).ok()?;
            inner.evict.touch((key, idx as u32));
            (file, crc)
        };
        let buf = &mut buf[..len];
        let ok = file.read_exact_at(buf, idx * BLOCK_SIZE).is_ok() && crc32fast::hash(buf) == crc;
        if ok {
            return Some(len);
        }
        // The block may have been evicted (hole punched) while we read it: only a block that is
        // still listed with the same checksum is corrupt.
        let mut inner = lock(&self.inner);
        let still = inner
            .entries
            .get(&key)
            .is_some_and(|e| e.sig == sig && e.crcs.get(idx as usize) == Some(&Some(crc)));
        if still {
            self.stats.corrupt_blocks.fetch_add(1, Relaxed);
            self.stats.error(format!(
                "corrupt cache block {idx} of {} (re-fetched)",
                rel.display()
            ));
            warn!(path = %rel.display(), block = idx, "cache block failed its checksum; re-fetching");
            self.drop_block(&mut inner, (key, idx as u32));
            inner.evict.remove((key, idx as u32));
        }
        None
    }

    /// Caches block `idx` of `rel`; returns false if it was not cached (no room, write error).
    pub fn insert_block(&self, rel: &Path, sig: Signature, idx: u64, data: &[u8]) -> bool {
        let key = path_key(rel);
        let len = data.len() as u64;
        if len != block_len(sig.size, idx) {
            return false;
        }
        let file = {
            let mut inner = lock(&self.inner);
            let seq = self.seq.fetch_add(1, Relaxed);
            let stale = inner
                .entries
                .get(&key)
                .is_some_and(|e| e.sig != sig || !e.is_for(rel));
            if stale {
                self.remove_entry(&mut inner, key);
            }
            if inner
                .entries
                .get(&key)
                .is_some_and(|e| e.crcs.get(idx as usize).is_some_and(Option::is_some))
            {
                return true;
            }
            let pinned = inner.pinned.clone();
            let Some(victims) = inner.evict.reserve(len, &pinned) else {
                return false;
            };
            for v in victims {
                self.drop_block(&mut inner, v);
            }
            // Reserve the space now: the block is listed only once its bytes are written.
            inner.evict.insert((key, idx as u32), len);
            let e = inner.entries.entry(key).or_insert_with(|| Entry {
                path: rel.to_string_lossy().into_owned(),
                sig,
                crcs: vec![None; block_count(sig.size) as usize],
                present: 0,
                dirty: true,
                pins: 0,
                verified: false,
                last_used: seq,
            });
            e.last_used = seq;
            match self.data_file(e, key) {
                Ok(f) => f,
                Err(err) => {
                    inner.evict.remove((key, idx as u32));
                    self.write_failed(&mut inner, err);
                    return false;
                }
            }
        };
        let crc = crc32fast::hash(data);
        if let Err(err) = file.write_all_at(data, idx * BLOCK_SIZE) {
            let mut inner = lock(&self.inner);
            inner.evict.remove((key, idx as u32));
            punch_hole(&file, idx * BLOCK_SIZE, len);
            self.write_failed(&mut inner, err);
            return false;
        }
        let mut inner = lock(&self.inner);
        let Some(e) = inner.entries.get_mut(&key).filter(|e| e.sig == sig) else {
            // Invalidated while we wrote: the reservation went with the entry.
            return false;
        };
        if let Some(slot) = e.crcs.get_mut(idx as usize) {
            if slot.is_none() {
                e.present += 1;
            }
            *slot = Some(crc);
            e.dirty = true;
            if e.present == block_count(sig.size) {
                self.stats.files_staged.fetch_add(1, Relaxed);
            }
        }
        true
    }

    fn write_failed(&self, inner: &mut Inner, err: io::Error) {
        self.stats.cache_full_events.fetch_add(1, Relaxed);
        if err.raw_os_error() == Some(libc::ENOSPC) || err.raw_os_error() == Some(libc::EDQUOT) {
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

    /// The open data file of an entry, creating it sparse at the source's size. Descriptors
    /// are kept in a small LRU ([`OPEN_DATA_FILES`]): one per cached file would exhaust the
    /// process's limit on a dataset of many small files.
    fn data_file(&self, e: &mut Entry, key: u64) -> io::Result<Arc<File>> {
        if let Some(f) = lock(&self.open).get(&key) {
            return Ok(f.clone());
        }
        let (dir, data, _) = self.paths(key)?;
        let f = dir.open_rw(&data, true)?;
        if f.metadata()?.len() != e.sig.size {
            f.set_len(e.sig.size)?;
        }
        let f = Arc::new(f);
        lock(&self.open).put(key, f.clone());
        Ok(f)
    }

    /// Releases a block's disk space and unlists it (the eviction index is the caller's).
    fn drop_block(&self, inner: &mut Inner, (key, idx): BlockKey) {
        let Some(e) = inner.entries.get_mut(&key) else {
            return;
        };
        if let Some(slot) = e.crcs.get_mut(idx as usize) {
            if slot.take().is_some() {
                if e.present == block_count(e.sig.size) {
                    self.stats.files_staged.fetch_sub(1, Relaxed);
                }
                e.present -= 1;
                e.dirty = true;
                e.verified = false;
                self.stats.blocks_evicted.fetch_add(1, Relaxed);
            }
        }
        if e.present == 0 {
            self.remove_entry(inner, key);
        } else if let Ok(f) = self.data_file(e, key) {
            punch_hole(
                &f,
                u64::from(idx) * BLOCK_SIZE,
                block_len(e.sig.size, u64::from(idx)),
            );
        }
    }

    fn remove_entry(&self, inner: &mut Inner, key: u64) {
        if let Some(e) = inner.entries.remove(&key) {
            if e.present == block_count(e.sig.size) && e.present > 0 {
                self.stats.files_staged.fetch_sub(1, Relaxed);
            }
            for (idx, crc) in e.crcs.iter().enumerate() {
                if crc.is_some() {
                    inner.evict.remove((key, idx as u32));
                }
            }
            inner.pinned.remove(&key);
        }
        // A later entry under this key must not write into the unlinked file.
        lock(&self.open).pop(&key);
        if let Ok((dir, data, meta)) = self.paths(key) {
            let _ = dir.remove(meta);
            let _ = dir.remove(data);
        }
    }

    /// Drops everything cached for `rel` (its source changed or vanished).
    pub fn invalidate(&self, rel: &Path) {
        let key = path_key(rel);
        let mut inner = lock(&self.inner);
        if inner.entries.get(&key).is_some_and(|e| e.pins == 0) {
            self.remove_entry(&mut inner, key);
        }
    }

    /// For a fully cached file: verifies every block once per mount, pins the file against
    /// eviction and returns its data file, ready to be handed to the kernel for passthrough.
    /// Call [`unpin`](Self::unpin) when the last handle is released.
    pub fn pin_complete(&self, rel: &Path, sig: Signature) -> Option<File> {
        let key = path_key(rel);
        let (file, crcs, verified) = {
            let mut inner = lock(&self.inner);
            let e = inner.entries.get_mut(&key)?;
            if e.sig != sig || !e.is_for(rel) || e.present != block_count(sig.size) {
                return None;
            }
            let file = self.data_file(e, key).ok()?;
            e.pins += 1;
            inner.pinned.insert(key);
            let e = inner.entries.get(&key)?;
            (file, e.crcs.clone(), e.verified)
        };
        if !verified {
            let mut buf = vec![0u8; BLOCK_SIZE as usize];
            for (idx, crc) in crcs.iter().enumerate() {
                let len = block_len(sig.size, idx as u64) as usize;
                let ok = file
                    .read_exact_at(&mut buf[..len], idx as u64 * BLOCK_SIZE)
                    .is_ok()
                    && Some(crc32fast::hash(&buf[..len])) == *crc;
                if !ok {
                    self.unpin(rel);
                    // Let the normal read path find, count and re-fetch the bad block.
                    let mut scratch = vec![0u8; BLOCK_SIZE as usize];
                    self.read_block(rel, sig, idx as u64, &mut scratch);
                    return None;
                }
            }
            if let Some(e) = lock(&self.inner).entries.get_mut(&key) {
                e.verified = true;
            }
        }
        self.paths(key)
            .and_then(|(dir, data, _)| dir.open_read(OsStr::new(&data)))
            .ok()
            .or_else(|| {
                self.unpin(rel);
                None
            })
    }

    /// Releases one pin taken by [`pin_complete`](Self::pin_complete).
    pub fn unpin(&self, rel: &Path) {
        let key = path_key(rel);
        let mut inner = lock(&self.inner);
        let done = match inner.entries.get_mut(&key) {
            Some(e) => {
                e.pins = e.pins.saturating_sub(1);
                e.pins == 0
            }
            None => true,
        };
        if done {
            inner.pinned.remove(&key);
        }
    }

    /// Writes the headers of entries changed since the last flush. Data is written before its
    /// header lists it, so a crash between the two only loses blocks.
    pub fn flush(&self) -> io::Result<()> {
        let dirty: Vec<(u64, EntryHeader)> = {
            let mut inner = lock(&self.inner);
            inner
                .entries
                .iter_mut()
                .filter(|(_, e)| e.dirty)
                .map(|(key, e)| {
                    e.dirty = false;
                    let h = EntryHeader {
                        format: FORMAT_VERSION,
                        path: e.path.clone(),
                        sig: e.sig,
                        block_size: BLOCK_SIZE,
                        crcs: e.crcs.clone(),
                        last_used: e.last_used,
                    };
                    (*key, h)
                })
                .collect()
        };
        let mut result = Ok(());
        for (key, h) in dirty {
            let stored = self
                .paths(key)
                .and_then(|(dir, _, meta)| h.store(&dir, &meta));
            if let Err(e) = stored {
                warn!(error = %e, "writing a cache header failed");
                if let Some(entry) = lock(&self.inner).entries.get_mut(&key) {
                    entry.dirty = true;
                }
                result = Err(e);
            }
        }
        result
    }
}

/// Frees the disk space of a byte range without changing the file size. Filesystems without
/// hole punching keep the bytes; the header no longer lists them, so they are never served.
fn punch_hole(file: &File, offset: u64, len: u64) {
    // SAFETY: fallocate on a descriptor we own, with a valid mode; it touches no memory.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if rc != 0 {
        debug!(error = %io::Error::last_os_error(), "hole punching unavailable");
    }
}
