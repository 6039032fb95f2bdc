//! The direct-read library this binary carries (built and embedded by build.rs), written out
//! where the job's programs can load it: `stagefs run` needs nothing installed beside it.
//!
//! **Where.** Into the first mount's cache directory, which is the user's own (0700) — so no
//! other user can replace a library that every program of the job loads — as
//! `direct-<hash>.so` (the hash of its bytes: a newer binary writes a new file, an old job
//! keeps mapping its own). Written to a temporary name and renamed into place, so a reader
//! never maps half a file. Scratch mounted `noexec` cannot map it executable: then it goes
//! into a sealed memory file instead, loaded as `/proc/<pid of stagefs run>/fd/<n>` (valid
//! while `stagefs run` waits for the job, which it does until the job ends).

use std::ffi::OsString;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The library's bytes.
static LIB: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libstagefs_direct.so"));

/// A written-out library: its path for `LD_PRELOAD`, and what keeps it valid.
pub struct Installed {
    /// The path to preload.
    pub path: PathBuf,
    /// The memory file behind a `/proc/self/fd` path (kept open for the job's life).
    _memfd: Option<OwnedFd>,
}

/// FNV-1a of the library's bytes, for its file name.
fn digest() -> u64 {
    LIB.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Writes the library out for a job whose first mount's cache is `cache` (see the module
/// docs); why not, if it cannot be.
pub fn install(cache: &Path) -> Result<Installed, String> {
    if LIB.len() < 4 || &LIB[..4] != b"\x7fELF" {
        return Err("this binary carries no direct-read library".into());
    }
    let noexec = rustix::fs::statvfs(cache)
        .map(|s| s.f_flag.contains(rustix::fs::StatVfsMountFlags::NOEXEC))
        .map_err(|e| {
            format!(
                "cannot inspect the cache directory {}: {e}",
                cache.display()
            )
        })?;
    if !noexec {
        return write_file(cache).map(|path| Installed { path, _memfd: None });
    }
    memfd().map_err(|e| {
        format!(
            "{} is on a noexec filesystem and no memory file could hold the library: {e}",
            cache.display()
        )
    })
}

fn write_file(cache: &Path) -> Result<PathBuf, String> {
    let name = format!("direct-{:016x}.so", digest());
    let path = cache.join(&name);
    if std::fs::read(&path).is_ok_and(|b| b == LIB) {
        return Ok(path);
    }
    let tmp = cache.join(format!("{name}.{}.tmp", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| f.write_all(LIB))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("cannot write {}: {e}", path.display()));
    }
    Ok(path)
}

fn memfd() -> std::io::Result<Installed> {
    use rustix::fs::{MemfdFlags, SealFlags};
    // Not close-on-exec: nothing needs it across exec (the path names this process's copy),
    // but it must stay open in this process, which outlives the job's programs.
    let fd = rustix::fs::memfd_create("libstagefs_direct.so", MemfdFlags::ALLOW_SEALING)?;
    let mut f = std::fs::File::from(fd);
    f.write_all(LIB)?;
    let fd = OwnedFd::from(f);
    rustix::fs::fcntl_add_seals(
        &fd,
        SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
    )?;
    let path = PathBuf::from(format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        fd.as_raw_fd()
    ));
    Ok(Installed {
        path,
        _memfd: Some(fd),
    })
}

/// `LD_PRELOAD` with `lib` first, before any the user set.
pub fn preload_value(lib: &Path) -> OsString {
    let mut v = lib.as_os_str().to_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
        v.push(":");
        v.push(old);
    }
    v
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_binary_carries_a_shared_library() {
        assert_eq!(&LIB[..4], b"\x7fELF");
        // ET_DYN: a shared object.
        assert_eq!(u16::from_le_bytes([LIB[16], LIB[17]]), 3);
    }

    #[test]
    fn the_library_is_written_once_and_privately() {
        let d = tempfile::tempdir().unwrap();
        let a = install(d.path()).unwrap();
        let b = install(d.path()).unwrap();
        assert_eq!(a.path, b.path);
        assert_eq!(std::fs::read(&a.path).unwrap(), LIB);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&a.path).unwrap().permissions(),
        );
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        let m = memfd().unwrap();
        assert_eq!(std::fs::read(&m.path).unwrap(), LIB);
    }
}
