//! `libstagefs_direct.so`: loaded with `LD_PRELOAD` by `stagefs run` into the job's unmodified
//! programs. A read-only open of a staged regular file under one of the run's mounts gets a
//! descriptor of the cache's trusted copy of it, so the program reads scratch at local speed;
//! anything else (not staged yet, a view, `--revalidate`, pins full, daemon gone) goes to the
//! mount as if this library were not there.
//!
//! **How an open goes direct** (docs/direct.md):
//! 1. The path is made absolute (working directory or `dirfd`) and matched against the run's
//!    mounts, lexically ([`resolve`]); only plain paths under a mount are looked at.
//! 2. The mount's direct table ([`stagefs_protocol::table`], mapped once per process) is
//!    looked up: a small file listed *open* is opened by the process itself, through the
//!    cache's `files/` directory, and checked to be the inode, device and size listed — no
//!    round trip, no lock, no allocation. A file listed *gone*, or absent from a complete
//!    table, goes to the mount.
//! 3. A large file (listed *ask*), or any file while the table is not complete yet, is asked
//!    for over the control socket (`direct_open`): a descriptor the daemon pins against
//!    eviction until it is closed.
//!
//! **What is interposed.** `open`, `open64`, `openat`, `openat64`, `__open_2`, `__open64_2`,
//! `__openat_2`, `__openat64_2`, `fopen`, `fopen64` (read-only only: `O_RDONLY` without
//! `O_CREAT`, `O_TRUNC`, `O_DIRECTORY`, `O_PATH`, `O_TMPFILE`, `O_DIRECT`, `O_APPEND`,
//! `O_EXCL`; `fopen` modes `r` with `b`, `e`, `m`, `c`); `close`, `fclose`, `close_range`,
//! `dup`, `dup2`, `dup3`, `fcntl(F_DUPFD*)` and `mmap` to keep the descriptors' records ([`fds`])
//! and pins right; `fstat`, `fstat64`, `__fxstat`, `__fxstat64`, `fstatat`/`fstatat64`/`statx`
//! with `AT_EMPTY_PATH`, so a direct descriptor shows the mount's file (device, inode, owner,
//! modes, times: what `stat` of its path shows, from the table's listing), and a program that compares `fstat` of a descriptor with
//! `stat` of its path (`cp`, `rsync`, `tar`) sees one file. Everything else goes to the next
//! definition ([`real`], looked up when the library is loaded). `openat2` has no libc wrapper
//! (a program calls the system call itself): it reads through the mount.
//!
//! **As a libc citizen.** `errno` is as the real call left it on every path (the library's own
//! work between saves and restores it). The open path through the table, `close`, `dup*`,
//! `fstat*` and `mmap` take no lock and allocate nothing, so a signal handler may call them; a
//! thread already inside the library (a handler interrupting it) passes straight through. A
//! `vfork` child (or a `clone` sharing memory) runs in its parent's memory without the fork
//! handlers: the library sees its process id differ from the one it knows and touches nothing
//! (every call goes to libc). A forked child keeps the table mapping and its parent's direct
//! descriptors (whose pins stay the parent's), and makes its own connection. A process at its
//! descriptor limit gets `EMFILE` from the mount, as without the library.
//!
//! **Why Rust, with a fixed third argument for the variadic `open`.** The protocol is parsed
//! and bounded by the same crate as the daemon's. Stable Rust cannot define a C-variadic
//! function, so `open(path, flags, mode)` takes `mode` as a named argument: on the Linux ABIs
//! stagefs supports (x86-64 System V, AArch64 AAPCS64) a variadic integer argument travels in
//! the same register as a named one. It is only used when the caller passed it
//! (`O_CREAT`/`O_TMPFILE`), and then handed on unchanged to the real, variadic `open`.
//!
//! Known limits: a static binary ignores `LD_PRELOAD` and reads through the mount; a
//! descriptor number past [`fds::TRACKED_FDS`] is served but its `fstat` shows the copy's own
//! metadata; `dup`/`fcntl`/`mmap` made by libc internally (not through its exported symbols)
//! are not seen.

pub mod fds;
pub mod mounts;
pub mod real;
pub mod resolve;

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::{AsRawFd, IntoRawFd};
use std::sync::atomic::{AtomicI32, Ordering};

