//! The entry table: what the cache holds, by entry id.
//!
//! An *entry* caches one thing — a source file's bytes or a rendered view's — under a typed key
//! (the path it stands for) and the [`Version`] of the contents; its *slots* are its blocks
//! (1 MiB of a source file, one render unit of a view), each a [`Loc`] on scratch. Entries are
//! found by id (dense, in creation order), in fixed chunks of [`CHUNK`] so that a million of
//! them cost a million entries and no copy when the table grows. Keys are not kept here (a
//! million paths would cost tens of MB): an entry remembers where its record is in the cache
//! log, and the key is read back from there when needed.
//!
//! [`Loaded`] is what opening the cache found, for the filesystem to bind to its nodes; the
//! lifecycle methods (`create`, `bind`, `forget`, `contains`, `is_complete`) are here too.

use crate::locks::lock;
use crate::source::Version;
use crate::BLOCK_SIZE;

use super::cache_log::append;
use super::cache_log::record::{self, EntryId, EntryRecord, KeyKind, Loc, Record};
use super::eviction::lru_key;
use super::{CacheStore, Inner};

/// Largest slot the cache stores: a [`Loc`]'s length is a `u32`. One bound, shared by
/// [`CacheStore::insert`](super::CacheStore::insert) and the log replay, so whatever is stored
/// survives a remount (a rendered image slot of `--image-size` 8192 is 192 MiB; raw blocks are
/// [`BLOCK_SIZE`]).
pub const MAX_SLOT_BYTES: u64 = u32::MAX as u64;

/// Copies of at most this many bytes are evicted whole (`Entry::whole`): the staging
/// threshold for small files (4 MiB, [`crate::SMALL_FILE`]).
pub const WHOLE_BYTES: u64 = crate::SMALL_FILE;

/// Blocks of an entry.
pub(super) enum Slots {
    /// One slot (most small files); `len == 0` means absent.
    One(Loc),
    /// Several slots, allocated at the first stored block.
    Many(Box<[Loc]>),
    /// Several slots, none stored yet.
    Empty,
}

pub(super) const ABSENT: Loc = Loc {
    seg: 0,
    off4k: 0,
    len: 0,
    crc: 0,
};

/// One cached thing (see the module docs).
pub(super) struct Entry {
    /// Offset of this entry's record in the log (for rewriting the log without keeping keys in
    /// memory: a million paths would cost tens of MB).
    pub(super) rec_at: u64,
    pub(super) owner: u32,
    pub(super) nslots: u32,
    pub(super) present: u32,
    pub(super) kind: KeyKind,
    pub(super) own_file: bool,
    /// A copy of its own that is evicted whole, never block by block: a small file. Its copy is
    /// only ever unlinked, never changed in place, so a descriptor of it (direct, unpinned)
    /// always reads all of its bytes.
    pub(super) whole: bool,
    /// The source's mtime (what the copy's own mtime is set to before it is handed out).
    pub(super) mtime_ns: i64,
    /// What identifies the copy as verified ([`super::trust`]): its inode (0: not recorded) and
    /// change time, from this mount's verification or a `Trusted` record of an earlier one.
    pub(super) trust_ino: u64,
    pub(super) trust_ctime: i64,
    /// Every block verified against its checksum since this mount started (passthrough reads
    /// bypass the daemon, so they are allowed only then).
    pub(super) verified: bool,
    /// A verification of it is under way (in the background or for a reader): a second one
    /// waits for it or skips it instead of reading the copy again.
    pub(super) verifying: bool,
    /// Created in this mount: every block of the copy was written by this mount from bytes
    /// whose checksum it computed as it wrote them, so, once complete, it is trusted without
    /// being read back ([`super::trust`]). False for entries replayed from the cache log.
    pub(super) written_here: bool,
    pub(super) pins: u32,
    /// Number of the own data file (0 until the first block is stored).
    pub(super) own_no: u32,
    pub(super) slots: Slots,
}

