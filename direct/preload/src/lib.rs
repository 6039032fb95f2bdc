//! `libstagefs_direct.so`: loaded with `LD_PRELOAD` by `stagefs run` into the job's unmodified
//! programs. A read-only open of a regular file under one of the run's mounts asks that mount's
//! daemon for a direct descriptor of the cache's verified copy ([`stagefs_protocol`],
//! `direct_open`); granted, the program gets that descriptor and reads scratch at local speed;
//! refused for any reason (not staged yet, small file, view, `--revalidate`, pins full, daemon
//! gone), the open goes to the mount as if this library were not there.
//!
//! **What is interposed.** `open`, `open64`, `openat`, `openat64`, `__open_2`, `__open64_2`,
//! `__openat_2`, `__openat64_2`, `fopen`, `fopen64` (read-only only: `O_RDONLY` without
//! `O_CREAT`, `O_TRUNC`, `O_DIRECTORY`, `O_PATH`, `O_TMPFILE`, `O_DIRECT`; `fopen` modes `r`
//! with `b`, `e`, `m`, `c` only), and `close`/`fclose` to release a descriptor's pin. Everything
//! else goes to the next definition (`dlsym(RTLD_NEXT, ...)`). `fstat`, `fstat64`,
//! `__fxstat`, `__fxstat64`, `fstatat`/`fstatat64`/`statx` with `AT_EMPTY_PATH` of a direct
//! descriptor answer with the mount's file (a `stat` of the path it was opened by), so the
//! descriptor and its path are one file to the program (`cp` refuses to copy a file whose
//! `fstat` and `stat` differ). Relative paths are resolved
//! against the working directory or the `dirfd` (`/proc/self/fd/N`); a path whose
//! mount-relative rest is not plain (`..`, symlinks in the daemon's view) is the mount's.
//!
//! **Why Rust, with a fixed third argument for the variadic `open`.** The protocol is parsed
//! and bounded by the same crate as the daemon's (one definition of the messages and bounds).
//! Stable Rust cannot define a C-variadic function, so `open(path, flags, mode)` takes `mode`
//! as a named argument: on the Linux ABIs stagefs supports (x86-64 System V, AArch64 AAPCS64)
//! a variadic integer argument travels in the same register as a named one, so the value is
//! read from where the caller put it. It is only used when the caller passed it
//! (`O_CREAT`/`O_TMPFILE`), and then handed on unchanged to the real, variadic `open`.
//!
//! **Where.** `STAGEFS_DIRECT_MOUNTS=MNT=SOCKET[:MNT=SOCKET...]` (set by `stagefs run`;
//! canonical mount points); `STAGEFS_DIRECT=0` turns the library into a pass-through.
//!
//! Files of at most `stagefs_protocol::SMALL_FILE` bytes (packed in the cache's segments, never
//! granted) and anything but regular files are not asked about: a `stat` first, which the
//! kernel answers from its attribute cache.
//!
//! **Connections.** One per mount per process, made at the first open under that mount, made
//! afresh in a child after `fork` (the process id is checked; the parent's state is left to
//! the parent). Requests of a process are serialised by a small lock that a forked child takes
//! over (the thread that held it in the parent does not exist in the child). A reply or write
//! waits at most `REPLY_TIMEOUT`; after any socket failure (daemon gone, killed, hung) that
//! mount is read through the mount for the rest of the process: nothing hangs longer, nothing
//! crashes. The connection's descriptor is checked (device and inode) before each use, so a
//! program that closed it or reused its number never gets our bytes in its file.
//!
//! **Descriptors.** Close-on-exec exactly when the caller asked (`O_CLOEXEC`, `fopen`'s `e`),
//! `O_NONBLOCK` when asked. `close`/`fclose` of a direct descriptor tells the daemon, which
//! releases the pin; descriptors still open at exit are released with the connection. A
//! descriptor that is duplicated (`dup`, `dup2`, `dup3`, `fcntl(F_DUPFD*)`) or mapped (`mmap`,
//! as numpy's memmap does before closing the file) keeps its pin until the process ends: the
//! copy must not be evicted under a mapping. Known limits: a child inherits descriptors pinned
//! by its parent's connection (pinned while the parent runs); a static binary ignores
//! `LD_PRELOAD` and reads through the mount; `dup`/`fcntl`/`mmap` made by libc internally (not
//! through its exported symbols) are not seen.

