//! The scratch block cache and the machinery that fills it.
//!
//! A source file is cached as one sparse *data file* on scratch, holding the source's bytes at
//! their own offsets, plus a *header* file ([`meta`]) that binds it to the source path, size,
//! mtime and format version and records a CRC-32 per fixed-size block. A block is served only
//! if its checksum matches and the header matches the source's current size and mtime; anything
//! else is a miss, never wrong bytes. Keeping the bytes at their own offsets (rather than one
//! file per block) is what lets a fully staged file be handed to the kernel for FUSE passthrough.
//!
//! - [`cachedir`]: the private cache directory (0700/0600, owner-checked, no symlinks followed).
//! - [`store`]: the on-disk cache (data files, headers, load at mount, flush, checksums).
//! - [`eviction`]: the capacity limit and least-recently-used block eviction.
//! - [`fetch`]: the fetch scheduler: demand reads on the caller's thread, prefetch and staging
//!   on a bounded worker pool, in-flight de-duplication.
//! - [`readahead`]: per-handle sequential detection with a growing window.
//! - [`staging`]: the background staging plan (small files first, directory order).
//! - [`source`]: where bytes come from, with change detection.
//! - [`stats`]: counters behind `.stagefs/stats`.

pub mod cachedir;
pub mod error;
pub mod eviction;
pub mod fetch;
pub mod meta;
pub mod readahead;
pub mod source;
pub mod staging;
pub mod stats;
pub mod store;

pub use error::{CacheError, SourceError};
pub use fetch::{BlockMemo, FetchConfig, Fetcher, Priority};
pub use source::{LocalSource, Signature, Source};
pub use stats::{Stats, StatsSnapshot};
pub use store::{CacheStore, StoreConfig};

/// Size of a cache block: 1 MiB matches the largest FUSE read request (256 pages) and the stripe
/// size of common parallel filesystems, and is small enough to keep the in-flight budget fine.
pub const BLOCK_SIZE: u64 = 1 << 20;

/// Number of blocks in a file of `size` bytes.
pub fn block_count(size: u64) -> u64 {
    size.div_ceil(BLOCK_SIZE)
}

/// Length of block `idx` of a file of `size` bytes.
pub fn block_len(size: u64, idx: u64) -> u64 {
    let start = idx * BLOCK_SIZE;
    size.saturating_sub(start).min(BLOCK_SIZE)
}
