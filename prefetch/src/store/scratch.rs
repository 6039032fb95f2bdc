//! Scratch space: where cached bytes live on node-local disk, and what happens when it fills.
//!
//! - Large files are kept as exact sparse copies, one *own file* per entry under `files/` (so
//!   the kernel can read a complete one through FUSE passthrough); a block goes at its offset.
//! - Small blocks are packed: a dataset of a million 100 KB images must not become a million
//!   files on scratch (inode pressure, slow remounts), so blocks of small files and rendered view
//!   units are appended to *segment* files of up to [`SEGMENT_BYTES`] under `segments/`, each
//!   block starting on a 4 KiB boundary (`place_packed`, the segment allocator).
//! - Freeing a block punches a hole over exactly its pages ([`punch_hole`]) — the alignment is
//!   what makes that safe for its neighbours — and a segment whose blocks are all gone is
//!   deleted. Space is never reused inside a segment, so a stale log record can only point at
//!   a hole (zeros that fail their checksum), never at another file's bytes.
//! - Scratch full (`ENOSPC`/`EDQUOT`): the cache is capped at what it holds and reads go to the
//!   source (`scratch_full`); a read never fails because the cache is full.
//! - Every block read back is checked by [`verify_block`], the one place a block's CRC-32 is
//!   compared: a mismatch is a miss, so corrupt scratch bytes are never served.
//! - Blocks of own files (large files) are read back with `O_DIRECT` where scratch supports it
//!   (off with `StoreConfig::direct_reads`, and at the first `EINVAL`): through the page cache
//!   a warm epoch paid a copy from scratch's page cache into the daemon on top of the one into
//!   the mount's, and the dataset was cached twice (scratch's pages and the mount's). Their
//!   blocks are 1 MiB reads already, so the device's read-ahead adds nothing. Packed blocks
//!   stay buffered: a segment holds a directory's files in the order they were stored, and
//!   the read-ahead on it is what serves an in-order reader of small files. Writes stay
//!   buffered; the kernel writes dirty pages back before a direct read of their range, so a
//!   block just written reads back exact.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tracing::{debug, warn};

use super::cache_log::append;
use super::cache_log::record::{EntryId, KeyKind, Loc, Record, OWN_FILE};
use super::entries::ABSENT;
use super::{CacheStore, Inner};
use crate::locks;
use crate::locks::lock;
use crate::source::read_uninit;
use crate::BLOCK_SIZE;

/// Largest segment: 1 GiB keeps the number of segment files (and open descriptors) at about
/// one per GiB of cache, while a deleted segment frees a useful amount at once.
pub const SEGMENT_BYTES: u64 = 1 << 30;
/// Blocks start on page boundaries so that punching one block's pages leaves neighbours intact.
pub const ALIGN: u64 = 4096;

/// `len` rounded up to the alignment: the space a block of `len` bytes takes.
pub fn aligned(len: u64) -> u64 {
    len.div_ceil(ALIGN) * ALIGN
}

/// The file name of segment `n`.
pub fn name(n: u32) -> String {
    format!("{n:08x}")
}

/// Segment number of a file name, if it is one.
pub fn parse_name(name: &str) -> Option<u32> {
    (name.len() == 8)
        .then(|| u32::from_str_radix(name, 16).ok())
        .flatten()
        .filter(|n| *n > 0 && *n < OWN_FILE)
}

/// What the store knows of one segment.
#[derive(Clone, Debug, Default)]
pub struct SegState {
    /// End of the allocated space (the next block goes here, aligned).
    pub end: u64,
    /// Bytes of blocks present (aligned); the segment is deleted when this reaches 0.
    pub live: u64,
    /// Whether the segment file exists.
    pub exists: bool,
}

/// Frees the disk space of a byte range without changing the file size. Filesystems without
/// hole punching keep the bytes; the cache log no longer lists them, so they are never served.
pub fn punch_hole(file: &File, offset: u64, len: u64) {
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

/// Allocates `len` bytes of `file` from its start without changing its size, so a copy
/// written block by block (in any order, by several fetch workers) lies in a few large extents
/// instead of one or more per block (a 256 MB file had ~30 extents, rsync's copy 5-7).
/// Filesystems without `fallocate` keep allocating as blocks arrive.
pub fn preallocate(file: &File, len: u64) {
    if let Err(e) = allocate(file, 0, len) {
        debug!(error = %e, "preallocation unavailable");
    }
}

/// Allocates the disk blocks of `len` bytes at `offset` of `file` without changing its size,
/// so a write there cannot fail for space later: a filesystem that allocates at writeback
/// could otherwise take a block as written and lose it, and the block would be recorded.
/// Filesystems without `fallocate` get the plain write.
pub fn allocate(file: &File, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on a descriptor we own, with a valid mode; it touches no memory.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP | libc::ENOSYS) => Ok(()),
        _ => Err(err),
    }
}

