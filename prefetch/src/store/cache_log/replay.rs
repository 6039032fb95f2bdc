//! Replay: the cache log read once at open, front to back through the [`LogWindow`], applying
//! each record to the entry table; then the eviction order, segment occupancy and own files are
//! rebuilt from what survived, and files nothing refers to are removed.

use std::collections::HashSet;
use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tracing::info;

use crate::locks::{self, lock};
use crate::source::Version;

use super::super::entries::{slot_bound, Entry, Loaded, LoadedEntry, ABSENT, MAX_SLOT_BYTES};
use super::super::eviction::{lru_key, Eviction};
use super::super::scratch::{self, aligned, SegState};
use super::super::{CacheStore, Inner};
use super::record::{self, EntryId, KeyKind, Record, HEADER_LEN, OWN_FILE};
use super::window::LogWindow;
use super::{BLOCK_REC, COMPACT_BELOW, ENTRY_REC};

impl CacheStore {
    /// Rebuilds the state from the log, read in windows; rewrites the log when it is mostly
    /// garbage or damaged. Returns the entries for the owner to bind.
    pub(in crate::store) fn replay(&self) -> io::Result<Loaded> {
        let mut inner = lock(&self.inner);
        let (file, log_len) = {
            let log = lock(&self.log);
            (log.file.try_clone()?, log.len)
        };
        let mut win = LogWindow::new(&file, log_len);
        let header = record::parse_header(win.rest()?);
        let snapshot = header.unwrap_or(0);
        let mut keys = Keys::default();
        // Segment files present on scratch, with their sizes (to check block records against).
        let mut seg_sizes: Vec<Option<u64>> = vec![None];
        for name in self.segdir.list()? {
            if let Some(n) = name.to_str().and_then(scratch::parse_name) {
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
            let Some((rec, n)) = record::decode(rest) else {
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
                let _ = self.segdir.remove(scratch::name(n as u32));
                seg.exists = false;
            } else {
                match self.segdir.open_rw(scratch::name(n as u32), false) {
                    Ok(f) => *file = Some(Arc::new(f)),
                    Err(_) => seg.exists = false,
                }
            }
        }
        *locks::write(&self.seg_files) = seg_files;
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
                .and_then(scratch::parse_name)
                .is_some_and(|n| owned.contains(&n));
            if !keep {
                let _ = self.filedir.remove(&name);
            }
        }
        inner.snapshot = snapshot;
        // Capacity lowered since the last mount: reserving nothing evicts down to it.
        if inner.evict.used() > inner.evict.capacity() {
            let state = &mut *inner;
            self.make_room(state, 0);
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
            "cache log loaded"
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
            Record::Entry(r) => {
                // Ids are handed out in order; anything else is not a log we wrote.
                if r.id as usize != inner.entries.len()
                    || u64::from(r.slots) != slot_bound(r.kind, r.version.size, r.slots)
                {
                    return Applied::Contradiction;
                }
                inner.entries.push(Some(Entry::new(
                    at,
                    r.kind,
                    r.own_file,
                    r.owner,
                    r.slots,
                    r.version.mtime_ns,
                )));
                keys.push(r.kind, r.key, r.version);
                Applied::Ok
            }
            Record::Block { id, slot, loc } => {
                let Some(Some(e)) = inner.entries.get_mut(*id as usize) else {
                    return ok(false);
                };
                if *slot >= e.nslots || loc.len == 0 || u64::from(loc.len) > MAX_SLOT_BYTES {
                    return ok(false);
                }
                let end = u64::from(loc.off4k) * scratch::ALIGN + u64::from(loc.len);
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
                e.trust_ino = 0;
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
            Record::Trusted { id, ino, ctime_ns } => {
                let Some(Some(e)) = inner.entries.get_mut(*id as usize) else {
                    return ok(false);
                };
                // Only a whole copy's verification means anything; the remount checks the
                // identity against the copy itself before trusting it.
                if !e.own_file || !e.complete() || *ino == 0 {
                    return Applied::Skipped;
                }
                e.trust_ino = *ino;
                e.trust_ctime = *ctime_ns;
                Applied::Ok
            }
        }
    }
}

/// Keys of the entries met while replaying, in one buffer.
#[derive(Default)]
struct Keys {
    bytes: Vec<u8>,
    meta: Vec<Option<(KeyKind, usize, u16, Version)>>,
}

impl Keys {
    fn push(&mut self, kind: KeyKind, key: &[u8], version: Version) {
        let len = key.len().min(record::MAX_KEY);
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