use fds::{Info, Kind};
use stagefs_protocol::table::{copy_name, Copy, Listing};

thread_local! {
    /// Set while this thread is inside the library, so our own calls pass straight through.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread busy until dropped; `None` if it already is (or its TLS is gone).
struct Busy;

impl Busy {
    fn enter() -> Option<Busy> {
        // `then`, not `then_some`: an eager `Busy` would be built and dropped when the thread
        // is already busy, and its drop would clear the flag of the call it interrupted.
        BUSY.try_with(|b| (!b.replace(true)).then(|| Busy))
            .ok()
            .flatten()
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = BUSY.try_with(|b| b.set(false));
    }
}

/// The process id the library knows: set when it is loaded and in every forked child (the
/// fork handler). A `vfork` child, which runs no handlers, has another.
static PID: AtomicI32 = AtomicI32::new(0);

extern "C" fn after_fork_in_child() {
    PID.store(mounts::pid(), Ordering::Relaxed);
}

/// The library's constructor: looks up the real functions, reads the run's mounts and installs
/// the fork handler, while allocating is still safe.
extern "C" fn init() {
    real::resolve_all();
    PID.store(mounts::pid(), Ordering::Relaxed);
    let _ = mounts::mounts();
    // SAFETY: registers a handler with no preconditions; it only stores an integer.
    unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

/// Whether this call runs in a process the library may act in: not a `vfork` child sharing
/// its parent's memory.
fn ours() -> bool {
    let known = PID.load(Ordering::Relaxed);
    known == 0 || known == mounts::pid()
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
    if path.is_null() || !direct_flags(flags) || mounts::mounts().is_empty() || !ours() {
        return None;
    }
    let _busy = Busy::enter()?;
    // SAFETY: non-null and NUL-terminated (the caller's contract, as for open).
    let bytes = unsafe { CStr::from_ptr(path) }.to_bytes();
    let errno = real::errno();
    let got = std::panic::catch_unwind(|| direct(dirfd, bytes, flags))
        .ok()
        .flatten();
    real::set_errno(errno);
    got
}

/// The flags of the caller's open that the copy is opened with (descriptor behaviour only:
/// the access mode is always read-only).
const KEPT_FLAGS: c_int =
    libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOATIME | libc::O_NOCTTY | libc::O_LARGEFILE;

fn direct(dirfd: c_int, path: &[u8], flags: c_int) -> Option<c_int> {
    let abs = resolve::absolute(dirfd, path)?;
    let (i, rel) = mounts::mounts()
        .iter()
        .enumerate()
        .find_map(|(i, m)| resolve::under(abs.bytes(), &m.mnt).map(|r| (i, r)))?;
    let table = mounts::table(i);
    let (listing, slot) = table.map_or((Listing::Unknown, None), |t| t.reader.find(rel));
    let slot = slot.and_then(|s| u32::try_from(s).ok());
    match listing {
        Listing::Open(copy) => {
            let t = table?;
            let fd = open_copy(t, copy, flags)?;
            let info = Info {
                kind: Kind::Table,
                kept: false,
                mount: i as u8,
                pid: PID.load(Ordering::Relaxed) as u32,
                slot,
            };
            fds::set(fd, info, 0);
            t.counters.add(copy.size);
            Some(fd)
        }
        Listing::Mount => None,
        Listing::Ask | Listing::Unknown => {
            if listing == Listing::Unknown && !regular_nonempty(&abs) {
                return None;
            }
            granted(i, rel, flags, slot)
        }
    }
}

/// Opens the listed copy `copy` of table `t` with the caller's descriptor flags, and checks it
/// is the inode, device and size listed (an evicted copy's name is gone; a directory
/// descriptor number the program reused names another directory).
fn open_copy(t: &mounts::Table, copy: Copy, flags: c_int) -> Option<c_int> {
    let mut name = [0u8; 9];
    name[..8].copy_from_slice(&copy_name(copy.no));
    let oflags = libc::O_RDONLY | libc::O_NOFOLLOW | (flags & KEPT_FLAGS);
    // SAFETY: openat of a NUL-terminated name beneath a directory descriptor we hold, as a
    // system call (not libc's interposed openat).
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat,
            t.dir.as_raw_fd(),
            name.as_ptr(),
            oflags,
            0,
        )
    } as c_int;
    if fd < 0 {
        return None;
    }
    // SAFETY: the descriptor we just opened, borrowed for the check.
    let st = rustix::fs::fstat(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) });
    let same = st.is_ok_and(|st| {
        st.st_ino == copy.ino
            && st.st_dev == t.reader.dev()
            && st.st_size as u64 == copy.size
            && st.st_mode & libc::S_IFMT == libc::S_IFREG
    });
    if !same {
        // SAFETY: closing the descriptor we opened, as a system call.
        unsafe { libc::syscall(libc::SYS_close, fd) };
        return None;
    }
    Some(fd)
}

