//! Verification and trust: when a copy on scratch may be read without the daemon checking
//! each block (kernel passthrough, direct descriptors, the direct table).
//!
//! **The rule.** A copy is trusted once every block of it has been read back and checked
//! against its CRC-32, whole, and nothing changed it since. *Verify* ([`CacheStore::verify`],
//! [`CacheStore::verify_for_reader`]) reads it: the copy is opened (never through a symlink),
//! given the source's mtime, `fstat`ed, read block by block, and `fstat`ed again; it is trusted
//! if every block passed and the inode, size and change time did not move. A copy every block
//! of which this mount wrote (`Entry::written_here`) is not read back: its blocks are the bytes
//! whose CRC-32 the daemon computed as it wrote them, the daemon is the only writer of its
//! private cache, so its identity after the last write (and the mtime set) is all there is to
//! take; reading it back would read the whole dataset from scratch a second time in a cold
//! epoch. What identifies it — inode and change time — is kept with the entry and recorded in
//! the cache log (`Trusted`).
//!
//! **Across mounts.** A remount finds those records and [`CacheStore::check_trust`] compares
//! them with the copy as it is now (one `fstatat`): the same inode, size and change time means
//! nothing wrote, truncated, punched or replaced it, so it is trusted without being read
//! again. Anything else makes it be verified again (read whole); a copy that fails is dropped
//! and fetched again, never served. Change times are kept to the nanosecond, and on Linux ≥
//! 6.13 (ext4, xfs, btrfs, tmpfs) a change after a `stat` always gets a new one; on older
//! kernels a write within the same clock tick (a few ms) as the daemon's last `fstat` could
//! keep it — the daemon is the only writer of its private cache, so that needs another
//! program of the user writing into it at that moment.
//!
//! **Durability.** A `Trusted` record is written only after scratch has its copy's bytes: the
//! flush that carries one first calls `syncfs` ([`CacheStore::flush`]), so a node that crashes
//! never leaves a record vouching for bytes that did not reach the disk.
//!
//! **Who is told.** [`TrustEvent`]s go to the owner ([`CacheStore::set_on_trust`]): a copy
//! that became trusted (the filesystem lists it in its direct table) and one that stopped
//! being (evicted, found corrupt, its entry forgotten).
//!
//! **Waiting.** One verification per copy at a time: a reader whose open finds the copy being
//! verified waits for that one on a condition variable ([`VERIFY_WAIT`] at most), instead of
//! reading it a second time.

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use crate::locks::lock;
use crate::BLOCK_SIZE;

use super::cache_log::append;
use super::cache_log::record::{EntryId, Loc, Record};
use super::scratch::{self, name};
use super::{CacheStore, Inner, VERIFY_WAIT};

/// A copy the owner may hand out or list: where it is and what it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trusted {
    /// The owner's node id.
    pub owner: u32,
    /// The copy's number in `files/`.
    pub no: u32,
    /// The device the copy is on.
    pub dev: u64,
    /// The copy's inode.
    pub ino: u64,
    /// The copy's size (the source file's).
    pub size: u64,
    /// Evicted whole, never changed in place: a descriptor of it needs no pin.
    pub whole: bool,
}

/// What the owner is told of a copy's trust.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrustEvent {
    /// Entry `.0`'s copy is trusted now.
    Trusted(EntryId, Trusted),
    /// Entry `.0` (owned by node `.1`) is not trusted any more.
    Untrusted(EntryId, u32),
}

/// Where [`CacheStore::trust`]'s events go.
pub type OnTrust = Box<dyn Fn(&TrustEvent) + Send + Sync>;

/// What a claimed verification reads.
struct Claim {
    locs: Vec<(u32, Loc)>,
    no: u32,
    mtime_ns: i64,
    size: u64,
    /// Every block was written by this mount (`Entry::written_here`): nothing to read back.
    written_here: bool,
}