use std::cell::{Cell, UnsafeCell};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString, OsStr};
use std::os::fd::{AsRawFd, IntoRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use stagefs_protocol::{ClientError, DirectClient, REPLY_TIMEOUT};

/// Descriptors below this are tracked in a lock-free bitmap, so `close` of anything else costs
/// one load (65536: far above the default descriptor limit of 1024).
const TRACKED_FDS: usize = 1 << 16;
/// How long an open waits for another thread's request before reading through the mount:
/// longer than that request may take.
const LOCK_WAIT: Duration = Duration::from_secs(REPLY_TIMEOUT.as_secs() + 1);
/// Most mounts one run gives the library (more are read through the mount).
const MAX_MOUNTS: usize = 16;

/// Which descriptors are direct ones of this process (bit per descriptor).
static TRACKED: [AtomicU64; TRACKED_FDS / 64] = [const { AtomicU64::new(0) }; TRACKED_FDS / 64];

fn tracked(fd: c_int) -> bool {
    usize::try_from(fd)
        .ok()
        .filter(|&f| f < TRACKED_FDS)
        .is_some_and(|f| TRACKED[f / 64].load(Ordering::Relaxed) & (1 << (f % 64)) != 0)
}

fn set_tracked(fd: c_int, on: bool) {
    if let Some(f) = usize::try_from(fd).ok().filter(|&f| f < TRACKED_FDS) {
        let bit = 1u64 << (f % 64);
        if on {
            TRACKED[f / 64].fetch_or(bit, Ordering::Relaxed);
        } else {
            TRACKED[f / 64].fetch_and(!bit, Ordering::Relaxed);
        }
    }
}

/// One mount of the run.
struct MountCfg {
    mnt: PathBuf,
    socket: PathBuf,
}

/// The run's mounts, read once from the environment (empty: the library does nothing).
fn mounts() -> &'static [MountCfg] {
    static MOUNTS: OnceLock<Vec<MountCfg>> = OnceLock::new();
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
fn parse_mounts(spec: &[u8]) -> Vec<MountCfg> {
    spec.split(|&b| b == b':')
        .filter_map(|e| {
            let at = e.windows(2).position(|w| w == b"=/")?;
            let (mnt, socket) = (&e[..at], &e[at + 1..]);
            (mnt.first() == Some(&b'/')).then(|| MountCfg {
                mnt: PathBuf::from(OsStr::from_bytes(mnt)),
                socket: PathBuf::from(OsStr::from_bytes(socket)),
            })
        })
        .take(MAX_MOUNTS)
        .collect()
}

thread_local! {
    /// Set while this thread is inside the library, so our own calls pass straight through.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread busy until dropped; `None` if it already is (or its TLS is gone).
struct Busy;

impl Busy {
    fn enter() -> Option<Busy> {
        BUSY.try_with(|b| (!b.replace(true)).then_some(Busy))
            .ok()
            .flatten()
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = BUSY.try_with(|b| b.set(false));
    }
}

/// A mount's connection in this process.
enum Conn {
    /// Not tried yet.
    Untried,
    /// Connected: the stream and its socket's (device, inode).
    Up(DirectClient, (u64, u64)),
    /// Failed: the mount is read through FUSE for the rest of the process.
    Off,
}

/// A direct descriptor of this process.
struct DirectFd {
    /// Index of its mount.
    mount: usize,
    /// Its grant.
    pin: u64,
    /// The path it was opened by (what `fstat` shows).
    path: CString,
    /// Duplicated or mapped: the copy is read beyond this descriptor's life, so its pin is kept
    /// until the connection ends (process exit), not released at `close`.
    kept: bool,
}

/// The process's state: whose it is, its connections, its direct descriptors.
struct State {
    pid: i32,
    conns: Vec<Conn>,
    /// Direct descriptors of this process.
    fds: HashMap<c_int, DirectFd>,
}

struct Shared(UnsafeCell<Option<State>>);
// SAFETY: the state is only reached under the OWNER lock (see `with_state`).
unsafe impl Sync for Shared {}

static STATE: Shared = Shared(UnsafeCell::new(None));
/// The process id of the lock's holder; 0 when free.
static OWNER: AtomicI32 = AtomicI32::new(0);

fn pid() -> i32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

/// Runs `f` on this process's state under the lock. `fresh`: a forked child may take over the
/// lock and start a state of its own (opens); otherwise (closes) a state or lock of another
/// process is left alone and `None` returned. `None` too after [`LOCK_WAIT`].
fn with_state<R>(fresh: bool, f: impl FnOnce(&mut State) -> R) -> Option<R> {
    let me = pid();
    let deadline = Instant::now() + LOCK_WAIT;
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
            Err(_) if Instant::now() > deadline => return None,
            Err(_) => std::thread::sleep(Duration::from_micros(50)),
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
    let slot = unsafe { &mut *STATE.0.get() };
    let mine = slot.as_ref().is_some_and(|s| s.pid == me);
    let out = if mine {
        slot.as_mut().map(f)
    } else if fresh {
        // The parent's state, copied by fork (possibly mid-change): leaked, never used or
        // dropped; its sockets stay the parent's.
        if let Some(old) = slot.take() {
            std::mem::forget(old);
        }
        let n = mounts().len();
        let st = slot.insert(State {
            pid: me,
            conns: (0..n).map(|_| Conn::Untried).collect(),
            fds: HashMap::new(),
        });
        Some(f(st))
    } else {
        None
    };
    out
}

/// The (device, inode) of descriptor `fd`.
fn ident(fd: c_int) -> Option<(u64, u64)> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a stat into the buffer we own; read only on success.
    let st = unsafe {
        if libc::fstat(fd, st.as_mut_ptr()) != 0 {
            return None;
        }
        st.assume_init()
    };
    Some((st.st_dev, st.st_ino))
}

impl State {
    /// The usable connection to mount `i`, connecting on first use.
    fn conn(&mut self, i: usize) -> Option<&mut DirectClient> {
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
}

/// The absolute form of `path` (relative to `dirfd` or the working directory).
fn absolute(dirfd: c_int, path: &[u8]) -> Option<PathBuf> {
    let p = Path::new(OsStr::from_bytes(path));
    if p.is_absolute() {
        return Some(p.to_path_buf());
    }
    let base = if dirfd == libc::AT_FDCWD {
        std::env::current_dir().ok()?
    } else {
        std::fs::read_link(format!("/proc/self/fd/{dirfd}")).ok()?
    };
    Some(base.join(p))
}

/// Flags of an open that may be served directly: read-only, nothing that creates, truncates
/// or asks for a directory, a path descriptor or unbuffered I/O.
fn direct_flags(flags: c_int) -> bool {
    let refused = libc::O_CREAT
        | libc::O_TRUNC
        | libc::O_DIRECTORY
        | libc::O_PATH
        | libc::O_TMPFILE
        | libc::O_DIRECT
        | libc::O_APPEND
        | libc::O_EXCL;
    flags & libc::O_ACCMODE == libc::O_RDONLY && flags & refused == 0
}

/// A direct descriptor for `path` opened with `flags`, or `None`: then the caller's open goes
/// on to the real function. Leaves `errno` as it found it.
///
/// # Safety
/// `path` is null or a NUL-terminated string.
unsafe fn redirect(dirfd: c_int, path: *const c_char, flags: c_int) -> Option<c_int> {
    if path.is_null() || !direct_flags(flags) || mounts().is_empty() {
        return None;
    }
    let _busy = Busy::enter()?;
    // SAFETY: non-null and NUL-terminated (the caller's contract, as for open).
    let bytes = unsafe { CStr::from_ptr(path) }.to_bytes();
    let errno = std::io::Error::last_os_error().raw_os_error();
    let got = std::panic::catch_unwind(|| direct(dirfd, bytes, flags))
        .ok()
        .flatten();
    if let Some(e) = errno {
        // SAFETY: __errno_location points at this thread's errno.
        unsafe { *libc::__errno_location() = e };
    }
    got
}

fn direct(dirfd: c_int, path: &[u8], flags: c_int) -> Option<c_int> {
    let abs = absolute(dirfd, path)?;
    let (i, rel) = mounts().iter().enumerate().find_map(|(i, m)| {
        let rel = abs.strip_prefix(&m.mnt).ok()?.to_str()?;
        stagefs_protocol::check_path(rel).ok()?;
        Some((i, rel.to_string()))
    })?;
    // Only regular files above the small-file size can be granted: a stat (answered from the
    // kernel's attribute cache under snapshot semantics) saves the daemon a round trip for the
    // rest, such as datasets of many small images.
    let meta = std::fs::metadata(&abs).ok()?;
    if !meta.is_file() || meta.len() <= stagefs_protocol::SMALL_FILE {
        return None;
    }
    with_state(true, |st| {
        let client = st.conn(i)?;
        match client.open(&rel) {
            Ok((fd, g)) => {
                let raw = fd.into_raw_fd();
                // Received close-on-exec; as the caller asked otherwise.
                // SAFETY: fcntl on the descriptor we just received.
                unsafe {
                    if flags & libc::O_CLOEXEC == 0 {
                        libc::fcntl(raw, libc::F_SETFD, 0);
                    }
                    if flags & libc::O_NONBLOCK != 0 {
                        libc::fcntl(raw, libc::F_SETFL, libc::O_NONBLOCK);
                    }
                }
                let path = CString::new(abs.as_os_str().as_bytes()).unwrap_or_default();
                let d = DirectFd {
                    mount: i,
                    pin: g.pin,
                    path,
                    kept: false,
                };
                st.fds.insert(raw, d);
                set_tracked(raw, true);
                Some(raw)
            }
            Err(ClientError::Refused(_)) => None,
            Err(_) => {
                // Out of step or gone: this mount is read through FUSE from now on.
                st.conns[i] = Conn::Off;
                None
            }
        }
    })
    .flatten()
}

/// Forgets direct descriptor `fd` before it is closed: its (mount, pin), if it is one of ours.
fn untrack(fd: c_int) -> Option<(usize, u64)> {
    if !tracked(fd) {
        return None;
    }
    let _busy = Busy::enter()?;
    set_tracked(fd, false);
    with_state(false, |st| {
        st.fds
            .remove(&fd)
            .filter(|d| !d.kept)
            .map(|d| (d.mount, d.pin))
    })
    .flatten()
}

/// Marks direct descriptor `fd` as read beyond its own life (duplicated, mapped): its pin is
/// kept until the process ends. An unpinned copy may be evicted, and eviction punches holes
/// that a mapping or a duplicate would read as zeros.
fn keep(fd: c_int) {
    if !tracked(fd) {
        return;
    }
    let Some(_busy) = Busy::enter() else { return };
    with_state(false, |st| {
        if let Some(d) = st.fds.get_mut(&fd) {
            d.kept = true;
        }
    });
}

/// The mount path direct descriptor `fd` was opened by, if it is one of ours.
fn path_of(fd: c_int) -> Option<CString> {
    if !tracked(fd) {
        return None;
    }
    let _busy = Busy::enter()?;
    with_state(false, |st| st.fds.get(&fd).map(|d| d.path.clone()))
        .flatten()
        .filter(|p| !p.as_bytes().is_empty())
}

/// Tells mount `i`'s daemon that the descriptor of grant `pin` is closed.
fn release(i: usize, pin: u64) {
    let Some(_busy) = Busy::enter() else { return };
    with_state(false, |st| {
        if let Some(c) = st.conn(i) {
            if c.close(pin).is_err() {
                st.conns[i] = Conn::Off;
            }
        }
    });
}

/// Looks up (once) the next definition of a symbol.
macro_rules! next {
    ($name:literal, $ty:ty) => {{
        static SLOT: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
        let mut p = SLOT.load(Ordering::Relaxed);
        if p.is_null() {
            // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds libc's definition.
            p = unsafe { libc::dlsym(libc::RTLD_NEXT, concat!($name, "\0").as_ptr().cast()) };
            SLOT.store(p, Ordering::Relaxed);
        }
        if p.is_null() {
            None
        } else {
            // SAFETY: the symbol is the C function of this name, of type $ty.
            Some(unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
        }
    }};
}

type OpenFn = unsafe extern "C" fn(*const c_char, c_int, ...) -> c_int;
type OpenatFn = unsafe extern "C" fn(c_int, *const c_char, c_int, ...) -> c_int;
type Open2Fn = unsafe extern "C" fn(*const c_char, c_int) -> c_int;
type Openat2Fn = unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int;
type FopenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut libc::FILE;
type CloseFn = unsafe extern "C" fn(c_int) -> c_int;
type FcloseFn = unsafe extern "C" fn(*mut libc::FILE) -> c_int;

fn enosys() -> c_int {
    // SAFETY: __errno_location points at this thread's errno.
    unsafe { *libc::__errno_location() = libc::ENOSYS };
    -1
}

macro_rules! open_like {
    ($name:ident, $sym:literal) => {
        /// Interposed `open`: see the module docs.
        ///
        /// # Safety
        /// As `open(2)`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            path: *const c_char,
            flags: c_int,
            mode: libc::mode_t,
        ) -> c_int {
            // SAFETY: the caller's arguments, as for open.
            if let Some(fd) = unsafe { redirect(libc::AT_FDCWD, path, flags) } {
                return fd;
            }
            match next!($sym, OpenFn) {
                // SAFETY: the real open with the caller's arguments.
                Some(f) => unsafe { f(path, flags, mode) },
                None => enosys(),
            }
        }
    };
}

macro_rules! openat_like {
    ($name:ident, $sym:literal) => {
        /// Interposed `openat`: see the module docs.
        ///
        /// # Safety
        /// As `openat(2)`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            dirfd: c_int,
            path: *const c_char,
            flags: c_int,
            mode: libc::mode_t,
        ) -> c_int {
            // SAFETY: the caller's arguments, as for openat.
            if let Some(fd) = unsafe { redirect(dirfd, path, flags) } {
                return fd;
            }
            match next!($sym, OpenatFn) {
                // SAFETY: the real openat with the caller's arguments.
                Some(f) => unsafe { f(dirfd, path, flags, mode) },
                None => enosys(),
            }
        }
    };
}

macro_rules! open2_like {
    ($name:ident, $sym:literal) => {
        /// Interposed `_FORTIFY_SOURCE` open: see the module docs.
        ///
        /// # Safety
        /// As `open(2)` without a mode.
        #[no_mangle]
        pub unsafe extern "C" fn $name(path: *const c_char, flags: c_int) -> c_int {
            // SAFETY: the caller's arguments, as for open.
            if let Some(fd) = unsafe { redirect(libc::AT_FDCWD, path, flags) } {
                return fd;
            }
            match next!($sym, Open2Fn) {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(path, flags) },
                None => enosys(),
            }
        }
    };
}

