//! The cache log: one append-only log of what the cache holds, replayed at mount. (Not the
//! metadata snapshot file, which is the filesystem's: `stagefs index` output, or `snapshot`
//! in the cache directory.)
//!
//! Every change to the cache is a small self-checking record appended to `cache.log`: an entry
//! created (its key — the source path or view path it caches — and the version of the contents),
//! a block stored (where, how long, its CRC-32), a block or an entry dropped, an entry rebound
//! to its owner's node. Records are buffered in memory and appended by [`flush`] every couple
//! of seconds, so a flush costs what changed, not the whole log; block records are buffered
//! only after their bytes are written, so a `kill -9` loses at most the blocks cached since the
//! last flush, never correctness. A remount reads the log once, front to back (tens of MB for a
//! million files: well under a second), and rebuilds the eviction order from the order blocks
//! were recorded in. When the log holds mostly garbage (dropped blocks) it is rewritten
//! compactly to a temporary file and renamed into place.
//!
//! Framing: `[len: u16][tag: u8][payload][crc32(tag + payload): u32]`, little-endian. A torn or
//! corrupt record ends the replay there (the log is truncated to the last good record): the
//! cache is private and checksummed, so a bad log costs cached blocks, never wrong bytes.
//!
//! - [`record`]: the record format (encode, decode, header).
//! - `window.rs`: the log read front to back through one reused buffer of 4 MiB (a record is
//!   at most 64 KiB), so neither a remount nor compaction at unmount holds the log in memory.
//! - `replay.rs`: applying the log at open.
//! - `compact.rs`: rewriting it when mostly garbage.
//!
//! [`flush`]: crate::store::CacheStore::flush

pub mod record;

mod compact;
mod replay;
mod window;

use std::fs::File;
use std::io;
use std::sync::Mutex;

use crate::cachedir::CacheDir;
use crate::locks::lock;

use record::Record;

/// The cache log's file name in the format directory.
pub(super) const LOG_FILE: &str = "cache.log";
/// The log's name in earlier versions of this format directory: removed at open.
pub(super) const OLD_LOG_FILE: &str = "index.log";
/// Largest log accepted at load: 64 GiB is far beyond any real cache's (≈ 100 B per block).
const MAX_LOG_BYTES: u64 = 64 << 30;
/// The log is rewritten at load or close when live records are less than this fraction of it.
const COMPACT_BELOW: f64 = 0.5;
/// Encoded size of a block record, and of an entry record without its key.
const BLOCK_REC: u64 = 31;
const ENTRY_REC: u64 = 55;

pub(super) struct Log {
    pub(super) file: File,
    /// Bytes of the log file written so far.
    pub(super) len: u64,
    /// Records not yet written.
    pub(super) pending: Vec<u8>,
    /// Bytes of records that no longer describe anything (dropped blocks and entries, and the
    /// records that dropped them): when they are most of the log, it is rewritten.
    pub(super) garbage: u64,
    /// `pending` holds a `Trusted` record: the next flush makes scratch durable first, so a
    /// record never outlives the bytes it vouches for (a crashed node's writeback).
    pub(super) trust_pending: bool,
}

/// Appends one record to the pending log buffer (and counts it as live data).
pub(super) fn append(log: &Mutex<Log>, rec: &Record<'_>) {
    let mut log = lock(log);
    let start = log.pending.len();
    record::encode(rec, &mut log.pending);
    let own = (log.pending.len() - start) as u64;
    // What this record makes obsolete, itself included (approximately, for entries' keys).
    log.garbage += match rec {
        Record::Block { .. } | Record::Entry(_) => 0,
        Record::DropBlock { .. } => own + BLOCK_REC,
        Record::DropEntry { .. } => own + ENTRY_REC,
        Record::Bind { .. } => own,
        Record::Trusted { .. } => 0,
    };
    // Written only once scratch holds the copy's bytes (`flush` syncs first).
    if matches!(rec, Record::Trusted { .. }) {
        log.trust_pending = true;
    }
}

/// Opens the cache log (creating it with an empty header); returns it and its length.
pub(super) fn open_log(dir: &CacheDir) -> io::Result<(File, u64)> {
    let f = dir.open_rw(LOG_FILE, true)?;
    let len = f.metadata()?.len();
    if len > MAX_LOG_BYTES {
        return Err(io::Error::other(format!(
            "cache log is {len} bytes, larger than any cache could need: remove the cache directory"
        )));
    }
    Ok((f, len))
}
