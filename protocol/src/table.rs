//! The direct table: which staged files a process of the mount's user may open itself, with no
//! round trip to the daemon.
//!
//! **Why.** A direct descriptor asked for over the socket costs a round trip (two context
//! switches, a JSON line each way, a descriptor passed): ~20-30 µs of CPU, as much as reading a
//! 100 KB image from the page cache. A DataLoader reads a folder of JPEGs one small file per
//! open, so the round trip alone put the CPU per GB at twice a local copy's. The table moves
//! the lookup into the reader: the daemon lists every verified copy it trusts, the reader maps
//! the list read-only and opens the copy through the cache's `files/` directory itself.
//!
//! **What a listing promises** (the daemon's side of the trust rule, docs/direct.md): the copy
//! of file number `no` in the cache's `files/` directory, inode `ino` of device `dev`, `size`
//! bytes, is the whole, verified copy of the snapshot's version of `path`, and it is never
//! changed in place while listed: it may only be unlinked (eviction and corruption remove a
//! listed copy whole, so an open descriptor keeps reading the full, correct bytes). A reader
//! that opens `files/<no>` and finds another inode, device or size (evicted and the name gone,
//! a descriptor number reused) reads through the mount instead.
//!
//! **States.** [`State::Open`]: a small copy the reader opens itself. [`State::Ask`]: a large
//! copy, evicted block by block under pressure, so a reader asks the daemon for a pinned
//! descriptor ([`crate::DirectClient::open`]). [`State::Gone`]: listed once, not trusted now.
//! The header's `complete` flag says the daemon has listed everything it trusts (its remount
//! check is done): a path not found then is read through the mount without asking.
//!
//! **Layout** (native little-endian words, one shared memory file, sealed against resizing so
//! a mapping can never fault):
//!
//! ```text
//! header   4096 B: magic "STGFSDT1", version u32, pad u32, slots u64, arena u64, seed u64,
//!                  dev u64, flags u64 (bit 0 complete, bit 1 closed)
//! slots    64 B each: meta u64 (state u8 | seq u8 | path length u16 | hash tag u32),
//!                  loc u64 (arena offset u32 | file number u32), ino u64, size u64, and what
//!                  the mount shows of the file: its inode u64, mtime ns i64,
//!                  perm u32 | nlink u32, uid u32 | gid u32
//! arena    path bytes, appended, never rewritten
//! ```
//!
//! A slot is found by open addressing from a seeded FNV-1a hash of the path (at most
//! [`MAX_PROBE`] slots; the writer does not list a path past it, which bounds a crafted
//! dataset's collisions); the path itself is compared, never only a hash. A slot, once given
//! to a path, stays that path's for the table's life, so a reader racing the writer can at
//! worst mix two listings of the same path. Each rewrite of a slot bumps its `seq`; a reader
//! reads `meta` before and after the other words and takes the listing only if it did not
//! change. The single writer is the daemon ([`TableWriter`], under its own lock); readers
//! ([`TableReader`]) only load.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// First bytes of a table.
pub const MAGIC: [u8; 8] = *b"STGFSDT1";
/// Layout version; a reader refuses any other.
pub const VERSION: u32 = 1;
/// Bytes before the first slot: one page, so slots start page-aligned.
pub const HEADER_BYTES: usize = 4096;
/// Bytes per slot: eight words (the copy, and the mount's attributes of the file, so that a
/// reader answers `fstat` of a descriptor without a lookup through the mount).
pub const SLOT_BYTES: usize = 64;
/// Most slots probed for one path: a full table or a crafted run of colliding names costs a
/// reader at most this many compares, then the open goes to the socket or the mount.
pub const MAX_PROBE: usize = 32;
/// Longest path listed (the protocol's [`crate::MAX_PATH`]; a length fits the meta's 16 bits).
pub const MAX_PATH: usize = crate::MAX_PATH;
/// Largest arena: offsets are 32 bits. A tree with more path bytes lists what fits.
pub const MAX_ARENA: u64 = u32::MAX as u64;
/// Most slots: a table for 100 M files is 5 GB of address space, far past any dataset here.
pub const MAX_SLOTS: u64 = 1 << 28;

/// Header flag: everything the daemon trusts is listed (a miss means "read through the mount").
pub const FLAG_COMPLETE: u64 = 1;
/// Header flag: the mount has ended; the table says nothing any more.
pub const FLAG_CLOSED: u64 = 2;

