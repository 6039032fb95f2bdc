//! The run's mounts and what this process holds of each: its direct table (mapped once, shared
//! with forked children: read-only memory and a directory descriptor stay valid there) and its
//! connection to the daemon (one per process: a forked child makes its own).
//!
//! **Configuration.** `STAGEFS_DIRECT_MOUNTS=MNT=SOCKET[:MNT=SOCKET...]` (set by `stagefs run`;
//! canonical mount points), read once when the library is loaded (its constructor may
//! allocate; nothing after it does on the open path). `STAGEFS_DIRECT=0` turns the library
//! into a pass-through.
//!
//! **Tables.** Asked for at the first open under a mount (`direct_table`): refused "not ready"
//! while the daemon is still listing the tree, asked again at most every [`TABLE_RETRY`]; any
//! other refusal (`--revalidate`) or failure and that mount has no table in this process.
//!
//! **Connections.** Requests of a process are serialised by a small lock whose holder is
//! named by process id, so a forked child takes it over (the parent's holder is not in the
//! child). The lock is only taken for the socket (table handshake, large files' grants, pin
//! releases), never for an open through the table. A thread already inside the library (a
//! signal handler interrupting it) passes straight through instead of waiting for itself. A
//! reply or write waits at most [`REPLY_TIMEOUT`]; after any socket failure (daemon gone,
//! killed, hung) that mount is read through the mount for the rest of the process. The
//! connection's descriptor is checked (device and inode) before each use, so a program that
//! closed it or reused its number never gets our bytes in its file.

use std::cell::UnsafeCell;
use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use stagefs_protocol::table::{SharedCounters, TableReader, FLAG_CLOSED};
use stagefs_protocol::{ClientError, DirectClient, Granted, Refusal, REPLY_TIMEOUT};

/// Most mounts one run gives the library (more are read through the mount).
pub const MAX_MOUNTS: usize = 16;
/// How long an open waits for another thread's request before reading through the mount:
/// longer than that request may take.
const LOCK_WAIT: Duration = Duration::from_secs(REPLY_TIMEOUT.as_secs() + 1);
/// How often a table the daemon is not ready to give is asked for again (1 s: the listing of
/// a large tree takes seconds, and each ask is a round trip).
pub const TABLE_RETRY: Duration = Duration::from_secs(1);

/// One mount of the run.
pub struct MountCfg {
    /// Its canonical mount point.
    pub mnt: Vec<u8>,
    /// Its control socket.
    pub socket: PathBuf,
}

static MOUNTS: OnceLock<Vec<MountCfg>> = OnceLock::new();

/// The run's mounts (empty: the library does nothing).
pub fn mounts() -> &'static [MountCfg] {
    MOUNTS.get_or_init(|| {
        if std::env::var_os("STAGEFS_DIRECT").is_some_and(|v| v == "0") {
            return Vec::new();
        }
        let Some(spec) = std::env::var_os("STAGEFS_DIRECT_MOUNTS") else {
            return Vec::new();
        };
        parse_mounts(spec.as_bytes())
    })
}

/// `MNT=SOCKET` entries separated by `:` (both absolute; the socket is split at `=/`).
pub fn parse_mounts(spec: &[u8]) -> Vec<MountCfg> {
    spec.split(|&b| b == b':')
        .filter_map(|e| {
            let at = e.windows(2).position(|w| w == b"=/")?;
            let (mnt, socket) = (&e[..at], &e[at + 1..]);
            let mnt = mnt.strip_suffix(b"/").unwrap_or(mnt);
            (mnt.first() == Some(&b'/')).then(|| MountCfg {
                mnt: mnt.to_vec(),
                socket: PathBuf::from(OsStr::from_bytes(socket)),
            })
        })
        .take(MAX_MOUNTS)
        .collect()
}

/// A mount's direct table in this process.
pub struct Table {
    /// The table, mapped read-only.
    pub reader: TableReader,
    /// The readers' counters.
    pub counters: SharedCounters,
    /// The cache's `files/` directory.
    pub dir: OwnedFd,
    /// The mount's device number (what `stat` of a path under it shows).
    pub mount_dev: u64,
}

