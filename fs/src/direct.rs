//! Direct descriptors: a reader on the mount's own node asks over the control socket
//! ([`stagefs_protocol`], `direct_open`) and gets a read-only descriptor of the cache's exact,
//! verified copy of a file, so its reads go to scratch at local speed instead of through FUSE
//! (128 KiB round trips and copies through the daemon).
//!
//! **When.** Only where kernel passthrough would be allowed (the passthrough rule): a regular
//! file larger than [`SMALL_FILE`] (a small file's reader opens its copy itself, through the
//! direct table: [`crate::direct_table`]), wholly cached in a data file of its own, bound to
//! the snapshot's version of the file (an entry is only ever served for the path and version
//! it was stored for) and trusted: verified against its checksums, written whole by this
//! mount, or recorded as verified by an earlier one with the same inode and change time. Never under `--revalidate` (each read re-checks the source, so
//! the mount must see them), never for views, symlinks or control files. Anything else is a
//! [`Refusal`] and the client reads through the mount. A copy is verified as soon as it is
//! complete in this mount. After a remount, an open of a copy not verified yet verifies it
//! there and then, through the page cache its reader then reads from, so a warm epoch right
//! after a remount reads each copy once; the copies no reader opens are verified by a
//! background pass ([`DirectService::verify_copies`]) that starts a little after the mount
//! and yields to readers ([`BACKGROUND_VERIFY_DELAY`], [`READERS_QUIET`]).
//!
//! **What is handed out.** The copy opened afresh, `O_RDONLY` (a new open file description:
//! the status flags the daemon uses for its own reads are not shared), checked to be a regular
//! file of the snapshot's size; close-on-exec in the daemon. Never writable, never a path.
//!
//! **Pins.** Each grant pins the copy against eviction (eviction punches holes, which an open
//! descriptor would read as zeros). Pins are held per connection ([`DirectPins`]) and released
//! by `direct_close` or when the connection ends (client exit or crash), bounded per connection
//! and in all ([`MAX_PINS_PER_CONNECTION`], [`MAX_PINS`]): past a bound the reply is
//! [`Refusal::PinsFull`].
//!
//! **Counted** in the stats: `direct_opens`, `direct_refused` (and `direct_refused_by`,
//! per reason), `bytes_direct` (the file's size per grant: the daemon does not see the
//! reads). Refusals that only a broken or hostile client causes (bad path, malformed, pins
//! full) are logged at warn, at most one line per [`crate::handle::LOG_EVERY`]; the ordinary
//! ones (not staged yet, small, ...) at debug.
//!
//! The service ([`DirectService`]) gets the mount's [`MountHandle`], the verification queue
//! and whether the mount revalidates: what a grant needs, not the core.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use stagefs_prefetch::locks::lock;
use stagefs_prefetch::SMALL_FILE;
use stagefs_prefetch::{EntryId, FileKind};
pub use stagefs_protocol::{Granted, Refusal, MAX_PINS, MAX_PINS_PER_CONNECTION};
use tracing::{debug, info, warn};

use crate::control::{CONTROL_DIR, VIEW_DIR};
use crate::direct_table::DirectTable;
use crate::files::is_large;
use crate::handle::{MountHandle, VerifyQueue};
use crate::snapshot::{NodeAttr, NodeId};

// Clients skip files this small without asking (stagefs_protocol::SMALL_FILE).
const _: () = assert!(stagefs_protocol::SMALL_FILE == SMALL_FILE);

/// The direct-descriptor service of a mount: grants, refusals and the pins of all connections.
pub struct DirectService {
    mount: MountHandle,
    /// The copies a reader may open itself ([`crate::direct_table`]).
    table: Arc<DirectTable>,
    /// Under `--revalidate` every direct open is refused (see the module docs).
    revalidating: bool,
    /// Where complete copies not verified yet are queued.
    verify: Arc<VerifyQueue>,
    /// Pins held by all connections.
    pins: AtomicUsize,
    /// Grant numbers (unique for the mount's life).
    next_pin: AtomicU64,
    last_log: Mutex<Option<Instant>>,
    unlogged: AtomicU64,
    /// When the service started (the clock of `reader_verified_ms`).
    started: Instant,
    /// When an open last verified a copy for its reader, in ms since `started` (0: never):
    /// the background pass waits while readers do it themselves.
    reader_verified_ms: AtomicU64,
}