const OFF_SLOTS: usize = 16;
const OFF_ARENA: usize = 24;
const OFF_SEED: usize = 32;
const OFF_DEV: usize = 40;
const OFF_FLAGS: usize = 48;

/// What a slot says of its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum State {
    /// Never used.
    Empty = 0,
    /// A small copy: open it yourself.
    Open = 1,
    /// A large copy: ask the daemon for a pinned descriptor.
    Ask = 2,
    /// Listed once, not trusted now.
    Gone = 3,
}

impl State {
    fn from_bits(b: u64) -> State {
        match b & 0xff {
            1 => State::Open,
            2 => State::Ask,
            3 => State::Gone,
            _ => State::Empty,
        }
    }
}

/// The copy a [`State::Open`] listing names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copy {
    /// Its number in the cache's `files/` directory ([`copy_name`]).
    pub no: u32,
    /// Its inode.
    pub ino: u64,
    /// Its size in bytes (the source's).
    pub size: u64,
}

/// What the mount shows of a listed file (`stat` of its path there): a reader's `fstat` of the
/// copy's descriptor shows this, so the descriptor and the path are one file to the program.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shown {
    /// The mount's inode number of the file.
    pub ino: u64,
    /// Its mtime (also its atime and ctime on the mount), ns since the epoch.
    pub mtime_ns: i64,
    /// Permission bits.
    pub perm: u32,
    /// Link count.
    pub nlink: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
}

/// What the table says of a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listing {
    /// Open this copy yourself (and check it is the inode listed).
    Open(Copy),
    /// Ask the daemon for a pinned descriptor.
    Ask,
    /// Not direct now: read through the mount.
    Mount,
    /// The table does not know yet: ask the daemon.
    Unknown,
}

/// The name of copy `no` in the cache's `files/` directory: eight hex digits, as the cache
/// names its data files.
pub fn copy_name(no: u32) -> [u8; 8] {
    let mut out = [0u8; 8];
    for (i, b) in out.iter_mut().enumerate() {
        let nib = (no >> (28 - 4 * i)) & 0xf;
        *b = b"0123456789abcdef"[nib as usize];
    }
    out
}

/// The table's hash of `path` under `seed`: FNV-1a with a final mix (a plain FNV's high bits,
/// which pick the slot, vary little for paths that differ in their last bytes).
pub fn hash(seed: u64, path: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for &b in path {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // murmur3's fmix64.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The first slot probed for hash `h` in a table of `slots` slots (Lemire's multiply-shift:
/// any slot count, no division).
fn home(h: u64, slots: u64) -> u64 {
    ((u128::from(h) * u128::from(slots)) >> 64) as u64
}

fn meta_of(state: State, seq: u8, len: usize, tag: u32) -> u64 {
    (state as u64) | (u64::from(seq) << 8) | ((len as u64) << 16) | (u64::from(tag) << 32)
}

fn meta_len(meta: u64) -> usize {
    ((meta >> 16) & 0xffff) as usize
}

fn meta_tag(meta: u64) -> u32 {
    (meta >> 32) as u32
}

fn meta_seq(meta: u64) -> u8 {
    (meta >> 8) as u8
}

/// Bytes of a table of `slots` slots and `arena` path bytes.
pub fn table_bytes(slots: u64, arena: u64) -> Option<u64> {
    (HEADER_BYTES as u64)
        .checked_add(slots.checked_mul(SLOT_BYTES as u64)?)?
        .checked_add(arena)
}

/// A mapping of a table (the writer's read-write, a reader's read-only).
struct Map {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every word that changes after the table is
// published is accessed through atomics, and the arena's bytes are written before the slot
// that names them is published (release) and never rewritten.
unsafe impl Send for Map {}
// SAFETY: as above.
unsafe impl Sync for Map {}

impl Map {
    fn new(fd: BorrowedFd<'_>, len: usize, write: bool) -> io::Result<Map> {
        let prot = if write {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of `len` bytes of a descriptor we hold; the kernel
        // checks the range against the file. The file is sealed against shrinking before any
        // reader maps it, so no access within `len` can fault.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Map {
            ptr: ptr.cast(),
            len,
        })
    }

    /// The 8-byte word at byte offset `at` (aligned, inside the mapping).
    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at.is_multiple_of(8) && at + 8 <= self.len);
        // SAFETY: `at` is 8-aligned (the mapping is page-aligned) and in bounds (callers
        // check against the header's sizes, which are checked against `len`).
        unsafe { &*(self.ptr.add(at) as *const AtomicU64) }
    }

    fn bytes(&self, at: usize, len: usize) -> Option<&[u8]> {
        if at.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: in bounds; arena bytes are not written once a published slot names them.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(at), len) })
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The sizes a table's header declares, checked against the file.
#[derive(Clone, Copy)]
struct Shape {
    slots: u64,
    arena: u64,
    seed: u64,
    dev: u64,
}