/// Whether `abs` is a regular, non-empty file (a `stat`, answered from the kernel's attribute
/// cache under snapshot semantics): directories and the like are not worth a round trip.
fn regular_nonempty(abs: &resolve::Abs) -> bool {
    rustix::fs::stat(abs.c_str())
        .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_size > 0)
}

/// A descriptor granted over the socket for `rel` of mount `i`, with the caller's flags.
fn granted(i: usize, rel: &[u8], flags: c_int, slot: Option<u32>) -> Option<c_int> {
    let rel_str = std::str::from_utf8(rel).ok()?;
    let (fd, g) = mounts::grant(i, rel_str)?;
    let raw = fd.into_raw_fd();
    // Received close-on-exec; as the caller asked otherwise.
    // SAFETY: fcntl on the descriptor we just received, as system calls.
    unsafe {
        if flags & libc::O_CLOEXEC == 0 {
            libc::syscall(libc::SYS_fcntl, raw, libc::F_SETFD, 0);
        }
        if flags & libc::O_NONBLOCK != 0 {
            libc::syscall(libc::SYS_fcntl, raw, libc::F_SETFL, libc::O_NONBLOCK);
        }
    }
    // The daemon lists the copy when it trusts it: the slot names the path for fstat.
    let slot = slot.or_else(|| {
        let t = mounts::table_now(i)?;
        t.reader.find(rel).1.and_then(|s| u32::try_from(s).ok())
    });
    let info = Info {
        kind: Kind::Granted,
        kept: false,
        mount: i as u8,
        pid: PID.load(Ordering::Relaxed) as u32,
        slot,
    };
    fds::set(raw, info, g.pin);
    Some(raw)
}

/// Forgets direct descriptor `fd` before it is closed; the (mount, pin) to release after the
/// close, if it holds one this process may release.
fn untrack(fd: c_int) -> Option<(usize, u64)> {
    if !fds::tracked(fd) || !ours() {
        return None;
    }
    let (info, pin) = fds::take(fd)?;
    let mine = info.pid == PID.load(Ordering::Relaxed) as u32;
    (info.kind == Kind::Granted && !info.kept && pin != 0 && mine)
        .then_some((usize::from(info.mount), pin))
}

/// After the real close of a direct descriptor: releases its pin, keeping the close's
/// `errno` for the caller (the release talks to the daemon).
fn release_after_close(pinned: Option<(usize, u64)>) {
    if let Some((i, pin)) = pinned {
        let errno = real::errno();
        if let Some(_busy) = Busy::enter() {
            mounts::release(i, pin);
        }
        real::set_errno(errno);
    }
}

macro_rules! open_like {
    ($name:ident, $sym:ident) => {
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
            match real::f::$sym() {
                // SAFETY: the real open with the caller's arguments.
                Some(f) => unsafe { f(path, flags, mode) },
                None => real::enosys(),
            }
        }
    };
}

macro_rules! openat_like {
    ($name:ident, $sym:ident) => {
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
            match real::f::$sym() {
                // SAFETY: the real openat with the caller's arguments.
                Some(f) => unsafe { f(dirfd, path, flags, mode) },
                None => real::enosys(),
            }
        }
    };
}

macro_rules! open2_like {
    ($name:ident, $sym:ident) => {
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
            match real::f::$sym() {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(path, flags) },
                None => real::enosys(),
            }
        }
    };
}

