//! The header of a cached file: what binds a data file on scratch to one version of one source
//! file, and the per-block checksums that make every served block verifiable.
//!
//! Headers are small JSON documents written to a temporary name and renamed into place, so a
//! crash leaves the old header or the new one. A block absent from the header is a miss, even if
//! its bytes reached the data file: headers are flushed after data, never before.

use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::cachedir::CacheDir;
use crate::source::Signature;

/// Largest header accepted at load (16 MiB: checksums of a 1 PB file would not fit, 16 TB do).
const MAX_HEADER_BYTES: u64 = 16 << 20;

/// Bumped whenever the on-disk layout changes; entries of other versions are discarded at load.
pub const FORMAT_VERSION: u32 = 1;

/// The header of one cached source file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EntryHeader {
    /// [`FORMAT_VERSION`] of the writer.
    pub format: u32,
    /// Path relative to the source root (lossy UTF-8 for display and collision checks).
    pub path: String,
    /// Source size and mtime the cached bytes belong to.
    pub sig: Signature,
    /// Block size the checksums were computed with.
    pub block_size: u64,
    /// CRC-32 of each block present in the data file; `None` for blocks not cached.
    pub crcs: Vec<Option<u32>>,
    /// Use sequence number, to restore the eviction order after a remount.
    pub last_used: u64,
}

impl EntryHeader {
    /// Writes the header as `name` in `dir` atomically (a new temporary file with an
    /// unpredictable name, then rename).
    pub fn store(&self, dir: &CacheDir, name: &str) -> io::Result<()> {
        let bytes = serde_json::to_vec(self).map_err(io::Error::other)?;
        let (mut f, tmp) = dir.create_temp(name)?;
        if let Err(e) = f.write_all(&bytes) {
            let _ = dir.remove(&tmp);
            return Err(e);
        }
        drop(f);
        dir.rename(&tmp, name)
    }

    /// Reads the header `name` of `dir`; `None` if it is missing, unreadable, too large or from
    /// another format version.
    pub fn load(dir: &CacheDir, name: &OsStr) -> Option<EntryHeader> {
        let f = dir.open_read(name).ok()?;
        // A header lists one checksum per 1 MiB block: a few MB covers a file of terabytes.
        if f.metadata().ok()?.len() > MAX_HEADER_BYTES {
            return None;
        }
        let mut bytes = Vec::new();
        f.take(MAX_HEADER_BYTES).read_to_end(&mut bytes).ok()?;
        let header: EntryHeader = serde_json::from_slice(&bytes).ok()?;
        (header.format == FORMAT_VERSION && header.block_size == crate::BLOCK_SIZE)
            .then_some(header)
    }
}

/// Stable 64-bit FNV-1a hash of a path's bytes: names the cache files of a source file. It must
/// not change between builds (std's hasher may), or a remount would not find its cache.
pub fn path_key(rel: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    rel.as_os_str()
        .as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
}