macro_rules! openat2_like {
    ($name:ident, $sym:literal) => {
        /// Interposed `_FORTIFY_SOURCE` openat: see the module docs.
        ///
        /// # Safety
        /// As `openat(2)` without a mode.
        #[no_mangle]
        pub unsafe extern "C" fn $name(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
            // SAFETY: the caller's arguments, as for openat.
            if let Some(fd) = unsafe { redirect(dirfd, path, flags) } {
                return fd;
            }
            match next!($sym, Openat2Fn) {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(dirfd, path, flags) },
                None => enosys(),
            }
        }
    };
}

open_like!(open, "open");
open_like!(open64, "open64");
openat_like!(openat, "openat");
openat_like!(openat64, "openat64");
open2_like!(__open_2, "__open_2");
open2_like!(__open64_2, "__open64_2");
openat2_like!(__openat_2, "__openat_2");
openat2_like!(__openat64_2, "__openat64_2");

/// The open flags of an `fopen` mode that may be served directly (`r` with `b`, `e`, `m`,
/// `c`), or `None`.
fn fopen_flags(mode: &[u8]) -> Option<c_int> {
    let (first, rest) = mode.split_first()?;
    if *first != b'r' || !rest.iter().all(|c| b"bemc".contains(c)) {
        return None;
    }
    Some(if rest.contains(&b'e') {
        libc::O_RDONLY | libc::O_CLOEXEC
    } else {
        libc::O_RDONLY
    })
}