impl Shape {
    fn slot_at(&self, i: u64) -> usize {
        HEADER_BYTES + (i as usize) * SLOT_BYTES
    }

    fn arena_at(&self) -> usize {
        HEADER_BYTES + (self.slots as usize) * SLOT_BYTES
    }
}

/// The daemon's side: one writer, which the caller serialises (`&mut self`).
pub struct TableWriter {
    fd: OwnedFd,
    map: Map,
    shape: Shape,
    used: u64,
    listed: u64,
}

impl TableWriter {
    /// A new, empty table in a sealed memory file, for up to about `files` listings of
    /// `arena` path bytes in all, copies on device `dev`. Its slots are `files` × 5/3 (the
    /// probe sequences stay short at that load) plus a few.
    pub fn create(files: u64, arena: u64, dev: u64) -> io::Result<TableWriter> {
        let slots = (files.saturating_mul(5) / 3)
            .saturating_add(64)
            .min(MAX_SLOTS);
        let arena = arena.clamp(1, MAX_ARENA);
        let len = table_bytes(slots, arena).ok_or(io::ErrorKind::InvalidInput)?;
        let len = usize::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
        let fd = rustix::fs::memfd_create(
            "stagefs-direct-table",
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        let map = Map::new(fd.as_fd(), len, true)?;
        let seed = {
            let mut b = [0u8; 8];
            rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty())?;
            u64::from_ne_bytes(b)
        };
        let shape = Shape {
            slots,
            arena,
            seed,
            dev,
        };
        // SAFETY: the header's first bytes, in bounds, before anyone else has the table.
        unsafe {
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), map.ptr, MAGIC.len());
            std::ptr::copy_nonoverlapping(VERSION.to_ne_bytes().as_ptr(), map.ptr.add(8), 4);
        }
        map.word(OFF_SLOTS).store(slots, Ordering::Relaxed);
        map.word(OFF_ARENA).store(arena, Ordering::Relaxed);
        map.word(OFF_SEED).store(seed, Ordering::Relaxed);
        map.word(OFF_DEV).store(dev, Ordering::Relaxed);
        map.word(OFF_FLAGS).store(0, Ordering::Release);
        // Never resized (a reader's access can never fault); and no other writable mapping
        // can ever be made, so a reader holding the descriptor cannot change the table.
        use rustix::fs::SealFlags;
        let seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
        rustix::fs::fcntl_add_seals(&fd, seals | SealFlags::FUTURE_WRITE)
            .or_else(|_| rustix::fs::fcntl_add_seals(&fd, seals))?;
        Ok(TableWriter {
            fd,
            map,
            shape,
            used: 0,
            listed: 0,
        })
    }

    /// The table's memory file, to hand to readers (sealed: they can neither resize it nor,
    /// where the kernel has `F_SEAL_FUTURE_WRITE`, map it writable).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Paths listed (in any state).
    pub fn listed(&self) -> u64 {
        self.listed
    }

    /// Sets or clears the header's flags ([`FLAG_COMPLETE`], [`FLAG_CLOSED`]).
    pub fn set_flag(&mut self, flag: u64, on: bool) {
        let w = self.map.word(OFF_FLAGS);
        if on {
            w.fetch_or(flag, Ordering::Release);
        } else {
            w.fetch_and(!flag, Ordering::Release);
        }
    }

    /// Lists `path` as `state` (with `copy` for [`State::Open`]), in its slot if it has one,
    /// else in a new one; the slot's index, or `None` if it does not fit (past [`MAX_PROBE`],
    /// the arena full, a path too long or empty): then it stays unlisted.
    pub fn put(&mut self, path: &[u8], state: State, copy: Copy, shown: Shown) -> Option<u64> {
        if path.is_empty() || path.len() > MAX_PATH || state == State::Empty {
            return None;
        }
        let h = hash(self.shape.seed, path);
        let tag = h as u32;
        let start = home(h, self.shape.slots);
        for k in 0..MAX_PROBE as u64 {
            let i = (start + k) % self.shape.slots;
            let at = self.shape.slot_at(i);
            let meta = self.map.word(at).load(Ordering::Relaxed);
            if State::from_bits(meta) == State::Empty {
                if self.used + path.len() as u64 > self.shape.arena {
                    return None;
                }
                let off = self.used;
                let dst = self.shape.arena_at() + off as usize;
                // SAFETY: in bounds (checked against the arena's size above); these bytes are
                // not yet named by any slot, so no reader reads them now.
                unsafe {
                    std::ptr::copy_nonoverlapping(path.as_ptr(), self.map.ptr.add(dst), path.len())
                };
                self.used += path.len() as u64;
                self.listed += 1;
                self.write(at, off as u32, (path.len(), tag), state, (copy, shown));
                return Some(i);
            }
            if meta_tag(meta) == tag && meta_len(meta) == path.len() && self.path_at(at) == path {
                let off = (self.map.word(at + 8).load(Ordering::Relaxed) & 0xffff_ffff) as u32;
                self.write(at, off, (path.len(), tag), state, (copy, shown));
                return Some(i);
            }
        }
        None
    }

    /// Marks slot `i` [`State::Gone`] (a listed copy not trusted any more).
    pub fn remove(&mut self, i: u64) {
        if i >= self.shape.slots {
            return;
        }
        let at = self.shape.slot_at(i);
        let w = self.map.word(at);
        let meta = w.load(Ordering::Relaxed);
        if matches!(State::from_bits(meta), State::Empty | State::Gone) {
            return;
        }
        let seq = meta_seq(meta).wrapping_add(1);
        let gone = meta_of(State::Gone, seq, meta_len(meta), meta_tag(meta));
        w.store(gone, Ordering::Release);
    }

    fn path_at(&self, at: usize) -> &[u8] {
        let meta = self.map.word(at).load(Ordering::Relaxed);
        let off = (self.map.word(at + 8).load(Ordering::Relaxed) & 0xffff_ffff) as usize;
        self.map
            .bytes(self.shape.arena_at() + off, meta_len(meta))
            .unwrap_or_default()
    }

    /// Writes slot `at` for a path of `len` bytes and hash tag `tag` at arena offset `off`:
    /// a seqlock. A used slot is first
    /// marked gone under a new `seq`, then its words change, then the meta that publishes them
    /// (`seq` again one more), so a reader that sees the same meta before and after its reads
    /// read one listing whole.
    fn write(
        &mut self,
        at: usize,
        off: u32,
        (len, tag): (usize, u32),
        state: State,
        (copy, shown): (Copy, Shown),
    ) {
        let w = self.map.word(at);
        let old = w.load(Ordering::Relaxed);
        let seq = if State::from_bits(old) == State::Empty {
            0
        } else {
            let s = meta_seq(old).wrapping_add(1);
            w.store(meta_of(State::Gone, s, len, tag), Ordering::Relaxed);
            std::sync::atomic::fence(Ordering::Release);
            s.wrapping_add(1)
        };
        let loc = u64::from(off) | (u64::from(copy.no) << 32);
        self.map.word(at + 8).store(loc, Ordering::Relaxed);
        self.map.word(at + 16).store(copy.ino, Ordering::Relaxed);
        self.map.word(at + 24).store(copy.size, Ordering::Relaxed);
        self.map.word(at + 32).store(shown.ino, Ordering::Relaxed);
        self.map
            .word(at + 40)
            .store(shown.mtime_ns as u64, Ordering::Relaxed);
        let pn = u64::from(shown.perm) | (u64::from(shown.nlink) << 32);
        self.map.word(at + 48).store(pn, Ordering::Relaxed);
        let ug = u64::from(shown.uid) | (u64::from(shown.gid) << 32);
        self.map.word(at + 56).store(ug, Ordering::Relaxed);
        w.store(meta_of(state, seq, len, tag), Ordering::Release);
    }
}