/// Where the verification of one entry stands ([`CacheStore::begin_verify`]).
enum Verify {
    /// Nothing to read: verified (true), or not complete (false).
    Done(bool),
    /// Another caller is verifying it now.
    Busy,
    /// Claimed: read these blocks.
    Go(Claim),
}

/// A copy's identity as `fstat` gives it.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Ident {
    dev: u64,
    ino: u64,
    size: u64,
    ctime_ns: i64,
}

fn ident_of(st: &rustix::fs::Stat) -> Option<Ident> {
    let regular =
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile;
    regular.then(|| Ident {
        dev: st.st_dev,
        ino: st.st_ino,
        size: st.st_size as u64,
        ctime_ns: st.st_ctime * 1_000_000_000 + st.st_ctime_nsec as i64,
    })
}

/// Size of a raw entry's copy from its blocks: the last block's end.
fn size_of(locs: &[(u32, Loc)]) -> u64 {
    locs.iter()
        .map(|(slot, l)| u64::from(*slot) * BLOCK_SIZE + u64::from(l.len))
        .max()
        .unwrap_or(0)
}

/// Gives the copy the source's mtime (what a descriptor's `fstat` shows after an `exec`,
/// where no preload library translates it), before its identity is taken.
fn set_mtime(f: &File, mtime_ns: i64, have_ns: i64) {
    use rustix::fs::{futimens, Timespec, Timestamps, UTIME_OMIT};
    if have_ns == mtime_ns {
        return;
    }
    let times = Timestamps {
        last_access: Timespec {
            tv_sec: 0,
            tv_nsec: UTIME_OMIT,
        },
        last_modification: Timespec {
            tv_sec: mtime_ns.div_euclid(1_000_000_000),
            tv_nsec: mtime_ns.rem_euclid(1_000_000_000) as _,
        },
    };
    // The daemon owns the copy: times need no write access. A failure leaves its own mtime.
    let _ = futimens(f.as_fd(), &times);
}

impl CacheStore {
    /// Sets where trust events go (`None` stops them).
    pub fn set_on_trust(&self, tell: Option<OnTrust>) {
        *crate::locks::write(&self.on_trust) = tell;
    }

    pub(super) fn tell(&self, ev: &TrustEvent) {
        if let Some(f) = crate::locks::read(&self.on_trust).as_ref() {
            f(ev);
        }
    }

    /// The owner of entry `id` (its node id), if it exists.
    pub fn owner(&self, id: EntryId) -> Option<u32> {
        lock(&self.inner)
            .entries
            .get(id as usize)
            .and_then(Option::as_ref)
            .map(|e| e.owner)
    }

    /// Entry `id`'s copy if it is verified and trusted now.
    pub fn trusted(&self, id: EntryId) -> Option<Trusted> {
        let inner = lock(&self.inner);
        let e = inner.entries.get(id as usize)?.as_ref()?;
        if !(e.own_file && e.verified && e.complete() && e.trust_ino != 0) {
            return None;
        }
        Some(Trusted {
            owner: e.owner,
            no: e.own_no,
            dev: self.dev,
            ino: e.trust_ino,
            size: size_of(&e.locs()),
            whole: e.whole,
        })
    }

    /// Every entry trusted now, with its copy.
    pub fn trusted_all(&self) -> Vec<(EntryId, Trusted)> {
        let n = lock(&self.inner).entries.len();
        (0..n as EntryId)
            .filter_map(|id| self.trusted(id).map(|t| (id, t)))
            .collect()
    }

    /// A descriptor of the cache's `files/` directory (`O_PATH`, close-on-exec): where a
    /// reader given the direct table opens the copies it lists.
    pub fn files_dir(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        use rustix::fs::{Mode, OFlags};
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
        Ok(rustix::fs::openat(
            self.filedir.fd(),
            ".",
            flags,
            Mode::empty(),
        )?)
    }