/// `fopen` through a direct descriptor, or `None`.
///
/// # Safety
/// `path` and `mode` are null or NUL-terminated strings.
unsafe fn fopen_direct(path: *const c_char, mode: *const c_char) -> Option<*mut libc::FILE> {
    if mode.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract, as for fopen).
    let flags = fopen_flags(unsafe { CStr::from_ptr(mode) }.to_bytes())?;
    // SAFETY: the caller's path, as for fopen.
    let fd = unsafe { redirect(libc::AT_FDCWD, path, flags) }?;
    // SAFETY: fdopen of the descriptor we own, with the caller's mode.
    let fp = unsafe { libc::fdopen(fd, mode) };
    if fp.is_null() {
        let pinned = untrack(fd);
        if let Some(f) = next!("close", CloseFn) {
            // SAFETY: closing the descriptor we received.
            unsafe { f(fd) };
        }
        if let Some((i, pin)) = pinned {
            release(i, pin);
        }
        return None;
    }
    Some(fp)
}

macro_rules! fopen_like {
    ($name:ident, $sym:literal) => {
        /// Interposed `fopen`: see the module docs.
        ///
        /// # Safety
        /// As `fopen(3)`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            path: *const c_char,
            mode: *const c_char,
        ) -> *mut libc::FILE {
            // SAFETY: the caller's arguments.
            if let Some(fp) = unsafe { fopen_direct(path, mode) } {
                return fp;
            }
            match next!($sym, FopenFn) {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(path, mode) },
                None => {
                    enosys();
                    std::ptr::null_mut()
                }
            }
        }
    };
}

