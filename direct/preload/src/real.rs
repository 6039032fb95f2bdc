//! The next definitions of the functions the library interposes (libc's), looked up with
//! `dlsym(RTLD_NEXT, ...)` once, when the library is loaded ([`resolve_all`], from its
//! constructor): a lookup later, inside an interposed call, could run in a signal handler or a
//! `vfork` child, and `dlsym` takes the dynamic loader's lock and may allocate. A call made
//! before the constructor ran (another library's constructor) looks its symbol up then.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

/// One symbol's next definition, looked up once.
pub struct Sym {
    name: &'static [u8],
    ptr: AtomicPtr<c_void>,
}

impl Sym {
    const fn new(name: &'static [u8]) -> Sym {
        Sym {
            name,
            ptr: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// The address of the next definition, or null if there is none.
    pub fn addr(&self) -> *mut c_void {
        let p = self.ptr.load(Ordering::Acquire);
        if !p.is_null() {
            return p;
        }
        // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds the definition after ours.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr().cast()) };
        self.ptr.store(p, Ordering::Release);
        p
    }
}

macro_rules! syms {
    ($($id:ident = $name:literal : $ty:ty;)*) => {
        $(
            #[doc = concat!("`", $name, "`.")]
            pub static $id: Sym = Sym::new(concat!($name, "\0").as_bytes());
        )*
        /// Looks every symbol up (the library's constructor).
        pub fn resolve_all() {
            $( $id.addr(); )*
        }
        /// Typed accessors: `real::f::open()` is the next `open`, if there is one.
        pub mod f {
            #![allow(non_snake_case, missing_docs)]
            use super::*;
            $(
                #[inline]
                pub fn $id() -> Option<$ty> {
                    let p = super::$id.addr();
                    // SAFETY: the symbol of this name is the C function of type $ty.
                    (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
                }
            )*
        }
    };
}

/// `open`-like: path, flags, then a mode read only with `O_CREAT`/`O_TMPFILE`.
pub type OpenFn = unsafe extern "C" fn(*const c_char, c_int, ...) -> c_int;
/// `openat`-like.
pub type OpenatFn = unsafe extern "C" fn(c_int, *const c_char, c_int, ...) -> c_int;
/// `__open_2`-like (`_FORTIFY_SOURCE`).
pub type Open2Fn = unsafe extern "C" fn(*const c_char, c_int) -> c_int;
/// `__openat_2`-like.
pub type Openat2Fn = unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int;
/// `fopen`-like.
pub type FopenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut libc::FILE;
/// `close`.
pub type CloseFn = unsafe extern "C" fn(c_int) -> c_int;
/// `fclose`.
pub type FcloseFn = unsafe extern "C" fn(*mut libc::FILE) -> c_int;
/// `close_range`.
pub type CloseRangeFn = unsafe extern "C" fn(c_uint, c_uint, c_int) -> c_int;
/// `dup`.
pub type DupFn = unsafe extern "C" fn(c_int) -> c_int;
/// `dup2`.
pub type Dup2Fn = unsafe extern "C" fn(c_int, c_int) -> c_int;
/// `dup3`.
pub type Dup3Fn = unsafe extern "C" fn(c_int, c_int, c_int) -> c_int;
/// `fcntl`.
pub type FcntlFn = unsafe extern "C" fn(c_int, c_int, ...) -> c_int;
/// `mmap`.
pub type MmapFn = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, c_int, i64) -> *mut c_void;
/// `fstatat`.
pub type FstatatFn = unsafe extern "C" fn(c_int, *const c_char, *mut c_void, c_int) -> c_int;
/// `fstat`.
pub type FstatFn = unsafe extern "C" fn(c_int, *mut c_void) -> c_int;
/// `__fxstat`.
pub type FxstatFn = unsafe extern "C" fn(c_int, c_int, *mut c_void) -> c_int;
/// `statx`.
pub type StatxFn = unsafe extern "C" fn(c_int, *const c_char, c_int, c_uint, *mut c_void) -> c_int;

syms! {
    OPEN = "open": OpenFn;
    OPEN64 = "open64": OpenFn;
    OPENAT = "openat": OpenatFn;
    OPENAT64 = "openat64": OpenatFn;
    OPEN_2 = "__open_2": Open2Fn;
    OPEN64_2 = "__open64_2": Open2Fn;
    OPENAT_2 = "__openat_2": Openat2Fn;
    OPENAT64_2 = "__openat64_2": Openat2Fn;
    FOPEN = "fopen": FopenFn;
    FOPEN64 = "fopen64": FopenFn;
    CLOSE = "close": CloseFn;
    FCLOSE = "fclose": FcloseFn;
    CLOSE_RANGE = "close_range": CloseRangeFn;
    DUP = "dup": DupFn;
    DUP2 = "dup2": Dup2Fn;
    DUP3 = "dup3": Dup3Fn;
    FCNTL = "fcntl": FcntlFn;
    FCNTL64 = "fcntl64": FcntlFn;
    MMAP = "mmap": MmapFn;
    MMAP64 = "mmap64": MmapFn;
    FSTATAT = "fstatat": FstatatFn;
    FSTATAT64 = "fstatat64": FstatatFn;
    FSTAT = "fstat": FstatFn;
    FSTAT64 = "fstat64": FstatFn;
    FXSTAT = "__fxstat": FxstatFn;
    FXSTAT64 = "__fxstat64": FxstatFn;
    STATX = "statx": StatxFn;
}

/// Sets `errno` to `ENOSYS` and returns -1: what an interposed call does when libc has no
/// next definition (never on glibc).
pub fn enosys() -> c_int {
    set_errno(libc::ENOSYS);
    -1
}

/// This thread's `errno`.
pub fn errno() -> c_int {
    // SAFETY: __errno_location points at this thread's errno.
    unsafe { *libc::__errno_location() }
}

/// Sets this thread's `errno`.
pub fn set_errno(e: c_int) {
    // SAFETY: __errno_location points at this thread's errno.
    unsafe { *libc::__errno_location() = e };
}