/// The background verification of a remount's copies starts this long after the mount (1 s),
/// so that a job that starts at once opens its files first and verifies each through the page
/// cache it then reads from; the background pass reads with `O_DIRECT` (a large cache must
/// not flood the page cache), so a copy it verifies is read twice by an epoch that follows.
pub const BACKGROUND_VERIFY_DELAY: Duration = Duration::from_secs(1);

/// The background pass yields while an open verified a copy for its reader within this time
/// (2 s, a few opens apart): readers verify what they read, the pass takes the rest when they
/// are done.
pub const READERS_QUIET: Duration = Duration::from_secs(2);

/// The pins one connection holds: released when it says so or when it is dropped (the
/// connection ended).
pub struct DirectPins {
    direct: Weak<DirectService>,
    held: HashMap<u64, EntryId>,
}

impl DirectPins {
    /// No pins yet, for a connection to `direct`.
    pub fn new(direct: Weak<DirectService>) -> DirectPins {
        DirectPins {
            direct,
            held: HashMap::new(),
        }
    }

    /// How many pins this connection holds.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether this connection holds no pin.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Releases grant `pin` (the client closed its descriptor); false if it holds no such pin.
    pub fn release(&mut self, pin: u64) -> bool {
        let Some(id) = self.held.remove(&pin) else {
            return false;
        };
        if let Some(direct) = self.direct.upgrade() {
            direct.mount.store().unpin(id);
            direct.pins.fetch_sub(1, Relaxed);
        }
        true
    }
}

impl Drop for DirectPins {
    fn drop(&mut self) {
        let pins: Vec<u64> = self.held.keys().copied().collect();
        if !pins.is_empty() {
            debug!(
                pins = pins.len(),
                "direct descriptors: connection ended, pins released"
            );
        }
        for pin in pins {
            self.release(pin);
        }
    }
}

impl DirectService {
    /// The service of the mount `mount`; `revalidating`: the mount re-checks metadata (every
    /// open is refused); `verify`: the mount's verification queue.
    pub fn new(mount: MountHandle, revalidating: bool, verify: Arc<VerifyQueue>) -> DirectService {
        DirectService {
            mount,
            table: Arc::new(DirectTable::default()),
            revalidating,
            verify,
            pins: AtomicUsize::new(0),
            next_pin: AtomicU64::new(0),
            last_log: Mutex::new(None),
            unlogged: AtomicU64::new(0),
            started: Instant::now(),
            reader_verified_ms: AtomicU64::new(0),
        }
    }

    /// The mount's direct table.
    pub fn table(&self) -> &Arc<DirectTable> {
        &self.table
    }

    /// Opens and bytes readers counted through the direct table.
    pub fn table_counted(&self) -> (u64, u64) {
        self.table.counted()
    }