/// How often a cache capped by a full scratch looks again at the space left (5 s): cheap (one
/// `fstatvfs`), and soon enough that space freed by a finished job is used again.
pub const FULL_RECHECK: Duration = Duration::from_secs(5);

/// At most one warning about a full scratch per 10 s (with the count of those not logged):
/// one ENOSPC used to log 100–185 warnings, one per failed write.
pub const FULL_WARN_EVERY: Duration = Duration::from_secs(10);

/// The state of a cache whose scratch ran out of space.
#[derive(Debug, Default)]
pub struct Full {
    /// The capacity the cache was given (it never grows past it).
    pub configured: u64,
    /// When the capacity was last lowered to the space left, while it is below `configured`.
    pub capped_at: Option<Instant>,
    /// When a warning was last logged.
    pub warned_at: Option<Instant>,
    /// Failed writes not logged since.
    pub unwarned: u64,
}

/// Whether `data` are the bytes stored at `loc`: the CRC-32 recorded when the block was
/// stored. The one place a cached block is verified before it is served or passed through.
pub fn verify_block(data: &[u8], loc: Loc) -> bool {
    data.len() == loc.len as usize && crc32fast::hash(data) == loc.crc
}

/// The bytes of block `loc`, at `off` in `file`, read back from scratch into fresh
/// (uninitialised) memory, if they are all there and pass [`verify_block`].
pub(super) fn read_verified(file: &File, off: u64, loc: Loc) -> Option<Bytes> {
    let len = loc.len as usize;
    let mut buf = BytesMut::with_capacity(len);
    let n = read_uninit(file, &mut buf, len, off).ok()?;
    (n == len && verify_block(&buf, loc)).then(|| buf.freeze())
}

/// Buffers, offsets and lengths of direct reads are multiples of 4 KiB: disks have logical
/// blocks of 512 B or 4 KiB, and blocks are placed on [`ALIGN`] boundaries anyway.
const DIRECT_ALIGN: usize = ALIGN as usize;

/// Like [`read_verified`], through a descriptor opened `O_DIRECT`: the device's bytes land in
/// an aligned fresh buffer, without a copy through scratch's page cache (nor a second cached
/// copy of the dataset beside the mount's). `Ok(None)`: missing or corrupt; `Err`: direct I/O
/// itself failed (`EINVAL`: unsupported here).
pub(super) fn read_verified_direct(file: &File, off: u64, loc: Loc) -> io::Result<Option<Bytes>> {
    let len = loc.len as usize;
    let span = aligned(u64::from(loc.len)) as usize;
    let mut buf = BytesMut::with_capacity(span + DIRECT_ALIGN);
    // The block's bytes start at the first aligned address; the few bytes before it are zeroed
    // (at most 4095, against a block of up to 1 MiB read without zeroing).
    let pad = (DIRECT_ALIGN - buf.as_ptr() as usize % DIRECT_ALIGN) % DIRECT_ALIGN;
    buf.resize(pad, 0);
    let n = match read_uninit(file, &mut buf, span, off) {
        Ok(n) => n,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Err(e),
        Err(_) => return Ok(None),
    };
    if n < len {
        return Ok(None);
    }
    let bytes = buf.freeze().slice(pad..pad + len);
    Ok(verify_block(&bytes, loc).then_some(bytes))
}

/// What [`CacheStore::read_direct`] found.
pub(super) enum DirectRead {
    /// The block, read and verified.
    Block(Bytes),
    /// The block is missing or failed its checksum (a miss).
    Bad,
    /// No direct read was made (off, unsupported, or no descriptor): read the block through
    /// the page cache.
    NotDirect,
}

