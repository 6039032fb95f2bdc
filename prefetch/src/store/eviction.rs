//! The capacity limit and least-recently-used eviction of cached blocks.
//!
//! Every cached block is one entry in an [`lru::LruCache`] keyed by (entry id << 32 | slot) and
//! holding the bytes it occupies on scratch. Reserving room for a new block pops the least
//! recently used blocks until it fits; blocks of *pinned* entries (open through kernel
//! passthrough, where a punched hole would read as zeros) are skipped and put back. The caller
//! releases the victims' disk space.
//!
//! `CacheStore::make_room` applies what this decides: it reserves room for a block and
//! drops the victims (their space on scratch and their cache log records).

use std::collections::HashSet;
use std::num::NonZeroUsize;

use lru::LruCache;

use super::cache_log::record::EntryId;
use super::{CacheStore, Inner};

/// A block: its entry id in the high 32 bits, its slot in the low 32.
pub type BlockKey = u64;

/// The key of slot `slot` of entry `id`.
pub fn lru_key(id: EntryId, slot: u32) -> BlockKey {
    (u64::from(id) << 32) | u64::from(slot)
}

fn entry_of(key: BlockKey) -> u32 {
    (key >> 32) as u32
}

/// The LRU index of cached blocks and the bytes they use.
pub struct Eviction {
    lru: LruCache<BlockKey, u64>,
    used: u64,
    capacity: u64,
}

impl Eviction {
    /// An empty index with room for `capacity` bytes.
    pub fn new(capacity: u64) -> Eviction {
        Eviction {
            lru: LruCache::unbounded(),
            used: 0,
            capacity,
        }
    }

    /// An index of `blocks` in least- to most-recently-used order (a block listed again moves
    /// to the recent end), for at most `upper` blocks: the table is sized once (a remount
    /// inserts a block per cached small file; growing the table step by step cost 1.28 M
    /// files' remount a tenth of its time in rehashing).
    pub fn from_order(
        capacity: u64,
        upper: usize,
        blocks: impl Iterator<Item = (BlockKey, u64)>,
    ) -> Eviction {
        let Some(room) = NonZeroUsize::new(upper) else {
            return Eviction::new(capacity);
        };
        // Bounded by `upper` while filling, so nothing is evicted (there are at most `upper`
        // distinct blocks); unbounded afterwards, as `new` makes it.
        let mut e = Eviction {
            lru: LruCache::new(room),
            used: 0,
            capacity,
        };
        for (key, len) in blocks {
            e.insert(key, len);
        }
        e.lru.resize(NonZeroUsize::MAX);
        e
    }

    /// Bytes of cached blocks.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.lru.len()
    }

    /// Whether no block is cached.
    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Lowers the capacity, e.g. to what fits after scratch ran out of space.
    pub fn set_capacity(&mut self, capacity: u64) {
        self.capacity = capacity;
    }

    /// Marks a block as just used.
    pub fn touch(&mut self, key: BlockKey) {
        self.lru.promote(&key);
    }

    /// Records a cached block of `len` bytes (most recently used).
    pub fn insert(&mut self, key: BlockKey, len: u64) {
        if let Some(old) = self.lru.put(key, len) {
            self.used -= old;
        }
        self.used += len;
    }

    /// Forgets a block; returns its length if it was cached.
    pub fn remove(&mut self, key: BlockKey) -> Option<u64> {
        let len = self.lru.pop(&key)?;
        self.used -= len;
        Some(len)
    }

    /// Every block, least recently used first (to persist the order).
    pub fn keys_lru_first(&self) -> Vec<BlockKey> {
        self.lru.iter().rev().map(|(k, _)| *k).collect()
    }

    /// Makes room for `len` more bytes by evicting least recently used blocks of entries not
    /// in `pinned`. Returns the evicted blocks, or `None` (evicting nothing) if even evicting
    /// every unpinned block would not make room.
    pub fn reserve(&mut self, len: u64, pinned: &HashSet<u32>) -> Option<Vec<BlockKey>> {
        if len > self.capacity {
            return None;
        }
        let mut victims = Vec::new();
        let mut skipped = Vec::new();
        while self.used + len > self.capacity {
            match self.lru.pop_lru() {
                Some((key, blen)) if pinned.contains(&entry_of(key)) => skipped.push((key, blen)),
                Some((key, blen)) => {
                    self.used -= blen;
                    victims.push((key, blen));
                }
                None => break,
            }
        }
        let fits = self.used + len <= self.capacity;
        // Pinned blocks go back as least recently used, in their old order.
        for (key, blen) in skipped.into_iter().rev() {
            self.lru.put(key, blen);
            self.lru.demote(&key);
        }
        if !fits {
            for (key, blen) in victims.into_iter().rev() {
                self.lru.put(key, blen);
                self.lru.demote(&key);
                self.used += blen;
            }
            return None;
        }
        Some(victims.into_iter().map(|(k, _)| k).collect())
    }
}