fopen_like!(fopen, "fopen");
fopen_like!(fopen64, "fopen64");

/// After the real `close`/`fclose` of a direct descriptor: releases its pin, keeping the
/// close's `errno` for the caller (the release talks to the daemon).
fn release_after_close(pinned: Option<(usize, u64)>) {
    if let Some((i, pin)) = pinned {
        let errno = std::io::Error::last_os_error().raw_os_error();
        release(i, pin);
        if let Some(e) = errno {
            // SAFETY: __errno_location points at this thread's errno.
            unsafe { *libc::__errno_location() = e };
        }
    }
}

/// Interposed `close`: a direct descriptor's pin is released after it is closed.
///
/// # Safety
/// As `close(2)`.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let pinned = untrack(fd);
    let r = match next!("close", CloseFn) {
        // SAFETY: the real close with the caller's argument.
        Some(f) => unsafe { f(fd) },
        None => enosys(),
    };
    release_after_close(pinned);
    r
}

/// Interposed `fclose`: a direct stream's pin is released after it is closed.
///
/// # Safety
/// As `fclose(3)`.
#[no_mangle]
pub unsafe extern "C" fn fclose(fp: *mut libc::FILE) -> c_int {
    let pinned = if fp.is_null() {
        None
    } else {
        // SAFETY: fileno of the caller's open stream.
        untrack(unsafe { libc::fileno(fp) })
    };
    let r = match next!("fclose", FcloseFn) {
        // SAFETY: the real fclose with the caller's argument.
        Some(f) => unsafe { f(fp) },
        None => enosys(),
    };
    release_after_close(pinned);
    r
}