/// Counters the readers keep for the daemon (it does not see their opens): a page of shared
/// memory every reader may write, separate from the table, which none may. Informational
/// only (a reader could lie); shown in the stats as `direct_table_opens` and in `bytes_direct`.
pub struct SharedCounters {
    fd: OwnedFd,
    map: Map,
}

impl SharedCounters {
    /// A new page of counters (zero), sealed against resizing.
    pub fn create() -> io::Result<SharedCounters> {
        let fd = rustix::fs::memfd_create(
            "stagefs-direct-counters",
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, 4096)?;
        use rustix::fs::SealFlags;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let map = Map::new(fd.as_fd(), 4096, true)?;
        Ok(SharedCounters { fd, map })
    }

    /// A reader's mapping of the counters behind `fd` (checked: one sealed page).
    pub fn map(fd: BorrowedFd<'_>) -> Result<SharedCounters, TableError> {
        let st = rustix::fs::fstat(fd).map_err(io::Error::from)?;
        let seals = rustix::fs::fcntl_get_seals(fd).map_err(io::Error::from)?;
        if st.st_size != 4096 || !seals.contains(rustix::fs::SealFlags::SHRINK) {
            return Err(TableError::Bad("counters are not one sealed page"));
        }
        let map = Map::new(fd, 4096, true)?;
        let fd = rustix::io::fcntl_dupfd_cloexec(fd, 3).map_err(io::Error::from)?;
        Ok(SharedCounters { fd, map })
    }

