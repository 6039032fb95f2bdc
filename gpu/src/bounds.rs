//! The bounds a Loader or Streamer checks its configuration and its files' claims against
//! before allocating anything from them, in one place for both: each constant says why it has
//! its value.

use crate::error::StreamError;

/// The largest batch accepted (bytes): beyond this a single pinned buffer is more than most
/// hosts can lock, and a smaller batch streams just as fast.
pub const MAX_BATCH_BYTES: u64 = 16 << 30;

/// Most rows an epoch order holds: 2^31 samples (an order costs 8 bytes a row, 16 GiB here),
/// past any dataset read sample by sample. A header claiming more fails the constructor
/// instead of an allocation aborting the interpreter.
pub const MAX_ROWS: u64 = 1 << 31;

/// Most ring slots: 4096 batches in flight is past any use (each slot is a batch of host and
/// device memory); 2^31 made the ring's queue abort the interpreter.
pub const MAX_RING: usize = 4096;

/// Most reader threads: 1024, far past the cores of any node.
pub const MAX_READERS: usize = 1024;

/// Checks the row count and the ring and reader counts against their bounds.
pub fn check_counts(rows: u64, ring: usize, readers: usize) -> Result<(), StreamError> {
    if rows > MAX_ROWS {
        return Err(StreamError::Config(format!(
            "{rows} rows: more than the {MAX_ROWS} samples an epoch order holds"
        )));
    }
    if ring > MAX_RING {
        return Err(StreamError::Config(format!(
            "ring={ring}: at most {MAX_RING} slots"
        )));
    }
    if readers > MAX_READERS {
        return Err(StreamError::Config(format!(
            "readers={readers}: at most {MAX_READERS} reader threads"
        )));
    }
    Ok(())
}