type DupFn = unsafe extern "C" fn(c_int) -> c_int;
type Dup2Fn = unsafe extern "C" fn(c_int, c_int) -> c_int;
type Dup3Fn = unsafe extern "C" fn(c_int, c_int, c_int) -> c_int;
type FcntlFn = unsafe extern "C" fn(c_int, c_int, ...) -> c_int;
type MmapFn = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, c_int, i64) -> *mut c_void;

/// Interposed `dup`: a duplicate of a direct descriptor keeps its pin ([`keep`]).
///
/// # Safety
/// As `dup(2)`.
#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    let r = match next!("dup", DupFn) {
        // SAFETY: the real dup with the caller's argument.
        Some(f) => unsafe { f(fd) },
        None => enosys(),
    };
    if r >= 0 {
        keep(fd);
    }
    r
}

/// Closes what `dup2`/`dup3` onto `new` closes: a direct descriptor there gives its pin back
/// after the call.
fn replaced(new: c_int, old: c_int) -> Option<(usize, u64)> {
    // Only when the call can succeed (`old` open): a failed dup2 closes nothing.
    // SAFETY: F_GETFD reads a descriptor's flags; no memory is touched.
    let valid = || unsafe { libc::fcntl(old, libc::F_GETFD) } >= 0;
    (new != old && tracked(new) && valid())
        .then(|| untrack(new))
        .flatten()
}

/// Interposed `dup2`: see [`dup`]; a direct descriptor it replaces is released as at `close`.
///
/// # Safety
/// As `dup2(2)`.
#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    let gone = replaced(new, old);
    let r = match next!("dup2", Dup2Fn) {
        // SAFETY: the real dup2 with the caller's arguments.
        Some(f) => unsafe { f(old, new) },
        None => enosys(),
    };
    after_dup(r, old, gone);
    r
}

/// Interposed `dup3`: as [`dup2`].
///
/// # Safety
/// As `dup3(2)`.
#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    let gone = replaced(new, old);
    let r = match next!("dup3", Dup3Fn) {
        // SAFETY: the real dup3 with the caller's arguments.
        Some(f) => unsafe { f(old, new, flags) },
        None => enosys(),
    };
    after_dup(r, old, gone);
    r
}