static TABLES: [OnceLock<Table>; MAX_MOUNTS] = [const { OnceLock::new() }; MAX_MOUNTS];
/// When (ms of the monotonic clock) a mount's table may next be asked for; `u64::MAX`: never.
static TABLE_NEXT: [AtomicU64; MAX_MOUNTS] = [const { AtomicU64::new(0) }; MAX_MOUNTS];

fn now_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own (the vDSO: no system call).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// Mount `i`'s table, once it has one (asking the daemon, at most every [`TABLE_RETRY`]).
pub fn table(i: usize) -> Option<&'static Table> {
    let slot = TABLES.get(i)?;
    if let Some(t) = slot.get() {
        return (t.reader.flags() & FLAG_CLOSED == 0).then_some(t);
    }
    let next = &TABLE_NEXT[i];
    if now_ms() < next.load(Ordering::Relaxed) {
        return None;
    }
    with_state(true, |st| {
        if slot.get().is_some() {
            return;
        }
        let Some(c) = st.conn(i) else {
            next.store(u64::MAX, Ordering::Relaxed);
            return;
        };
        match c.table() {
            Ok((t, n, d)) => {
                let mount_dev = mounts()
                    .get(i)
                    .and_then(|m| rustix::fs::stat(OsStr::from_bytes(&m.mnt)).ok())
                    .map(|st| st.st_dev);
                match (
                    TableReader::map(t.as_fd()),
                    SharedCounters::map(n.as_fd()),
                    mount_dev,
                ) {
                    (Ok(reader), Ok(counters), Some(mount_dev)) => {
                        let _ = slot.set(Table {
                            reader,
                            counters,
                            dir: d,
                            mount_dev,
                        });
                    }
                    _ => next.store(u64::MAX, Ordering::Relaxed),
                }
            }
            Err(ClientError::Refused(Refusal::NotReady)) => {
                next.store(now_ms() + TABLE_RETRY.as_millis() as u64, Ordering::Relaxed)
            }
            Err(ClientError::Refused(_)) => next.store(u64::MAX, Ordering::Relaxed),
            // At the descriptor limit now; perhaps not in a second.
            Err(ClientError::NoDescriptor) => {
                next.store(now_ms() + TABLE_RETRY.as_millis() as u64, Ordering::Relaxed)
            }
            Err(_) => {
                next.store(u64::MAX, Ordering::Relaxed);
                st.conns[i] = Conn::Off;
            }
        }
    });
    slot.get()
}

/// Mount `i`'s table if this process has it already (no request).
pub fn table_now(i: usize) -> Option<&'static Table> {
    TABLES.get(i)?.get()
}

/// A mount's connection in this process.
enum Conn {
    /// Not tried yet.
    Untried,
    /// Connected: the client and its socket's (device, inode).
    Up(DirectClient, (u64, u64)),
    /// Failed: the mount is read through FUSE for the rest of the process.
    Off,
}

/// The process's connections, and whose they are.
struct State {
    pid: i32,
    conns: [Conn; MAX_MOUNTS],
}

struct Shared(UnsafeCell<State>);
// SAFETY: the state is only reached under the OWNER lock (see `with_state`).
unsafe impl Sync for Shared {}

static STATE: Shared = Shared(UnsafeCell::new(State {
    pid: 0,
    conns: [const { Conn::Untried }; MAX_MOUNTS],
}));
/// The process id of the lock's holder; 0 when free.
static OWNER: AtomicI32 = AtomicI32::new(0);

/// This process's id.
pub fn pid() -> i32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