    /// A fresh read-only descriptor of entry `id`'s copy, if it is trusted now and evicted
    /// whole (a small file: a descriptor of it needs no pin).
    pub fn open_whole(&self, id: EntryId) -> Option<(File, Trusted)> {
        let t = self.trusted(id).filter(|t| t.whole)?;
        let f = self.filedir.open_read(name(t.no)).ok()?;
        let same = rustix::fs::fstat(f.as_fd())
            .ok()
            .as_ref()
            .and_then(ident_of)
            .is_some_and(|i| i.ino == t.ino && i.size == t.size);
        same.then_some((f, t))
    }

    /// Verifies every block of entry `id`'s copy (with `O_DIRECT` where scratch has it:
    /// meant for a background thread, whose reads must not flood the page cache), dropping
    /// bad ones; true if it is complete, intact and trusted now. An entry verified already is
    /// not read again; one being verified by another caller is skipped (false).
    pub fn verify(&self, id: EntryId) -> bool {
        match self.begin_verify(id) {
            Verify::Done(ok) => ok,
            Verify::Busy => false,
            Verify::Go(c) => self.run_verify(id, c, false),
        }
    }

    /// [`verify`](Self::verify) through the page cache, for a reader about to read the same
    /// bytes (its reads then come from memory: the check costs it only the checksums). If the
    /// copy is being verified right now, waits for that (at most [`VERIFY_WAIT`]) instead of
    /// reading it twice.
    pub fn verify_for_reader(&self, id: EntryId) -> bool {
        let deadline = Instant::now() + VERIFY_WAIT;
        loop {
            match self.begin_verify(id) {
                Verify::Done(ok) => return ok,
                Verify::Go(c) => return self.run_verify(id, c, true),
                Verify::Busy => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    let inner = lock(&self.inner);
                    let busy = inner
                        .entries
                        .get(id as usize)
                        .and_then(Option::as_ref)
                        .is_some_and(|e| e.verifying);
                    if busy {
                        // Woken by end_verify (any entry's: then look again).
                        let _ = self
                            .verified_cv
                            .wait_timeout(inner, left)
                            .map_err(|p| p.into_inner());
                    }
                }
            }
        }
    }

    /// At a remount: trusts entry `id`'s copy without reading it if its `Trusted` record
    /// matches the copy as it is now (inode, size, change time: one `fstatat`). True if it is
    /// trusted now; false if it has no record or the copy changed (then the record is
    /// forgotten and the copy must be verified, [`verify`](Self::verify)).
    pub fn check_trust(&self, id: EntryId) -> bool {
        let (no, ino, ctime, size) = {
            let inner = lock(&self.inner);
            let Some(e) = inner.entries.get(id as usize).and_then(Option::as_ref) else {
                return false;
            };
            if e.verified && e.trust_ino != 0 {
                return true;
            }
            if !e.own_file || !e.complete() || e.trust_ino == 0 || e.verifying {
                return false;
            }
            (e.own_no, e.trust_ino, e.trust_ctime, size_of(&e.locs()))
        };
        let now = rustix::fs::statat(
            self.filedir.fd(),
            name(no),
            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        )
        .ok()
        .as_ref()
        .and_then(ident_of);
        let same = now.is_some_and(|i| i.ino == ino && i.ctime_ns == ctime && i.size == size);
        let mut inner = lock(&self.inner);
        let Some(e) = inner.entries.get_mut(id as usize).and_then(Option::as_mut) else {
            return false;
        };
        if !same || !e.complete() || e.own_no != no || e.trust_ino != ino {
            e.trust_ino = 0;
            return false;
        }
        e.verified = true;
        self.stats.copies_trusted.fetch_add(1, Relaxed);
        let t = Trusted {
            owner: e.owner,
            no,
            dev: now.map_or(self.dev, |i| i.dev),
            ino,
            size,
            whole: e.whole,
        };
        drop(inner);
        self.tell(&TrustEvent::Trusted(id, t));
        true
    }

    /// Claims the verification of `id`: done already (and how), under way elsewhere, or the
    /// blocks to read now (the caller must then end it, [`Self::end_verify`]).
    fn begin_verify(&self, id: EntryId) -> Verify {
        let mut inner = lock(&self.inner);
        match inner.entries.get_mut(id as usize).and_then(Option::as_mut) {
            Some(e) if e.complete() && e.verified => Verify::Done(true),
            Some(e) if e.complete() && e.verifying => Verify::Busy,
            Some(e) if e.complete() && e.own_file && e.own_no != 0 => {
                e.verifying = true;
                let locs = e.locs();
                Verify::Go(Claim {
                    size: size_of(&locs),
                    locs,
                    no: e.own_no,
                    mtime_ns: e.mtime_ns,
                    written_here: e.written_here,
                })
            }
            _ => Verify::Done(false),
        }
    }

    /// Reads a claimed copy and ends the claim; `page_cache`: through the page cache (for a
    /// reader), else as [`CacheStore::read`] reads (`O_DIRECT` for large copies, which also
    /// drops a corrupt block so it is fetched again).
    fn run_verify(&self, id: EntryId, c: Claim, page_cache: bool) -> bool {
        let Ok(f) = self.filedir.open_read(name(c.no)) else {
            return self.end_verify(id, None, c.no);
        };
        let stat = || {
            rustix::fs::fstat(f.as_fd())
                .ok()
                .as_ref()
                .and_then(ident_of)
        };
        let mtime_now = rustix::fs::fstat(f.as_fd())
            .map(|st| st.st_mtime * 1_000_000_000 + st.st_mtime_nsec as i64)
            .unwrap_or(i64::MIN);
        set_mtime(&f, c.mtime_ns, mtime_now);
        let before = stat().filter(|i| i.size == c.size);
        if c.written_here {
            // The bytes on scratch are the bytes this mount wrote and checksummed: what
            // identifies the copy now is all there is to record.
            return self.end_verify(id, before, c.no);
        }
        let intact = before.is_some()
            && c.locs.iter().all(|&(slot, loc)| {
                if page_cache {
                    let off = u64::from(loc.off4k) * scratch::ALIGN;
                    scratch::read_verified(&f, off, loc).is_some()
                } else {
                    self.read(id, slot).is_some()
                }
            });
        let after = stat();
        let ok = intact && before == after;
        self.end_verify(id, before.filter(|_| ok), c.no)
    }

    /// Ends a verification claimed by [`Self::begin_verify`]: with the copy's identity if all
    /// of it was intact and unchanged, the entry is trusted (if it is still complete and still
    /// that copy), recorded in the log, and the owner told. Wakes whoever waits for it.
    fn end_verify(&self, id: EntryId, ident: Option<Ident>, no: u32) -> bool {
        let mut inner = lock(&self.inner);
        let got = self.end_verify_locked(&mut inner, id, ident, no);
        drop(inner);
        self.verified_cv.notify_all();
        match got {
            Some(t) => {
                self.tell(&TrustEvent::Trusted(id, t));
                true
            }
            None => false,
        }
    }

    fn end_verify_locked(
        &self,
        inner: &mut Inner,
        id: EntryId,
        ident: Option<Ident>,
        no: u32,
    ) -> Option<Trusted> {
        let e = inner.entries.get_mut(id as usize)?.as_mut()?;
        e.verifying = false;
        let i = ident.filter(|_| e.complete() && e.own_no == no)?;
        e.verified = true;
        self.stats.copies_verified.fetch_add(1, Relaxed);
        e.trust_ino = i.ino;
        e.trust_ctime = i.ctime_ns;
        let t = Trusted {
            owner: e.owner,
            no,
            dev: i.dev,
            ino: i.ino,
            size: i.size,
            whole: e.whole,
        };
        append(
            &self.log,
            &Record::Trusted {
                id,
                ino: i.ino,
                ctime_ns: i.ctime_ns,
            },
        );
        Some(t)
    }
}