fn after_dup(r: c_int, old: c_int, gone: Option<(usize, u64)>) {
    let errno = std::io::Error::last_os_error().raw_os_error();
    if r >= 0 {
        keep(old);
    }
    if let Some((i, pin)) = gone {
        release(i, pin);
    }
    if let Some(e) = errno {
        // SAFETY: __errno_location points at this thread's errno.
        unsafe { *libc::__errno_location() = e };
    }
}

macro_rules! fcntl_like {
    ($name:ident, $sym:literal) => {
        /// Interposed `fcntl`: `F_DUPFD`/`F_DUPFD_CLOEXEC` of a direct descriptor keep its
        /// pin ([`keep`]). The third argument (an integer or a pointer) is taken as a named
        /// `unsigned long`, where both ABIs pass it, and handed on.
        ///
        /// # Safety
        /// As `fcntl(2)`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
            let r = match next!($sym, FcntlFn) {
                // SAFETY: the real fcntl with the caller's arguments.
                Some(f) => unsafe { f(fd, cmd, arg) },
                None => enosys(),
            };
            if r >= 0 && (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) {
                keep(fd);
            }
            r
        }
    };
}

fcntl_like!(fcntl, "fcntl");
fcntl_like!(fcntl64, "fcntl64");

macro_rules! mmap_like {
    ($name:ident, $sym:literal) => {
        /// Interposed `mmap`: a mapping of a direct descriptor keeps its pin ([`keep`]).
        ///
        /// # Safety
        /// As `mmap(2)`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            addr: *mut c_void,
            len: usize,
            prot: c_int,
            flags: c_int,
            fd: c_int,
            off: i64,
        ) -> *mut c_void {
            let r = match next!($sym, MmapFn) {
                // SAFETY: the real mmap with the caller's arguments.
                Some(f) => unsafe { f(addr, len, prot, flags, fd, off) },
                None => {
                    enosys();
                    libc::MAP_FAILED
                }
            };
            if r != libc::MAP_FAILED && fd >= 0 {
                keep(fd);
            }
            r
        }
    };
}

mmap_like!(mmap, "mmap");
mmap_like!(mmap64, "mmap64");

type FstatatFn = unsafe extern "C" fn(c_int, *const c_char, *mut c_void, c_int) -> c_int;
type FstatFn = unsafe extern "C" fn(c_int, *mut c_void) -> c_int;
type FxstatFn = unsafe extern "C" fn(c_int, c_int, *mut c_void) -> c_int;
type StatxFn = unsafe extern "C" fn(c_int, *const c_char, c_int, c_uint, *mut c_void) -> c_int;

/// The metadata of direct descriptor `fd` as the mount shows its file (device, inode, owner,
/// times of the mount's file): `stat(path)` of the path it was opened by, so a program that
/// compares `stat` of a path with `fstat` of its descriptor (`cp`: "replaced while being
/// copied") sees one file. `None`: not ours, or the path cannot be stat'ed (then the caller
/// asks about the descriptor itself).
///
/// # Safety
/// `buf` points at a `struct stat` (the kernel's layout: `stat` and `stat64` are one on the
/// 64-bit ABIs).
unsafe fn stat_of_mount(fd: c_int, buf: *mut c_void) -> Option<c_int> {
    let path = path_of(fd)?;
    let f = next!("fstatat64", FstatatFn)?;
    // SAFETY: the real fstatat64 on a NUL-terminated path, into the caller's buffer.
    let rc = unsafe { f(libc::AT_FDCWD, path.as_ptr(), buf, 0) };
    (rc == 0).then_some(0)
}

macro_rules! fstat_like {
    ($name:ident, $sym:literal) => {
        /// Interposed `fstat`: a direct descriptor shows the mount's file ([`stat_of_mount`]).
        ///
        /// # Safety
        /// As `fstat(2)`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(fd: c_int, buf: *mut c_void) -> c_int {
            // SAFETY: the caller's buffer, as for fstat.
            if let Some(rc) = unsafe { stat_of_mount(fd, buf) } {
                return rc;
            }
            match next!($sym, FstatFn) {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(fd, buf) },
                None => enosys(),
            }
        }
    };
}

