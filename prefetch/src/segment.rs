//! Packed storage for small blocks: large *segment* files on scratch, filled by appending.
//!
//! A dataset of a million 100 KB images must not become a million files on scratch (inode
//! pressure, slow remounts), so blocks of small files and rendered view units are appended to
//! segment files of up to [`SEGMENT_BYTES`], each block starting on a 4 KiB boundary. Freeing a
//! block punches a hole over exactly its pages — the alignment is what makes that safe for its
//! neighbours — and a segment whose blocks are all gone is deleted. Space is never reused
//! inside a segment, so a stale index record can only point at a hole (zeros that fail their
//! checksum), never at another file's bytes.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use tracing::debug;

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
        .filter(|n| *n > 0 && *n < crate::index::OWN_FILE)
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
/// hole punching keep the bytes; the index no longer lists them, so they are never served.
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