    /// Answers a `direct_table` request: runs `f` with the table's descriptors, or says why
    /// there are none.
    pub fn with_table<R>(
        &self,
        f: impl FnOnce([std::os::fd::BorrowedFd<'_>; 3]) -> R,
    ) -> Result<R, Refusal> {
        if self.mount.stopped() {
            return Err(Refusal::Stopping);
        }
        if self.revalidating {
            return Err(Refusal::Revalidate);
        }
        self.table.with_fds(f).ok_or(Refusal::NotReady)
    }

    /// Milliseconds since the service started (at least 1: 0 means never).
    fn now_ms(&self) -> u64 {
        (self.started.elapsed().as_millis() as u64).max(1)
    }

    /// Sleeps `d` in short steps; false if the mount stopped meanwhile.
    fn pause(&self, d: Duration) -> bool {
        let until = Instant::now() + d;
        while Instant::now() < until {
            if self.mount.stopped() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        !self.mount.stopped()
    }

    /// Answers a `direct_open` of `path` for the connection holding `pins`: a read-only
    /// descriptor of the verified copy (pinned until released) or why not. Counted and logged.
    pub fn direct_open(
        &self,
        path: &str,
        pins: &mut DirectPins,
    ) -> Result<(OwnedFd, Granted), Refusal> {
        let _span = tracing::debug_span!("direct_open", path).entered();
        let got = self.grant(path, pins);
        match &got {
            Ok((_, g)) => {
                self.mount.stats().direct_opens.fetch_add(1, Relaxed);
                self.mount.stats().bytes_direct.fetch_add(g.size, Relaxed);
                debug!(pin = g.pin, size = g.size, "direct descriptor handed out");
            }
            Err(r) => self.refused(path, *r),
        }
        got
    }

    /// Counts and logs a refusal (also for requests that never reached [`Self::direct_open`]).
    pub fn refused(&self, path: &str, r: Refusal) {
        self.mount.stats().count_refusal(r.code());
        let path: String = path.chars().take(200).collect();
        if !matches!(r, Refusal::BadPath | Refusal::Malformed | Refusal::PinsFull) {
            debug!(path, reason = %r, "direct open refused");
            return;
        }
        let mut last = lock(&self.last_log);
        if last.is_some_and(|t| t.elapsed() < crate::handle::LOG_EVERY) {
            self.unlogged.fetch_add(1, Relaxed);
            return;
        }
        *last = Some(Instant::now());
        let also = self.unlogged.swap(0, Relaxed);
        warn!(path, reason = %r, unlogged_since = also, "direct open refused");
    }

    fn grant(&self, path: &str, pins: &mut DirectPins) -> Result<(OwnedFd, Granted), Refusal> {
        if self.mount.stopped() {
            return Err(Refusal::Stopping);
        }
        stagefs_protocol::check_path(path).map_err(|_| Refusal::BadPath)?;
        let rel = Path::new(path);
        let first = rel.components().next().map(|c| c.as_os_str());
        if first == Some(VIEW_DIR.as_ref()) {
            return Err(Refusal::View);
        }
        if first == Some(CONTROL_DIR.as_ref()) {
            return Err(Refusal::NotRegular);
        }
        if self.revalidating {
            return Err(Refusal::Revalidate);
        }
        let snap = self.mount.snapshot_ref();
        let node = snap.resolve(rel).ok().flatten().ok_or(Refusal::NotFound)?;
        let attr = snap.attr(node).ok_or(Refusal::NotFound)?;
        match attr.kind {
            FileKind::File => {}
            FileKind::Symlink => return Err(Refusal::Symlink),
            _ => return Err(Refusal::NotRegular),
        }
        if attr.size == 0 {
            return Err(Refusal::NotStaged);
        }
        if !is_large(attr.size) {
            return self.grant_whole(node, &attr);
        }
        if pins.held.len() >= MAX_PINS_PER_CONNECTION {
            return Err(Refusal::PinsFull);
        }
        // Reserve a pin in the total first, so racing connections cannot pass the bound.
        if self
            .pins
            .fetch_update(Relaxed, Relaxed, |n| (n < MAX_PINS).then_some(n + 1))
            .is_err()
        {
            return Err(Refusal::PinsFull);
        }
        let unreserve = || {
            self.pins.fetch_sub(1, Relaxed);
        };
        let state = match self.mount.files().state(node, &attr) {
            Ok(s) => s,
            Err(_) => {
                unreserve();
                return Err(Refusal::NotFound);
            }
        };
        let store = self.mount.store();
        let mut pinned = store.pin_passthrough(state.entry);
        if pinned.is_none() && self.trust_for_reader(state.entry) {
            pinned = store.pin_passthrough(state.entry);
        }
        let Some(file) = pinned else {
            unreserve();
            return Err(self.not_trusted(state.entry));
        };
        let fd = OwnedFd::from(file);
        if let Err(why) = read_only_copy(&fd, attr.size, attr.mtime_ns) {
            store.unpin(state.entry);
            unreserve();
            warn!(
                path,
                why, "direct open: the cache's copy is not as expected"
            );
            return Err(Refusal::NotStaged);
        }
        let pin = self.next_pin.fetch_add(1, Relaxed) + 1;
        pins.held.insert(pin, state.entry);
        Ok((
            fd,
            Granted {
                pin,
                size: attr.size,
                mtime_ns: attr.mtime_ns,
            },
        ))
    }

    /// A small file's copy, unpinned (pin 0): it is evicted whole, by unlinking, so an open
    /// descriptor of it always reads all of its bytes.
    fn grant_whole(&self, node: NodeId, attr: &NodeAttr) -> Result<(OwnedFd, Granted), Refusal> {
        let state = self
            .mount
            .files()
            .state(node, attr)
            .map_err(|_| Refusal::NotFound)?;
        let store = self.mount.store();
        let mut got = store.open_whole(state.entry);
        if got.is_none() && self.trust_for_reader(state.entry) {
            got = store.open_whole(state.entry);
        }
        let Some((file, t)) = got else {
            return Err(self.not_trusted(state.entry));
        };
        let fd = OwnedFd::from(file);
        if t.size != attr.size || read_only_copy(&fd, attr.size, attr.mtime_ns).is_err() {
            return Err(Refusal::NotStaged);
        }
        Ok((
            fd,
            Granted {
                pin: 0,
                size: attr.size,
                mtime_ns: attr.mtime_ns,
            },
        ))
    }

    /// Trusts a complete copy not yet trusted in this mount, for a reader that opens it now:
    /// an earlier mount's record if it still matches (no read), else the copy read through the
    /// page cache its reader then reads from (a remount's copies are checked in the
    /// background, which an epoch starting at once outruns).
    fn trust_for_reader(&self, id: EntryId) -> bool {
        let store = self.mount.store();
        if !store.is_complete(id) {
            return false;
        }
        if store.check_trust(id) {
            return true;
        }
        self.reader_verified_ms.store(self.now_ms(), Relaxed);
        store.verify_for_reader(id)
    }

    /// Why an untrusted copy is refused (and its verification queued if it is complete).
    fn not_trusted(&self, id: EntryId) -> Refusal {
        if self.mount.store().is_complete(id) {
            self.verify.queue(id);
            Refusal::Verifying
        } else {
            Refusal::NotStaged
        }
    }

    /// Verifies, one after another on a background thread, the complete copies this mount
    /// found in the cache (see the module docs). Ends early when the mount stops.
    pub(crate) fn verify_copies(&self) {
        let store = self.mount.store();
        let ids = store.unverified_copies();
        let n = ids.len();
        // First the earlier mounts' records: one fstatat each, no read; then the table holds
        // everything trusted and says so.
        let unchecked: Vec<EntryId> = ids
            .into_iter()
            .filter(|&id| !store.check_trust(id))
            .collect();
        self.table.complete();
        let trusted = n - unchecked.len();
        if unchecked.is_empty() || !self.pause(BACKGROUND_VERIFY_DELAY) {
            debug!(copies = n, trusted, "cached copies checked after mount");
            return;
        }
        let mut ok = 0usize;
        for id in &unchecked {
            // Readers verifying their own copies go first (see READERS_QUIET).
            loop {
                let last = self.reader_verified_ms.load(Relaxed);
                let quiet = last == 0
                    || self.now_ms().saturating_sub(last) >= READERS_QUIET.as_millis() as u64;
                if quiet {
                    break;
                }
                if !self.pause(Duration::from_millis(100)) {
                    return;
                }
            }
            if self.mount.stopped() {
                return;
            }
            ok += usize::from(store.verify(*id));
        }
        info!(
            copies = n,
            trusted,
            verified = unchecked.len(),
            intact = trusted + ok,
            "cached copies checked after mount"
        );
    }

    /// Direct descriptors pinned now, by all connections.
    pub fn direct_pins(&self) -> usize {
        self.pins.load(Relaxed)
    }
}

/// Makes `fd` (a fresh open of the copy) plain `O_RDONLY`, checks it is a regular file of
/// `size` bytes, and gives the copy the source's mtime `mtime_ns` (what a reader's `fstat`
/// shows; tools that key on mtime see the source's).
fn read_only_copy(fd: &OwnedFd, size: u64, mtime_ns: i64) -> Result<(), &'static str> {
    use rustix::fs::{fcntl_getfl, fcntl_setfl, fstat, futimens, FileType, OFlags, Timespec};
    use rustix::fs::{Timestamps, UTIME_OMIT};
    // The cache opens its copies O_NONBLOCK for its own reads; the reader gets none of that.
    fcntl_setfl(fd.as_fd(), OFlags::empty()).map_err(|_| "fcntl failed")?;
    let flags = fcntl_getfl(fd.as_fd()).map_err(|_| "fcntl failed")?;
    if flags & OFlags::ACCMODE != OFlags::RDONLY {
        return Err("not opened read-only");
    }
    let st = fstat(fd).map_err(|_| "fstat failed")?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err("not a regular file");
    }
    if u64::try_from(st.st_size).ok() != Some(size) {
        return Err("not of the snapshot's size");
    }
    let mtime = Timespec {
        tv_sec: mtime_ns.div_euclid(1_000_000_000),
        tv_nsec: mtime_ns.rem_euclid(1_000_000_000) as _,
    };
    let have = i128::from(st.st_mtime) * 1_000_000_000 + i128::from(st.st_mtime_nsec);
    if have != i128::from(mtime_ns) {
        let times = Timestamps {
            last_access: Timespec {
                tv_sec: 0,
                tv_nsec: UTIME_OMIT,
            },
            last_modification: mtime,
        };
        // The daemon owns the copy: setting times needs no write access. A failure only
        // leaves the copy's own mtime.
        let _ = futimens(fd, &times);
    }
    Ok(())
}