    /// The memory file, to hand to readers.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Counts one open of `bytes` bytes.
    pub fn add(&self, bytes: u64) {
        self.map.word(0).fetch_add(1, Ordering::Relaxed);
        self.map.word(8).fetch_add(bytes, Ordering::Relaxed);
    }

    /// Opens and bytes counted so far.
    pub fn get(&self) -> (u64, u64) {
        (
            self.map.word(0).load(Ordering::Relaxed),
            self.map.word(8).load(Ordering::Relaxed),
        )
    }
}

/// A reader's mapping of a table: lookups without locks, allocation or system calls.
pub struct TableReader {
    map: Map,
    shape: Shape,
}

/// Why a table descriptor was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// Mapping or inspecting it failed.
    #[error("direct table: {0}")]
    Io(#[from] io::Error),
    /// Not a table of this version, or its sizes do not fit the file.
    #[error("direct table: {0}")]
    Bad(&'static str),
}

impl TableReader {
    /// Maps the table behind `fd` read-only and checks its header against the file's size.
    pub fn map(fd: BorrowedFd<'_>) -> Result<TableReader, TableError> {
        let st = rustix::fs::fstat(fd).map_err(io::Error::from)?;
        let len = usize::try_from(st.st_size).map_err(|_| TableError::Bad("size"))?;
        if len < HEADER_BYTES {
            return Err(TableError::Bad("shorter than its header"));
        }
        // Sealed against shrinking: a table a reader maps can never fault under it.
        let seals = rustix::fs::fcntl_get_seals(fd).map_err(io::Error::from)?;
        if !seals.contains(rustix::fs::SealFlags::SHRINK) {
            return Err(TableError::Bad("not sealed against shrinking"));
        }
        let map = Map::new(fd, len, false)?;
        let head = map.bytes(0, 12).ok_or(TableError::Bad("header"))?;
        if head[..8] != MAGIC || head[8..12] != VERSION.to_ne_bytes() {
            return Err(TableError::Bad("not a direct table of this version"));
        }
        let shape = Shape {
            slots: map.word(OFF_SLOTS).load(Ordering::Relaxed),
            arena: map.word(OFF_ARENA).load(Ordering::Relaxed),
            seed: map.word(OFF_SEED).load(Ordering::Relaxed),
            dev: map.word(OFF_DEV).load(Ordering::Relaxed),
        };
        let want = table_bytes(shape.slots, shape.arena).ok_or(TableError::Bad("sizes"))?;
        if shape.slots == 0 || shape.slots > MAX_SLOTS || want != len as u64 {
            return Err(TableError::Bad("sizes do not match the file"));
        }
        Ok(TableReader { map, shape })
    }

    /// The device the listed copies are on.
    pub fn dev(&self) -> u64 {
        self.shape.dev
    }

    /// The header's flags now.
    pub fn flags(&self) -> u64 {
        self.map.word(OFF_FLAGS).load(Ordering::Acquire)
    }

    /// What the table says of `path` (relative to the mount root) now.
    pub fn lookup(&self, path: &[u8]) -> Listing {
        self.find(path).0
    }

    /// The path listed in slot `slot` (what a descriptor opened through it shows to `fstat`).
    pub fn path(&self, slot: u64) -> Option<&[u8]> {
        if slot >= self.shape.slots {
            return None;
        }
        let at = self.shape.slot_at(slot);
        let meta = self.map.word(at).load(Ordering::Acquire);
        if State::from_bits(meta) == State::Empty {
            return None;
        }
        let off = (self.map.word(at + 8).load(Ordering::Relaxed) & 0xffff_ffff) as usize;
        self.map.bytes(self.shape.arena_at() + off, meta_len(meta))
    }

    /// What the mount shows of the file listed in slot `slot`, and its size (a listing does not
    /// change within a mount: the same path, the same version).
    pub fn shown(&self, slot: u64) -> Option<(Shown, u64)> {
        if slot >= self.shape.slots {
            return None;
        }
        let at = self.shape.slot_at(slot);
        if State::from_bits(self.map.word(at).load(Ordering::Acquire)) == State::Empty {
            return None;
        }
        let w = |k: usize| self.map.word(at + k).load(Ordering::Relaxed);
        let (pn, ug) = (w(48), w(56));
        let shown = Shown {
            ino: w(32),
            mtime_ns: w(40) as i64,
            perm: pn as u32,
            nlink: (pn >> 32) as u32,
            uid: ug as u32,
            gid: (ug >> 32) as u32,
        };
        Some((shown, w(24)))
    }

    /// [`lookup`](Self::lookup), with the slot the path is listed in (if it is).
    pub fn find(&self, path: &[u8]) -> (Listing, Option<u64>) {
        let flags = self.flags();
        if flags & FLAG_CLOSED != 0 {
            return (Listing::Unknown, None);
        }
        let miss = if flags & FLAG_COMPLETE != 0 {
            Listing::Mount
        } else {
            Listing::Unknown
        };
        if path.is_empty() || path.len() > MAX_PATH {
            return (miss, None);
        }
        let h = hash(self.shape.seed, path);
        let tag = h as u32;
        let start = home(h, self.shape.slots);
        for k in 0..MAX_PROBE as u64 {
            let i = (start + k) % self.shape.slots;
            let at = self.shape.slot_at(i);
            let w = self.map.word(at);
            let meta = w.load(Ordering::Acquire);
            let state = State::from_bits(meta);
            if state == State::Empty {
                return (miss, None);
            }
            if meta_tag(meta) != tag || meta_len(meta) != path.len() {
                continue;
            }
            let loc = self.map.word(at + 8).load(Ordering::Relaxed);
            let ino = self.map.word(at + 16).load(Ordering::Relaxed);
            let size = self.map.word(at + 24).load(Ordering::Relaxed);
            let off = (loc & 0xffff_ffff) as usize;
            let same = self
                .map
                .bytes(self.shape.arena_at() + off, path.len())
                .is_some_and(|p| p == path);
            // Changed while we read: take no half-written listing.
            std::sync::atomic::fence(Ordering::Acquire);
            if w.load(Ordering::Relaxed) != meta {
                return (Listing::Unknown, None);
            }
            if !same {
                continue;
            }
            let listing = match state {
                State::Open => Listing::Open(Copy {
                    no: (loc >> 32) as u32,
                    ino,
                    size,
                }),
                State::Ask => Listing::Ask,
                // A copy listed once and not trusted now: a socket open would be refused too.
                _ => Listing::Mount,
            };
            return (listing, Some(i));
        }
        (miss, None)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::HashMap;

    fn reader(w: &TableWriter) -> TableReader {
        TableReader::map(w.fd()).unwrap()
    }

    fn shown(k: u64) -> Shown {
        Shown {
            ino: k + 1,
            mtime_ns: -(k as i64),
            perm: 0o644,
            nlink: 1,
            uid: 1000 + k as u32,
            gid: u32::MAX,
        }
    }

    #[test]
    fn names_are_eight_hex_digits() {
        assert_eq!(&copy_name(0x2a), b"0000002a");
        assert_eq!(&copy_name(u32::MAX), b"ffffffff");
    }

    #[test]
    fn listings_round_trip_against_a_reference_model() {
        let mut w = TableWriter::create(2000, 2000 * 24, 7).unwrap();
        let r = reader(&w);
        assert_eq!(r.dev(), 7);
        let mut model: HashMap<Vec<u8>, (u64, Listing)> = HashMap::new();
        let mut rng = 0x1234_5678u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for step in 0..20_000u64 {
            let p = format!("class{:03}/img{:05}.jpg", next() % 40, next() % 50).into_bytes();
            match next() % 4 {
                0 | 1 => {
                    let c = Copy {
                        no: step as u32,
                        ino: next(),
                        size: next() % 1000,
                    };
                    if let Some(i) = w.put(&p, State::Open, c, shown(step)) {
                        model.insert(p.clone(), (i, Listing::Open(c)));
                    }
                }
                2 => {
                    if let Some(i) = w.put(
                        &p,
                        State::Ask,
                        Copy {
                            no: 0,
                            ino: 0,
                            size: 0,
                        },
                        shown(step),
                    ) {
                        model.insert(p.clone(), (i, Listing::Ask));
                    }
                }
                _ => {
                    if let Some((i, l)) = model.get_mut(&p) {
                        w.remove(*i);
                        *l = Listing::Mount;
                    }
                }
            }
            if step % 997 == 0 {
                for (p, (i, l)) in &model {
                    assert_eq!(r.find(p), (*l, Some(*i)), "{}", String::from_utf8_lossy(p));
                    assert_eq!(r.path(*i), Some(&p[..]));
                    assert!(r.shown(*i).is_some_and(|(s, _)| s.perm == 0o644));
                }
            }
        }
        assert_eq!(r.lookup(b"never/listed"), Listing::Unknown);
        w.set_flag(FLAG_COMPLETE, true);
        assert_eq!(r.lookup(b"never/listed"), Listing::Mount);
        w.set_flag(FLAG_CLOSED, true);
        assert_eq!(r.lookup(b"never/listed"), Listing::Unknown);
    }

    #[test]
    fn a_full_table_refuses_new_paths_and_keeps_the_old() {
        let mut w = TableWriter::create(1, 1 << 20, 1).unwrap();
        let r = reader(&w);
        let c = Copy {
            no: 1,
            ino: 2,
            size: 3,
        };
        let mut listed = Vec::new();
        for i in 0..200 {
            let p = format!("f{i}");
            if w.put(p.as_bytes(), State::Open, c, shown(i)).is_some() {
                listed.push(p);
            }
        }
        // 1 × 5/3 + 64 slots.
        assert_eq!(listed.len(), 65);
        for p in &listed {
            assert_eq!(r.lookup(p.as_bytes()), Listing::Open(c));
        }
    }

    #[test]
    fn an_arena_too_small_lists_what_fits() {
        let mut w = TableWriter::create(100, 10, 1).unwrap();
        let c = Copy {
            no: 1,
            ino: 2,
            size: 3,
        };
        let s = shown(3);
        let i = w.put(b"abcdef", State::Open, c, s).unwrap();
        assert!(w.put(b"ghijklm", State::Open, c, s).is_none());
        assert!(w.put(b"", State::Open, c, s).is_none());
        assert!(w
            .put(&vec![b'a'; MAX_PATH + 1], State::Open, c, s)
            .is_none());
        // Relisting a path needs no more arena.
        assert!(w.put(b"abcdef", State::Ask, c, s).is_some());
        assert_eq!(reader(&w).lookup(b"abcdef"), Listing::Ask);
        assert_eq!(reader(&w).shown(i), Some((s, 3)));
    }

    #[test]
    fn a_reader_cannot_resize_or_write_the_table() {
        let w = TableWriter::create(10, 100, 1).unwrap();
        assert!(rustix::fs::ftruncate(w.fd(), 0).is_err());
        assert!(rustix::fs::ftruncate(w.fd(), 1 << 30).is_err());
        // SAFETY: a test mapping of the sealed file, expected to fail.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                w.fd().as_raw_fd(),
                0,
            )
        };
        assert_eq!(p, libc::MAP_FAILED, "a writable mapping was allowed");
    }

    #[test]
    fn counters_are_shared_between_mappings() {
        let c = SharedCounters::create().unwrap();
        let r = SharedCounters::map(c.fd()).unwrap();
        r.add(10);
        r.add(5);
        assert_eq!(c.get(), (2, 15));
    }

    #[test]
    fn a_bad_table_is_refused() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(8192).unwrap();
        assert!(TableReader::map(f.as_fd()).is_err());
    }
}