impl Entry {
    /// The cache log record that creates this entry as `id`, for `key` at `version`.
    pub(super) fn record<'a>(&self, id: EntryId, version: Version, key: &'a [u8]) -> Record<'a> {
        Record::Entry(EntryRecord {
            id,
            kind: self.kind,
            own_file: self.own_file,
            owner: self.owner,
            slots: self.nslots,
            version,
            key,
        })
    }

    /// A new entry with nothing stored yet; `rec_at` is where its record is in the cache log.
    /// The one place an entry is built (creation and replay both come here).
    pub(super) fn new(
        rec_at: u64,
        kind: KeyKind,
        own_file: bool,
        owner: u32,
        nslots: u32,
        mtime_ns: i64,
    ) -> Entry {
        Entry {
            rec_at,
            owner,
            nslots,
            present: 0,
            kind,
            own_file,
            whole: own_file && u64::from(nslots) * BLOCK_SIZE <= WHOLE_BYTES,
            mtime_ns,
            trust_ino: 0,
            trust_ctime: 0,
            verified: false,
            verifying: false,
            written_here: false,
            pins: 0,
            own_no: 0,
            slots: if nslots > 1 {
                Slots::Empty
            } else {
                Slots::One(ABSENT)
            },
        }
    }

    pub(super) fn loc(&self, slot: u32) -> Option<Loc> {
        let l = match &self.slots {
            Slots::One(l) if slot == 0 => *l,
            Slots::Many(v) => *v.get(slot as usize)?,
            _ => return None,
        };
        (l.len > 0).then_some(l)
    }

    pub(super) fn set_loc(&mut self, slot: u32, loc: Loc) {
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

    pub(super) fn locs(&self) -> Vec<(u32, Loc)> {
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

    pub(super) fn complete(&self) -> bool {
        self.present == self.nslots && self.nslots > 0
    }
}

/// Entries by id, in fixed chunks: a million entries cost a million entries, not the up to
/// twice as many a doubling `Vec` reserves (and no copy of them all when it grows).
#[derive(Default)]
pub(super) struct Entries {
    chunks: Vec<Vec<Option<Entry>>>,
    len: usize,
}

/// Entries per chunk: 64 Ki × ~56 B ≈ 3.5 MiB, small next to a cache of many files.
const CHUNK: usize = 1 << 16;

impl Entries {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn push(&mut self, e: Option<Entry>) {
        if self.len.is_multiple_of(CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        if let Some(c) = self.chunks.last_mut() {
            c.push(e);
            self.len += 1;
        }
    }

    pub(super) fn get(&self, i: usize) -> Option<&Option<Entry>> {
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)
    }

    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut Option<Entry>> {
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Option<Entry>> {
        self.chunks.iter().flatten()
    }
}

/// An entry found in the cache log at open, for the owner to bind (or forget); its key is
/// [`Loaded::key`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedEntry {
    /// Its id.
    pub id: EntryId,
    /// What it caches.
    pub kind: KeyKind,
    /// Where its key is in [`Loaded`]'s key bytes.
    pub(super) key_at: usize,
    pub(super) key_len: u16,
    /// The version of the cached contents.
    pub version: Version,
    /// The owner's node id recorded with it (meaningful if the snapshot is the same).
    pub owner: u32,
    /// Its number of slots.
    pub slots: u32,
    /// Slots stored.
    pub present: u32,
}

/// What [`CacheStore::open`](super::CacheStore::open) found: the entries to bind and the snapshot their owners refer to.
/// Keys live in one buffer (not one allocation per entry: a million of those would outlive
/// the binding as heap fragmentation).
#[derive(Debug, Default)]
pub struct Loaded {
    /// The snapshot id recorded in the cache log (0 if none).
    pub snapshot: u128,
    /// The entries, in id order.
    pub entries: Vec<LoadedEntry>,
    pub(super) keys: Vec<u8>,
}

impl Loaded {
    /// The key of `e` (the path it stands for).
    pub fn key(&self, e: &LoadedEntry) -> &[u8] {
        self.keys
            .get(e.key_at..e.key_at + usize::from(e.key_len))
            .unwrap_or_default()
    }

    pub(super) fn push(&mut self, mut e: LoadedEntry, key: &[u8]) {
        e.key_at = self.keys.len();
        e.key_len = key.len().min(record::MAX_KEY) as u16;
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

/// Number of slots an entry of `kind` and `size` may have: exactly the 1 MiB blocks of a raw
/// file; a view's own unit count (bounded by its size: no unit is empty).
pub(super) fn slot_bound(kind: KeyKind, size: u64, slots: u32) -> u64 {
    match kind {
        KeyKind::Raw => size.div_ceil(BLOCK_SIZE),
        KeyKind::View if u64::from(slots) <= size.max(1) => u64::from(slots),
        KeyKind::View => u64::MAX,
    }
}

/// The entry lifecycle: created by the owner for a path and version, bound to its node,
/// forgotten when its source changed or nobody owns it.
impl CacheStore {
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
        let mut e = Entry::new(rec_at, kind, own_file, owner, slots, version.mtime_ns);
        e.written_here = true;
        record::encode(&e.record(id, version, key), &mut log.pending);
        drop(log);
        inner.entries.push(Some(e));
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

    pub(super) fn forget_locked(&self, inner: &mut Inner, id: EntryId) {
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

    /// Complete entries with a data file of their own not yet verified in this mount: what the
    /// remount's check goes through (a `Trusted` record then costs one `fstatat`, else the copy
    /// is read), so a warm epoch finds its copies ready for passthrough and direct reads.
    pub fn unverified_copies(&self) -> Vec<EntryId> {
        let inner = lock(&self.inner);
        let copies = inner.entries.iter().enumerate().filter_map(|(i, e)| {
            e.as_ref()
                .filter(|e| e.own_file && !e.verified && e.complete())
                .map(|_| i as EntryId)
        });
        copies.collect()
    }
}
