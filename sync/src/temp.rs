//! Temporary names in destination directories, and removal of those a crashed run left behind.
//!
//! A temporary is `.stagefs-tmp.<pid>.<seq>.<name>`: the fixed prefix makes leftovers
//! recognisable (and hidden from `ls`), the pid lets a pass tell a dead run's leftovers from the
//! live temporaries of another sync writing into the same directory, and the sequence number
//! keeps parallel copies in one process apart. The file name is truncated so that the whole name
//! stays within NAME_MAX (255 bytes).

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::atomic::{AtomicU64, Ordering};

/// Prefix of every temporary file name stagefs creates.
pub const TEMP_PREFIX: &str = ".stagefs-tmp.";

/// Longest file name most Linux filesystems accept.
const NAME_MAX: usize = 255;

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh temporary name for a file that will be renamed to `name`.
pub fn temp_name(name: &OsStr) -> OsString {
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let mut out = format!("{TEMP_PREFIX}{}.{seq}.", std::process::id()).into_bytes();
    let room = NAME_MAX.saturating_sub(out.len());
    let bytes = name.as_bytes();
    out.extend_from_slice(&bytes[..bytes.len().min(room)]);
    OsString::from_vec(out)
}

/// Whether `name` is a stagefs temporary.
pub fn is_temp(name: &OsStr) -> bool {
    name.as_bytes().starts_with(TEMP_PREFIX.as_bytes())
}

/// Whether the temporary `name` belongs to a process other than this one that is still running,
/// so it must be left alone. Names that cannot be parsed are treated as stale.
pub fn owned_by_live_process(name: &OsStr) -> bool {
    let rest = &name.as_bytes()[TEMP_PREFIX.len().min(name.len())..];
    let pid_text = rest.split(|&b| b == b'.').next().unwrap_or(&[]);
    let Some(pid) = std::str::from_utf8(pid_text)
        .ok()
        .and_then(|t| t.parse::<libc::pid_t>().ok())
    else {
        return false;
    };
    if pid <= 0 || pid as u32 == std::process::id() {
        return false;
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks that the pid exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_names_are_recognised_and_bounded() {
        let long = OsString::from("x".repeat(300));
        let t = temp_name(&long);
        assert!(t.len() <= NAME_MAX);
        assert!(is_temp(&t));
        assert!(!is_temp(OsStr::new("model.pt")));
        // Our own temporaries count as stale: a pass cleans them before it starts.
        assert!(!owned_by_live_process(&t));
        assert!(!owned_by_live_process(OsStr::new(".stagefs-tmp.garbage")));
        // pid 1 is alive in every Linux pid namespace.
        assert!(owned_by_live_process(OsStr::new(".stagefs-tmp.1.0.a")));
    }
}