macro_rules! fxstat_like {
    ($name:ident, $sym:literal) => {
        /// Interposed `__fxstat` (binaries built against glibc before 2.33).
        ///
        /// # Safety
        /// As `__fxstat`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(ver: c_int, fd: c_int, buf: *mut c_void) -> c_int {
            // SAFETY: the caller's buffer, as for fstat.
            if let Some(rc) = unsafe { stat_of_mount(fd, buf) } {
                return rc;
            }
            match next!($sym, FxstatFn) {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(ver, fd, buf) },
                None => enosys(),
            }
        }
    };
}

macro_rules! fstatat_like {
    ($name:ident, $sym:literal) => {
        /// Interposed `fstatat`: with `AT_EMPTY_PATH` and an empty path, a direct descriptor
        /// shows the mount's file ([`stat_of_mount`]).
        ///
        /// # Safety
        /// As `fstatat(2)`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            dirfd: c_int,
            path: *const c_char,
            buf: *mut c_void,
            flags: c_int,
        ) -> c_int {
            // SAFETY: a non-null path is NUL-terminated (the caller's contract).
            let empty = !path.is_null() && unsafe { *path } == 0;
            if empty && flags & libc::AT_EMPTY_PATH != 0 {
                // SAFETY: the caller's buffer, as for fstatat.
                if let Some(rc) = unsafe { stat_of_mount(dirfd, buf) } {
                    return rc;
                }
            }
            match next!($sym, FstatatFn) {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(dirfd, path, buf, flags) },
                None => enosys(),
            }
        }
    };
}

fstat_like!(fstat, "fstat");
fstat_like!(fstat64, "fstat64");
fxstat_like!(__fxstat, "__fxstat");
fxstat_like!(__fxstat64, "__fxstat64");
fstatat_like!(fstatat, "fstatat");
fstatat_like!(fstatat64, "fstatat64");

/// Interposed `statx`: with `AT_EMPTY_PATH` and an empty path, a direct descriptor shows the
/// mount's file, as [`stat_of_mount`].
///
/// # Safety
/// As `statx(2)`.
#[no_mangle]
pub unsafe extern "C" fn statx(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mask: c_uint,
    buf: *mut c_void,
) -> c_int {
    let real = next!("statx", StatxFn);
    // SAFETY: a non-null path is NUL-terminated (the caller's contract).
    let empty = !path.is_null() && unsafe { *path } == 0;
    if empty && flags & libc::AT_EMPTY_PATH != 0 {
        if let (Some(p), Some(f)) = (path_of(dirfd), real) {
            // SAFETY: the real statx on a NUL-terminated path, into the caller's buffer.
            let rc = unsafe {
                f(
                    libc::AT_FDCWD,
                    p.as_ptr(),
                    flags & !libc::AT_EMPTY_PATH,
                    mask,
                    buf,
                )
            };
            if rc == 0 {
                return 0;
            }
        }
    }
    match real {
        // SAFETY: the real statx with the caller's arguments.
        Some(f) => unsafe { f(dirfd, path, flags, mask, buf) },
        None => enosys(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn mount_list_parses_and_skips_bad_entries() {
        let m = parse_mounts(b"/mnt/a=/c/a/hints.sock:relative=/x:/mnt/b=c/hints.sock:/m=/s");
        let got: Vec<(&Path, &Path)> = m.iter().map(|m| (&*m.mnt, &*m.socket)).collect();
        assert_eq!(
            got,
            vec![
                (Path::new("/mnt/a"), Path::new("/c/a/hints.sock")),
                (Path::new("/m"), Path::new("/s"))
            ]
        );
    }

    #[test]
    fn only_read_only_opens_and_modes_go_direct() {
        assert!(direct_flags(
            libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOCTTY
        ));
        for f in [
            libc::O_WRONLY,
            libc::O_RDWR,
            libc::O_RDONLY | libc::O_CREAT,
            libc::O_RDONLY | libc::O_DIRECTORY,
            libc::O_RDONLY | libc::O_PATH,
            libc::O_RDONLY | libc::O_DIRECT,
        ] {
            assert!(!direct_flags(f), "{f:o}");
        }
        assert_eq!(fopen_flags(b"r"), Some(libc::O_RDONLY));
        assert_eq!(fopen_flags(b"rbe"), Some(libc::O_RDONLY | libc::O_CLOEXEC));
        for m in [&b"r+"[..], b"w", b"a", b"rw", b"", b"rx"] {
            assert_eq!(fopen_flags(m), None, "{m:?}");
        }
    }
}
