//! Paths without allocating: the absolute form of an open's path (relative to the working
//! directory or a directory descriptor) in a buffer on the stack, and its part under a mount.
//!
//! Resolution is lexical: a path is the mount's only if its absolute form starts with the
//! mount's canonical path and the rest is plain (no `.`, `..` or empty components, no trailing
//! `/`). Symlinks inside the mount are not followed here: the direct table lists only regular
//! files by their own paths, and the daemon resolves a socket request in its snapshot without
//! following any, so a path through a symlink is read through the mount.

use std::ffi::c_int;

/// Room for an absolute path of up to `PATH_MAX` bytes and its NUL (the kernel takes no
/// longer path; a relative open whose joined form is longer goes to the mount). 4 KiB of
/// stack: small enough for a signal handler's.
pub const ABS_MAX: usize = 4096 + 1;

/// An absolute path in a stack buffer, NUL-terminated.
pub struct Abs {
    buf: [u8; ABS_MAX],
    len: usize,
}

impl Abs {
    /// The path's bytes (without the NUL).
    pub fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// The path with its NUL, for a system call.
    pub fn c_ptr(&self) -> *const libc::c_char {
        self.buf.as_ptr().cast()
    }

    /// The path as a C string.
    pub fn c_str(&self) -> &std::ffi::CStr {
        std::ffi::CStr::from_bytes_with_nul(&self.buf[..=self.len]).unwrap_or_default()
    }

    /// `prefix` + `/` + `rest` (a mount's file by its path under the mount).
    pub fn join(prefix: &[u8], rest: &[u8]) -> Option<Abs> {
        let mut a = Abs {
            buf: [0; ABS_MAX],
            len: 0,
        };
        a.push(prefix)?;
        a.push(b"/")?;
        a.push(rest)?;
        a.finish()
    }

    fn push(&mut self, b: &[u8]) -> Option<()> {
        let end = self.len.checked_add(b.len())?;
        if end >= ABS_MAX {
            return None;
        }
        self.buf[self.len..end].copy_from_slice(b);
        self.len = end;
        Some(())
    }

    fn finish(mut self) -> Option<Abs> {
        if self.buf[..self.len].contains(&0) {
            return None;
        }
        *self.buf.get_mut(self.len)? = 0;
        Some(self)
    }
}

/// The absolute form of `path` as an open relative to `dirfd` would see it: `path` itself if
/// absolute, else joined to the working directory (`getcwd`) or to the directory `dirfd`
/// names (`/proc/self/fd/N`). `None` if it cannot be known (then the open is the mount's).
pub fn absolute(dirfd: c_int, path: &[u8]) -> Option<Abs> {
    let mut a = Abs {
        buf: [0; ABS_MAX],
        len: 0,
    };
    if path.first() == Some(&b'/') {
        a.push(path)?;
        return a.finish();
    }
    if dirfd == libc::AT_FDCWD {
        // SAFETY: getcwd writes at most the given size (NUL included) into our buffer.
        let p = unsafe { libc::getcwd(a.buf.as_mut_ptr().cast(), ABS_MAX) };
        if p.is_null() {
            return None;
        }
        a.len = a.buf.iter().position(|&b| b == 0)?;
    } else {
        let mut link = [0u8; 32];
        let head = b"/proc/self/fd/";
        link[..head.len()].copy_from_slice(head);
        let n = head.len() + write_decimal(&mut link[head.len()..], u64::try_from(dirfd).ok()?);
        // SAFETY: readlink of a NUL-terminated path into our buffer, at most 4096 bytes.
        let got = unsafe {
            libc::readlink(
                link[..=n].as_ptr().cast(),
                a.buf.as_mut_ptr().cast(),
                ABS_MAX - 1,
            )
        };
        if got <= 0 {
            return None;
        }
        a.len = got as usize;
        if a.buf[0] != b'/' {
            return None; // not a directory of the file tree ("socket:[...]", say)
        }
    }
    if a.len > 1 {
        a.push(b"/")?;
    }
    a.push(path)?;
    a.finish()
}

/// Writes `v` in decimal (and a NUL after it) into `out`; the digits' length.
pub fn write_decimal(out: &mut [u8], v: u64) -> usize {
    let k = stagefs_protocol::write_decimal(out, v);
    out[k] = 0;
    k
}

/// The part of `abs` under mount `mnt` (canonical, no trailing `/`), if it is a plain path of
/// a file inside it.
pub fn under<'a>(abs: &'a [u8], mnt: &[u8]) -> Option<&'a [u8]> {
    let rest = abs.strip_prefix(mnt)?.strip_prefix(b"/")?;
    plain(rest).then_some(rest)
}

/// Whether `rel` is a plain relative path: not empty, no `.`, `..` or empty component, no
/// NUL, at most `PATH_MAX` bytes.
pub fn plain(rel: &[u8]) -> bool {
    !rel.is_empty()
        && rel.len() <= 4096
        && !rel.contains(&0)
        && rel
            .split(|&b| b == b'/')
            .all(|c| !c.is_empty() && c != b"." && c != b"..")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn paths_under_a_mount_are_plain_or_the_mounts_own() {
        assert_eq!(under(b"/m/a/b.jpg", b"/m"), Some(&b"a/b.jpg"[..]));
        for bad in [
            &b"/m"[..],
            b"/m/",
            b"/mx/a",
            b"/m/a/../b",
            b"/m/./a",
            b"/m/a//b",
            b"/m/a/",
        ] {
            assert_eq!(under(bad, b"/m"), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn relative_paths_join_the_working_directory_and_a_directory_descriptor() {
        let cwd = std::env::current_dir().unwrap();
        let a = absolute(libc::AT_FDCWD, b"x/y").unwrap();
        assert_eq!(a.bytes(), cwd.join("x/y").as_os_str().as_encoded_bytes());
        let d = std::fs::File::open("/usr").unwrap();
        let a = absolute(std::os::fd::AsRawFd::as_raw_fd(&d), b"lib").unwrap();
        assert_eq!(a.bytes(), b"/usr/lib");
        assert_eq!(absolute(-5, b"x").map(|a| a.len), None);
        assert_eq!(absolute(libc::AT_FDCWD, b"/abs").unwrap().bytes(), b"/abs");
        let j = Abs::join(b"/m", b"a/b").unwrap();
        assert_eq!(j.bytes(), b"/m/a/b");
    }
}