impl CacheStore {
    /// Makes room for `space` more bytes by evicting least-recently-used blocks of unpinned
    /// entries; false if that cannot be done (everything left is pinned, or `space` exceeds
    /// the capacity).
    pub(super) fn make_room(&self, inner: &mut Inner, space: u64) -> bool {
        let Some(victims) = inner.evict.reserve(space, &inner.pinned) else {
            return false;
        };
        for v in victims {
            self.drop_block(inner, (v >> 32) as u32, v as u32, false);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(e: u32, s: u32) -> BlockKey {
        (u64::from(e) << 32) | u64::from(s)
    }

    #[test]
    fn evicts_least_recently_used_first() {
        let mut e = Eviction::new(3);
        e.insert(k(1, 0), 1);
        e.insert(k(2, 0), 1);
        e.insert(k(3, 0), 1);
        e.touch(k(1, 0));
        let victims = e.reserve(1, &HashSet::new()).unwrap();
        assert_eq!(victims, vec![k(2, 0)]);
        assert_eq!(e.used(), 2);
        assert_eq!(e.keys_lru_first(), vec![k(3, 0), k(1, 0)]);
    }

    #[test]
    fn pinned_entries_are_never_evicted() {
        let mut e = Eviction::new(2);
        e.insert(k(1, 0), 1);
        e.insert(k(2, 0), 1);
        let pinned: HashSet<u32> = [1].into_iter().collect();
        assert_eq!(e.reserve(1, &pinned).unwrap(), vec![k(2, 0)]);
        e.insert(k(3, 0), 1);
        let pinned: HashSet<u32> = [1, 3].into_iter().collect();
        assert!(e.reserve(1, &pinned).is_none(), "only pinned blocks left");
        assert_eq!(e.used(), 2, "a failed reservation evicts nothing");
    }

    #[test]
    fn from_order_keeps_the_recorded_order_and_grows_afterwards() {
        // Block 1 recorded twice: it moves to the recent end, nothing is evicted.
        let order = [(k(1, 0), 1), (k(2, 0), 2), (k(1, 0), 1), (k(3, 0), 3)];
        let mut e = Eviction::from_order(100, order.len(), order.into_iter());
        assert_eq!(e.keys_lru_first(), vec![k(2, 0), k(1, 0), k(3, 0)]);
        assert_eq!(e.used(), 6);
        // Unbounded after the bulk load: more blocks than `upper` are kept.
        for i in 10..20 {
            e.insert(k(i, 0), 1);
        }
        assert_eq!(e.len(), 13);
        assert_eq!(e.reserve(95, &HashSet::new()).unwrap()[0], k(2, 0));
        assert!(Eviction::from_order(5, 0, std::iter::empty()).is_empty());
    }

    #[test]
    fn oversized_request_is_refused() {
        let mut e = Eviction::new(10);
        assert!(e.reserve(11, &HashSet::new()).is_none());
    }
}