macro_rules! openat2_like {
    ($name:ident, $sym:ident) => {
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
            match real::f::$sym() {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(dirfd, path, flags) },
                None => real::enosys(),
            }
        }
    };
}

open_like!(open, OPEN);
open_like!(open64, OPEN64);
openat_like!(openat, OPENAT);
openat_like!(openat64, OPENAT64);
open2_like!(__open_2, OPEN_2);
open2_like!(__open64_2, OPEN64_2);
openat2_like!(__openat_2, OPENAT_2);
openat2_like!(__openat64_2, OPENAT64_2);

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
        let errno = real::errno();
        let pinned = untrack(fd);
        // SAFETY: closing the descriptor we received, as a system call.
        unsafe { libc::syscall(libc::SYS_close, fd) };
        release_after_close(pinned);
        real::set_errno(errno);
        return None;
    }
    Some(fp)
}

macro_rules! fopen_like {
    ($name:ident, $sym:ident) => {
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
            match real::f::$sym() {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(path, mode) },
                None => {
                    real::enosys();
                    std::ptr::null_mut()
                }
            }
        }
    };
}

fopen_like!(fopen, FOPEN);
fopen_like!(fopen64, FOPEN64);

/// Interposed `close`: a direct descriptor's record is dropped before the close, its pin
/// released after it.
///
/// # Safety
/// As `close(2)`.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let pinned = untrack(fd);
    let r = match real::f::CLOSE() {
        // SAFETY: the real close with the caller's argument.
        Some(f) => unsafe { f(fd) },
        None => real::enosys(),
    };
    release_after_close(pinned);
    r
}

/// Interposed `fclose`: as [`close`] for the stream's descriptor.
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
    let r = match real::f::FCLOSE() {
        // SAFETY: the real fclose with the caller's argument.
        Some(f) => unsafe { f(fp) },
        None => real::enosys(),
    };
    release_after_close(pinned);
    r
}

/// Pins released by one `close_range` without allocating: the first this many are released
/// after the call, any more just before it (the program is closing them).
const RANGE_PINS: usize = 64;

/// Interposed `close_range`: the direct descriptors in the range are untracked (and their pins
/// released) unless it only marks them close-on-exec.
///
/// # Safety
/// As `close_range(2)`.
#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    let mut later = [(0usize, 0u64); RANGE_PINS];
    let mut n = 0;
    if flags & (libc::CLOSE_RANGE_CLOEXEC as c_int) == 0 && first <= last {
        let end = (last as usize).min(fds::TRACKED_FDS - 1);
        for fd in first as usize..=end {
            if let Some(p) = untrack(fd as c_int) {
                if n < RANGE_PINS {
                    later[n] = p;
                    n += 1;
                } else {
                    release_after_close(Some(p));
                }
            }
        }
    }
    let r = match real::f::CLOSE_RANGE() {
        // SAFETY: the real close_range with the caller's arguments.
        Some(f) => unsafe { f(first, last, flags) },
        None => real::enosys(),
    };
    for p in &later[..n] {
        release_after_close(Some(*p));
    }
    r
}

/// Interposed `dup`: the duplicate is a direct descriptor too (its `fstat` shows the mount's
/// file) and the original's pin is kept for it.
///
/// # Safety
/// As `dup(2)`.
#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    let r = match real::f::DUP() {
        // SAFETY: the real dup with the caller's argument.
        Some(f) => unsafe { f(fd) },
        None => real::enosys(),
    };
    if r >= 0 && ours() {
        fds::duplicate(fd, r);
    }
    r
}

/// What `dup2`/`dup3` onto `new` closes: a direct descriptor there, untracked before the call
/// (only when it can succeed: `old` open, not `new` itself).
fn replaced(new: c_int, old: c_int) -> Option<(usize, u64)> {
    if new == old || !fds::tracked(new) {
        return None;
    }
    // SAFETY: F_GETFD reads a descriptor's flags; no memory is touched.
    let valid = unsafe { libc::syscall(libc::SYS_fcntl, old, libc::F_GETFD) } >= 0;
    if valid {
        untrack(new)
    } else {
        None
    }
}