/// Runs `f` on this process's connections under the lock. `fresh`: a forked child may take
/// over the lock and start connections of its own (opens); otherwise (pin releases) the state
/// of another process is left alone and `None` returned. `None` too after [`LOCK_WAIT`].
pub fn with_state<R>(fresh: bool, f: impl FnOnce(&mut StateRef<'_>) -> R) -> Option<R> {
    let me = pid();
    let mut waited = 0u32;
    loop {
        match OWNER.compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => break,
            // Held in the parent when we were forked: that thread is not in this process.
            Err(cur) if cur != me && fresh => {
                if OWNER
                    .compare_exchange(cur, me, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    break;
                }
            }
            Err(cur) if cur != me => return None,
            Err(_) if u64::from(waited) * 50 > LOCK_WAIT.as_micros() as u64 => return None,
            Err(_) => {
                waited += 1;
                let ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 50_000,
                };
                // SAFETY: nanosleep reads the timespec we own; no remainder wanted.
                unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
            }
        }
    }
    // Released however `f` ends (a panic is caught by the caller, the lock must not stay).
    struct Release;
    impl Drop for Release {
        fn drop(&mut self) {
            OWNER.store(0, Ordering::Release);
        }
    }
    let _release = Release;
    // SAFETY: OWNER is ours: no other thread of this process reaches STATE until we release it.
    let st = unsafe { &mut *STATE.0.get() };
    if st.pid != me {
        if !fresh {
            return None;
        }
        // The parent's connections, copied by fork: never used or closed here (the sockets
        // are the parent's; closing our copies would not end them, but their numbers may be
        // the program's by now).
        for c in st.conns.iter_mut() {
            let old = std::mem::replace(c, Conn::Untried);
            std::mem::forget(old);
        }
        st.pid = me;
    }
    Some(f(&mut StateRef {
        conns: &mut st.conns,
    }))
}

/// The connections, under the lock.
pub struct StateRef<'a> {
    conns: &'a mut [Conn; MAX_MOUNTS],
}

/// The (device, inode) of descriptor `fd` (a system call, not libc's interposable `fstat`).
fn ident(fd: i32) -> Option<(u64, u64)> {
    // SAFETY: a descriptor number only borrowed for this one call.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let st = rustix::fs::fstat(fd).ok()?;
    Some((st.st_dev, st.st_ino))
}

impl StateRef<'_> {
    /// The usable connection to mount `i`, connecting on first use.
    pub fn conn(&mut self, i: usize) -> Option<&mut DirectClient> {
        let c = self.conns.get_mut(i)?;
        if let Conn::Up(client, id) = c {
            // Still our socket? A program may have closed or reused the descriptor.
            if ident(client.stream().as_raw_fd()) != Some(*id) {
                let Conn::Up(client, _) = std::mem::replace(c, Conn::Off) else {
                    return None;
                };
                // Not ours any more: never closed by us.
                std::mem::forget(client);
                return None;
            }
        }
        if matches!(c, Conn::Untried) {
            let socket = &mounts().get(i)?.socket;
            *c = match DirectClient::connect(socket) {
                Ok(client) => match ident(client.stream().as_raw_fd()) {
                    Some(id) => Conn::Up(client, id),
                    None => Conn::Off,
                },
                Err(_) => Conn::Off,
            };
        }
        match c {
            Conn::Up(client, _) => Some(client),
            _ => None,
        }
    }

    /// Turns mount `i`'s connection off for the rest of the process (out of step, or gone).
    pub fn off(&mut self, i: usize) {
        if let Some(c) = self.conns.get_mut(i) {
            *c = Conn::Off;
        }
    }
}

/// Asks mount `i`'s daemon for a direct descriptor of `rel`; `None` if refused or the
/// connection failed (then the mount is read through FUSE from now on).
pub fn grant(i: usize, rel: &str) -> Option<(OwnedFd, Granted)> {
    with_state(true, |st| {
        let client = st.conn(i)?;
        match client.open(rel) {
            Ok(got) => Some(got),
            Err(ClientError::Refused(_) | ClientError::NoDescriptor) => None,
            Err(_) => {
                st.off(i);
                None
            }
        }
    })
    .flatten()
}

/// Tells mount `i`'s daemon that the descriptor of grant `pin` is closed.
pub fn release(i: usize, pin: u64) {
    with_state(false, |st| {
        if let Some(c) = st.conn(i) {
            if c.close(pin).is_err() {
                st.off(i);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_list_parses_and_skips_bad_entries() {
        let m = parse_mounts(b"/mnt/a=/c/a/hints.sock:relative=/x:/mnt/b=c/hints.sock:/m/=/s");
        let got: Vec<(&[u8], &std::path::Path)> =
            m.iter().map(|m| (&m.mnt[..], &*m.socket)).collect();
        assert_eq!(
            got,
            vec![
                (&b"/mnt/a"[..], std::path::Path::new("/c/a/hints.sock")),
                (&b"/m"[..], std::path::Path::new("/s"))
            ]
        );
    }
}
