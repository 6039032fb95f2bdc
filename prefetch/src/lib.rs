//! The scratch cache and the machinery that fills it.
//!
//! - [`cachedir`]: the private cache directory (0700/0600, owner-checked, no symlinks followed).
//! - [`store`]: **the cache** on scratch: entries under typed keys, checksummed blocks returned
//!   as `Bytes`, capacity and least-recently-used eviction; large files as exact copies (for
//!   passthrough), small ones packed in segment files; everything recorded in one append-only
//!   [cache log](store::cache_log). Its module docs say which file does what.
//! - [`fetch`]: the fetch scheduler: demand reads on the caller's thread, read-ahead and staging
//!   on a worker pool with many requests in flight, in-flight de-duplication.
//! - [`readahead`]: per-handle sequential detection with a growing window.
//! - [`staging`]: the background staging order (small files first, directory order).
//! - [`source`]: where metadata and bytes come from, with change detection on every read.
//! - [`stats`]: counters behind `.stagefs/stats`.
//! - [`hash`]: a hash stable across builds, for names of persistent things.

pub mod cachedir;
pub mod error;
pub mod fds;
pub mod fetch;
pub mod hash;
pub mod locks;
pub mod readahead;
pub mod source;
pub mod staging;
pub mod stats;
pub mod store;

pub use error::{CacheError, SourceError};
pub use fetch::{FetchConfig, Fetched, Fetcher, Priority, Want};
pub use source::{FileKind, LocalSource, Meta, Source, Version};
pub use stats::{Stats, StatsSnapshot};
pub use store::cache_log::record::{EntryId, KeyKind};
pub use store::{CacheStore, Loaded, LoadedEntry, StoreConfig};

/// Size of a cache block: 1 MiB matches the largest FUSE read request (256 pages) and the stripe
/// size of common parallel filesystems, and is small enough to keep the in-flight budget fine.
pub const BLOCK_SIZE: u64 = 1 << 20;

/// Files up to this size are *small*: staged in the first pass, cached and evicted whole, and
/// handed to direct readers through the mount's direct table rather than as pinned descriptors.
/// Here, not in `staging`, so the store (which evicts them whole) does not import the stager.
pub const SMALL_FILE: u64 = 4 * BLOCK_SIZE;

/// Number of blocks in a file of `size` bytes.
pub fn block_count(size: u64) -> u64 {
    size.div_ceil(BLOCK_SIZE)
}

/// Length of block `idx` of a file of `size` bytes.
pub fn block_len(size: u64, idx: u64) -> u64 {
    let start = idx.saturating_mul(BLOCK_SIZE);
    size.saturating_sub(start).min(BLOCK_SIZE)
}