/// Interposed `dup2`: see [`dup`]; a direct descriptor it replaces is released as at `close`.
///
/// # Safety
/// As `dup2(2)`.
#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    let gone = replaced(new, old);
    let r = match real::f::DUP2() {
        // SAFETY: the real dup2 with the caller's arguments.
        Some(f) => unsafe { f(old, new) },
        None => real::enosys(),
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
    let r = match real::f::DUP3() {
        // SAFETY: the real dup3 with the caller's arguments.
        Some(f) => unsafe { f(old, new, flags) },
        None => real::enosys(),
    };
    after_dup(r, old, gone);
    r
}

fn after_dup(r: c_int, old: c_int, gone: Option<(usize, u64)>) {
    if r >= 0 && r != old && ours() {
        fds::duplicate(old, r);
    }
    release_after_close(gone);
}

macro_rules! fcntl_like {
    ($name:ident, $sym:ident) => {
        /// Interposed `fcntl`: `F_DUPFD`/`F_DUPFD_CLOEXEC` of a direct descriptor as [`dup`].
        /// The third argument (an integer or a pointer) is taken as a named `unsigned long`,
        /// where both ABIs pass it, and handed on.
        ///
        /// # Safety
        /// As `fcntl(2)`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
            let r = match real::f::$sym() {
                // SAFETY: the real fcntl with the caller's arguments.
                Some(f) => unsafe { f(fd, cmd, arg) },
                None => real::enosys(),
            };
            if r >= 0 && (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) && ours() {
                fds::duplicate(fd, r);
            }
            r
        }
    };
}

fcntl_like!(fcntl, FCNTL);
fcntl_like!(fcntl64, FCNTL64);

macro_rules! mmap_like {
    ($name:ident, $sym:ident) => {
        /// Interposed `mmap`: a mapping of a granted (pinned) descriptor keeps its pin until
        /// the process ends (the copy must not be punched under a mapping; a small copy is
        /// never punched, so its mapping needs nothing).
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
            let r = match real::f::$sym() {
                // SAFETY: the real mmap with the caller's arguments.
                Some(f) => unsafe { f(addr, len, prot, flags, fd, off) },
                None => {
                    real::enosys();
                    libc::MAP_FAILED
                }
            };
            if r != libc::MAP_FAILED && fd >= 0 && fds::tracked(fd) && ours() {
                fds::keep(fd);
            }
            r
        }
    };
}

mmap_like!(mmap, MMAP);
mmap_like!(mmap64, MMAP64);

/// What the mount shows of the file direct descriptor `fd` reads (its table listing), the
/// mount's device and the file's size, if the descriptor is ours and listed.
fn shown_of(fd: c_int) -> Option<(stagefs_protocol::table::Shown, u64, u64)> {
    let info = fds::get(fd)?;
    let t = mounts::table_now(usize::from(info.mount))?;
    let (shown, size) = t.reader.shown(u64::from(info.slot?))?;
    Some((shown, t.mount_dev, size))
}

/// The metadata of direct descriptor `fd` as the mount shows its file, written into `buf`:
/// what `stat` of its path there gives (device, inode, modes, owner, times, 1 MiB blocks), so
/// a program that compares `stat` of a path with `fstat` of its descriptor (`cp`: "replaced
/// while being copied") sees one file. Made from the direct table's listing: no system call,
/// no lookup through the mount. `None`: not ours, or not listed (then the caller asks about
/// the descriptor itself).
///
/// # Safety
/// `buf` points at a `struct stat` (the kernel's layout: `stat` and `stat64` are one on the
/// 64-bit ABIs).
unsafe fn stat_of_mount(fd: c_int, buf: *mut c_void) -> Option<c_int> {
    if !fds::tracked(fd) {
        return None;
    }
    let (s, dev, size) = shown_of(fd)?;
    // SAFETY: an all-zero `struct stat` is a valid one (padding included).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    st.st_dev = dev;
    st.st_ino = s.ino;
    st.st_nlink = s.nlink as _;
    st.st_mode = libc::S_IFREG | s.perm;
    st.st_uid = s.uid;
    st.st_gid = s.gid;
    st.st_size = size as _;
    st.st_blksize = 1 << 20;
    st.st_blocks = size.div_ceil(512) as _;
    let (sec, nsec) = (
        s.mtime_ns.div_euclid(1_000_000_000),
        s.mtime_ns.rem_euclid(1_000_000_000),
    );
    st.st_atime = sec;
    st.st_atime_nsec = nsec;
    st.st_mtime = sec;
    st.st_mtime_nsec = nsec;
    st.st_ctime = sec;
    st.st_ctime_nsec = nsec;
    // SAFETY: the caller's buffer holds a `struct stat`.
    unsafe { std::ptr::write(buf.cast::<libc::stat>(), st) };
    Some(0)
}

