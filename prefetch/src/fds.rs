//! How many descriptors the cache keeps open for reuse: source files and directories
//! ([`crate::source`]), its own copies and their direct-read twins ([`crate::store`]).
//!
//! Their full sizes add up to [`FULL`] (1,088), more than the soft limit of 1,024 descriptors a
//! normal user often has: opens then fail with `EMFILE` once enough files were read (every
//! cached file is a copy of its own, so reading small files fills the copies' caches too). So
//! the caches get at most an eighth of the soft limit between them, shared in proportion to
//! their full sizes: the rest is for the FUSE channel, readers' handles, sockets, the trust
//! pass, and other mounts or tests in the same process. The daemon raises its soft limit to
//! the hard one at start ([`raise_limit`]), so wherever the hard limit allows, the caches are
//! full-size.

use std::num::NonZeroUsize;

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// Open source files kept for reuse: enough for many DataLoader workers' files at once.
pub const SOURCE_FILES: usize = 512;
/// Open source directories kept for `stat` and `read_dir` relative to them: a listing of a
/// whole tree touches each directory a few times in a row, then never again.
pub const SOURCE_DIRS: usize = 64;
/// Own data files kept open (and as many direct-read descriptors of them): enough for the
/// large files being read and staged at once.
pub const DATA_FILES: usize = 256;
/// The caches' full sizes together.
pub const FULL: usize = SOURCE_FILES + SOURCE_DIRS + 2 * DATA_FILES;
/// Smallest size of each cache, whatever the limit.
const AT_LEAST: usize = 4;
/// Highest soft limit the daemon asks for: enough for any cache here many times over.
pub const RAISE_TO: u64 = 1 << 20;

/// The size a cache whose full size is `full` gets under a soft limit of `soft` descriptors.
pub fn share_of(full: usize, soft: u64) -> NonZeroUsize {
    let budget = usize::try_from(soft / 8).unwrap_or(usize::MAX);
    let n = if budget >= FULL {
        full
    } else {
        (full * budget / FULL).max(AT_LEAST)
    };
    NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN)
}

/// The size a cache whose full size is `full` gets under this process's limit now.
pub fn share(full: usize) -> NonZeroUsize {
    share_of(full, soft_limit())
}

/// The process's soft descriptor limit (unlimited reads as [`u64::MAX`]).
pub fn soft_limit() -> u64 {
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// Raises the soft descriptor limit to the hard one (at most [`RAISE_TO`]); the soft limit
/// after.
pub fn raise_limit() -> u64 {
    let now = getrlimit(Resource::Nofile);
    let want = now.maximum.unwrap_or(RAISE_TO).min(RAISE_TO);
    if now.current.is_some_and(|c| c < want) {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(want),
                maximum: now.maximum,
            },
        );
    }
    soft_limit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_caches_fit_an_eighth_of_a_small_limit_and_are_full_under_a_large_one() {
        let all = |soft| {
            [SOURCE_FILES, SOURCE_DIRS, DATA_FILES, DATA_FILES]
                .iter()
                .map(|&f| share_of(f, soft).get())
                .sum::<usize>()
        };
        assert!(all(1024) <= 1024 / 8, "{}", all(1024));
        assert!(all(256) <= 4 * AT_LEAST + 256 / 8, "{}", all(256));
        assert_eq!(all(20_000), FULL);
        assert_eq!(share_of(SOURCE_FILES, u64::MAX).get(), SOURCE_FILES);
        assert_eq!(share_of(SOURCE_DIRS, 0).get(), AT_LEAST);
    }
}