impl CacheStore {
    /// Block `loc` read with `O_DIRECT` and verified; [`DirectRead::NotDirect`] when direct
    /// reads are off or this filesystem has none (the caller then reads through the page cache).
    pub(super) fn read_direct(&self, loc: Loc) -> DirectRead {
        if loc.seg & OWN_FILE == 0 || !self.direct.load(Relaxed) {
            return DirectRead::NotDirect;
        }
        let file = match self.direct_file(loc.seg & !OWN_FILE) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                self.direct_unsupported(&e);
                return DirectRead::NotDirect;
            }
            // The file is gone: its blocks are.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return DirectRead::Bad,
            // Anything else (out of descriptors, say) says nothing of the block: read it
            // through the page cache as before.
            Err(_) => return DirectRead::NotDirect,
        };
        match read_verified_direct(&file, u64::from(loc.off4k) * ALIGN, loc) {
            Ok(Some(bytes)) => DirectRead::Block(bytes),
            Ok(None) => DirectRead::Bad,
            Err(e) => {
                self.direct_unsupported(&e);
                DirectRead::NotDirect
            }
        }
    }

    /// Turns direct reads off for the rest of the mount, saying so once.
    fn direct_unsupported(&self, e: &io::Error) {
        if self.direct.swap(false, Relaxed) {
            warn!(error = %e, "scratch has no direct I/O; reading it through the page cache");
        }
    }

    /// The `O_DIRECT` descriptor of own file `no`, opened once.
    fn direct_file(&self, no: u32) -> io::Result<Arc<File>> {
        if let Some(f) = lock(&self.direct_files).get(&no) {
            return Ok(f.clone());
        }
        let f = Arc::new(self.filedir.open_direct(name(no))?);
        lock(&self.direct_files).put(no, f.clone());
        Ok(f)
    }

    pub(super) fn seg_file(&self, n: u32) -> Option<Arc<File>> {
        locks::read(&self.seg_files)
            .get(n as usize)
            .cloned()
            .flatten()
    }

    /// The open own data file `no`; with `create`, made if missing (empty if `fresh_size`).
    pub(super) fn own_file(
        &self,
        no: u32,
        fresh_size: bool,
        create: bool,
    ) -> io::Result<Arc<File>> {
        if let Some(f) = lock(&self.own_files).get(&no) {
            return Ok(f.clone());
        }
        let f = self.filedir.open_rw(name(no), create)?;
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
    pub(super) fn locate(&self, loc: Loc) -> Option<(Arc<File>, u64)> {
        let off = u64::from(loc.off4k) * ALIGN;
        let file = if loc.seg & OWN_FILE != 0 {
            self.own_file(loc.seg & !OWN_FILE, false, false).ok()?
        } else {
            self.seg_file(loc.seg)?
        };
        Some((file, off))
    }

    /// Space for a packed block of `space` bytes at the end of the active segment.
    pub(super) fn place_packed(
        &self,
        inner: &mut Inner,
        space: u64,
    ) -> io::Result<(Arc<File>, u32, u64)> {
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
            let f = self.segdir.open_rw(name(n), true)?;
            f.set_len(0)?;
            inner.segs.push(SegState {
                end: 0,
                live: 0,
                exists: true,
            });
            let mut files = locks::write(&self.seg_files);
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
    pub(super) fn place_own(
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
        let whole = u64::from(e.nslots) * BLOCK_SIZE;
        if fresh {
            inner.next_own += 1;
        }
        let file = self.own_file(no, fresh, true)?;
        // The whole copy at once, where the cache has room for it now (the capacity counts
        // blocks as they are stored; this keeps the disk from holding much more than that).
        let small = inner
            .entries
            .get(id as usize)
            .and_then(Option::as_ref)
            .is_some_and(|e| e.whole);
        // Not for a small copy: its one block is allocated as it is written, and a 1 MiB
        // allocation past the end of a 100 KB file would stay allocated.
        if fresh && !small && inner.evict.used().saturating_add(whole) <= inner.evict.capacity() {
            preallocate(&file, whole);
        }
        Ok((file, OWN_FILE | no, u64::from(slot) * BLOCK_SIZE))
    }

    /// Gives back `space` bytes of segment `seg` (no-op for own files); deletes a segment left
    /// with nothing in it, unless blocks are still being appended to it.
    pub(super) fn release_space(&self, inner: &mut Inner, seg: u32, space: u64) {
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
            let _ = self.segdir.remove(name(seg));
            if let Some(f) = locks::write(&self.seg_files).get_mut(seg as usize) {
                *f = None;
            }
        }
    }

    /// Bytes scratch has left for this user (`fstatvfs` of the cache directory).
    fn space_left(&self) -> Option<u64> {
        let st = rustix::fs::fstatvfs(self.dir.fd()).ok()?;
        Some(st.f_bavail.saturating_mul(st.f_frsize))
    }

    /// The capacity scratch allows now: what the cache holds plus 15/16 of the space left
    /// (leaving some to whoever else writes there), never more than it was given.
    fn capacity_allowed(&self, inner: &Inner) -> u64 {
        let left = self.space_left().unwrap_or(0);
        inner
            .evict
            .used()
            .saturating_add(left - left / 16)
            .min(inner.full.configured)
    }

    /// Counts a failed cache write; on `ENOSPC`/`EDQUOT` caps the cache at what scratch allows
    /// now, and looks again every [`FULL_RECHECK`] ([`Self::recheck_full`]) so the capacity
    /// comes back as space frees. Warnings are rate-limited ([`FULL_WARN_EVERY`]).
    pub(super) fn scratch_full(&self, inner: &mut Inner, err: &io::Error) {
        self.stats.cache_full_events.fetch_add(1, Relaxed);
        let full = matches!(err.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT));
        if full {
            let cap = self.capacity_allowed(inner);
            inner.evict.set_capacity(cap);
            inner.full.capped_at = Some(Instant::now());
        }
        let now = Instant::now();
        if inner
            .full
            .warned_at
            .is_some_and(|at| now.duration_since(at) < FULL_WARN_EVERY)
        {
            inner.full.unwarned += 1;
            return;
        }
        let unlogged = std::mem::take(&mut inner.full.unwarned);
        inner.full.warned_at = Some(now);
        if full {
            warn!(
                capacity = inner.evict.capacity(),
                unlogged,
                "scratch is full; the cache holds what fits, reads of the rest go to the source"
            );
        } else {
            warn!(error = %err, unlogged, "cache write failed; serving from the source");
        }
    }

    /// A cache capped by a full scratch takes back the space freed since, up to its given
    /// capacity, at most every [`FULL_RECHECK`].
    pub(super) fn recheck_full(&self, inner: &mut Inner) {
        let Some(at) = inner.full.capped_at else {
            return;
        };
        if at.elapsed() < FULL_RECHECK {
            return;
        }
        let cap = self.capacity_allowed(inner).max(inner.evict.capacity());
        inner.evict.set_capacity(cap);
        inner.full.capped_at = (cap < inner.full.configured).then(Instant::now);
    }

    /// Releases a block's disk space and unlists it (the eviction index is the caller's). A
    /// small copy goes whole: all its blocks are dropped and the file unlinked, never punched,
    /// so a descriptor already open on it (a direct reader's) keeps reading every byte.
    pub(super) fn drop_block(&self, inner: &mut Inner, id: EntryId, slot: u32, corrupt: bool) {
        let Some(e) = inner.entries.get(id as usize).and_then(Option::as_ref) else {
            return;
        };
        if e.whole {
            for (s, _) in e.locs() {
                if s != slot {
                    inner.evict.remove(super::eviction::lru_key(id, s));
                    self.drop_one(inner, id, s, false);
                }
            }
        }
        self.drop_one(inner, id, slot, corrupt);
    }

    fn drop_one(&self, inner: &mut Inner, id: EntryId, slot: u32, corrupt: bool) {
        let Some(e) = inner.entries.get_mut(id as usize).and_then(Option::as_mut) else {
            return;
        };
        let Some(loc) = e.loc(slot) else {
            return;
        };
        let was_complete = e.complete() && e.kind == KeyKind::Raw;
        let was_trusted = e.verified;
        e.set_loc(slot, ABSENT);
        e.present -= 1;
        e.verified = false;
        e.trust_ino = 0;
        let owner = e.owner;
        let empty_own = e.own_file && e.present == 0 && (e.pins == 0 || e.whole);
        let own_no = e.own_no;
        if was_complete {
            self.stats.files_staged.fetch_sub(1, Relaxed);
        }
        if !corrupt {
            self.stats.blocks_evicted.fetch_add(1, Relaxed);
        }
        append(&self.log, &Record::DropBlock { id, slot });
        if was_trusted {
            self.tell(&super::TrustEvent::Untrusted(id, owner));
        }
        let space = aligned(u64::from(loc.len));
        let whole = e.whole;
        if empty_own {
            lock(&self.own_files).pop(&own_no);
            lock(&self.direct_files).pop(&own_no);
            let _ = self.filedir.remove(name(own_no));
            if let Some(e) = inner.entries.get_mut(id as usize).and_then(Option::as_mut) {
                e.own_no = 0;
            }
            return;
        }
        // A small copy is never punched: its last block's drop unlinks it (drop_block).
        if !whole {
            if let Some((file, off)) = self.locate(loc) {
                punch_hole(&file, off, space);
            }
        }
        self.release_space(inner, loc.seg, space);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_reject_others() {
        assert_eq!(parse_name(&name(0x2a)), Some(0x2a));
        assert_eq!(parse_name("0000002a.tmp"), None);
        assert_eq!(parse_name("00000000"), None);
        assert_eq!(parse_name("zzzzzzzz"), None);
        assert_eq!(aligned(1), 4096);
        assert_eq!(aligned(4096), 4096);
        assert_eq!(aligned(0), 0);
    }
}