/// [`stat_of_mount`] as a `struct statx` (the fields `mask` asks for are all basic ones).
///
/// # Safety
/// `buf` points at a `struct statx`.
unsafe fn statx_of_mount(fd: c_int, mask: c_uint, buf: *mut c_void) -> Option<c_int> {
    if !fds::tracked(fd) {
        return None;
    }
    let (s, dev, size) = shown_of(fd)?;
    // SAFETY: an all-zero `struct statx` is a valid one.
    let mut x: libc::statx = unsafe { std::mem::zeroed() };
    x.stx_mask = mask & libc::STATX_BASIC_STATS;
    x.stx_blksize = 1 << 20;
    x.stx_nlink = s.nlink;
    x.stx_uid = s.uid;
    x.stx_gid = s.gid;
    x.stx_mode = (libc::S_IFREG | s.perm) as u16;
    x.stx_ino = s.ino;
    x.stx_size = size;
    x.stx_blocks = size.div_ceil(512);
    for t in [&mut x.stx_atime, &mut x.stx_mtime, &mut x.stx_ctime] {
        t.tv_sec = s.mtime_ns.div_euclid(1_000_000_000);
        t.tv_nsec = s.mtime_ns.rem_euclid(1_000_000_000) as u32;
    }
    x.stx_dev_major = libc::major(dev);
    x.stx_dev_minor = libc::minor(dev);
    // SAFETY: the caller's buffer holds a `struct statx`.
    unsafe { std::ptr::write(buf.cast::<libc::statx>(), x) };
    Some(0)
}

macro_rules! fstat_like {
    ($name:ident, $sym:ident) => {
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
            match real::f::$sym() {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(fd, buf) },
                None => real::enosys(),
            }
        }
    };
}

macro_rules! fxstat_like {
    ($name:ident, $sym:ident) => {
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
            match real::f::$sym() {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(ver, fd, buf) },
                None => real::enosys(),
            }
        }
    };
}

macro_rules! fstatat_like {
    ($name:ident, $sym:ident) => {
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
            match real::f::$sym() {
                // SAFETY: the real function with the caller's arguments.
                Some(f) => unsafe { f(dirfd, path, buf, flags) },
                None => real::enosys(),
            }
        }
    };
}

fstat_like!(fstat, FSTAT);
fstat_like!(fstat64, FSTAT64);
fxstat_like!(__fxstat, FXSTAT);
fxstat_like!(__fxstat64, FXSTAT64);
fstatat_like!(fstatat, FSTATAT);
fstatat_like!(fstatat64, FSTATAT64);

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
    let real = real::f::STATX();
    // SAFETY: a non-null path is NUL-terminated (the caller's contract).
    let empty = !path.is_null() && unsafe { *path } == 0;
    if empty && flags & libc::AT_EMPTY_PATH != 0 {
        // SAFETY: the caller's buffer, as for statx.
        if let Some(rc) = unsafe { statx_of_mount(dirfd, mask, buf) } {
            return rc;
        }
    }
    match real {
        // SAFETY: the real statx with the caller's arguments.
        Some(f) => unsafe { f(dirfd, path, flags, mask, buf) },
        None => real::enosys(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Regression: a refused `Busy::enter` built a guard and dropped it, clearing the flag of
    /// the call it interrupted, so a signal handler's second open went into the library and
    /// waited for the lock its own thread held (seconds per signal).
    #[test]
    fn a_refused_busy_enter_leaves_the_thread_busy() {
        let outer = Busy::enter().expect("not busy yet");
        assert!(Busy::enter().is_none());
        assert!(
            Busy::enter().is_none(),
            "the first refusal cleared the flag"
        );
        drop(outer);
        assert!(Busy::enter().is_some());
    }
}
