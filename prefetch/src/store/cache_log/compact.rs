//! Compaction: the cache log rewritten with only what is live, when it is mostly garbage
//! (dropped blocks and entries) or damaged — at open, and at close, where the keys are read
//! back from the log itself through the [`LogWindow`] (they are not kept in memory).

use std::io::{self, Write};

use tracing::debug;

use crate::locks::lock;

use super::super::entries::{Entries, Loaded, LoadedEntry};
use super::super::eviction::{lru_key, Eviction};
use super::super::scratch::aligned;
use super::super::{CacheStore, Inner};
use super::record::{self, EntryId, Record};
use super::window::LogWindow;
use super::{COMPACT_BELOW, LOG_FILE};

impl CacheStore {
    /// Writes a compact log of the live state (ids renumbered densely, blocks in eviction
    /// order so that a replay restores it) to a temporary file and renames it into place.
    /// Ids change, so this runs only before the owner binds anything (at open; `loaded` is
    /// updated to the new ids) or after it is done (at close).
    pub(in crate::store) fn rewrite(
        &self,
        inner: &mut Inner,
        loaded: &mut Loaded,
    ) -> io::Result<()> {
        let mut out = record::header(inner.snapshot);
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
            let key = loaded
                .keys
                .get(le.key_at..le.key_at + usize::from(le.key_len))
                .unwrap_or_default();
            record::encode(&e.record(id, le.version, key), &mut out);
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
            record::encode(&Record::Block { id, slot, loc }, &mut out);
            evict.insert(lru_key(id, slot), aligned(u64::from(loc.len)));
        }
        // After the blocks: a `Trusted` record applies to a complete entry.
        for (id, e) in entries.iter().enumerate() {
            if let Some(e) = e.as_ref().filter(|e| e.trust_ino != 0 && e.complete()) {
                let rec = Record::Trusted {
                    id: id as EntryId,
                    ino: e.trust_ino,
                    ctime_ns: e.trust_ctime,
                };
                record::encode(&rec, &mut out);
            }
        }
        let (mut f, tmp) = self.dir.create_temp(LOG_FILE)?;
        let written = f.write_all(&out).and_then(|_| f.sync_data());
        if let Err(e) = written {
            let _ = self.dir.remove(&tmp);
            return Err(e);
        }
        self.dir.rename(&tmp, LOG_FILE)?;
        let _ = self.dir.sync();
        let file = self.dir.open_rw(LOG_FILE, false)?;
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
        debug!(bytes = out.len(), "cache log rewritten");
        Ok(())
    }

    /// Flushes, and rewrites the log compactly if it is mostly garbage (at unmount).
    pub(in crate::store) fn close_log(&self) -> io::Result<()> {
        self.flush()?;
        let mut inner = lock(&self.inner);
        let (len, garbage) = {
            let log = lock(&self.log);
            (log.len, log.garbage)
        };
        if (garbage as f64) < (1.0 - COMPACT_BELOW) * len as f64 {
            return Ok(());
        }
        // Keys are read back from the log (they are not kept in memory), streamed through the
        // window as replay reads it: entries' records are in id order in the log.
        let file = lock(&self.log).file.try_clone()?;
        let mut win = LogWindow::new(&file, len);
        let mut loaded = Loaded {
            snapshot: inner.snapshot,
            ..Loaded::default()
        };
        for (id, e) in inner.entries.iter().enumerate() {
            let Some(e) = e else { continue };
            if e.rec_at < win.at() {
                win = LogWindow::new(&file, len);
            }
            win.seek_forward(e.rec_at);
            if let Some((Record::Entry(r), _)) = record::decode(win.rest()?) {
                let (kind, key, version) = (r.kind, r.key, r.version);
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
        drop(win);
        self.rewrite(&mut inner, &mut loaded)
    }
}
