//! Crash-safe synchronisation of job outputs from node-local scratch to persistent storage, and
//! the job-lifecycle helpers `stagefs run` is built from.
//!
//! A pass has two phases. [`plan::build`] walks SRC and DST and decides what to copy, what is
//! unchanged (same size and mtime, optionally same bytes), what to delete and which temporaries
//! earlier crashed runs left behind. [`pass::Syncer::execute`] then copies in parallel: every file
//! is written under a temporary name in its destination directory, fsynced, renamed over the old
//! version and, before the pass reports success, its directory is fsynced. Because `rename(2)` is
//! atomic, a crash at any moment leaves each destination path holding its complete old or
//! complete new content; a re-run removes the temporaries and finishes the work.
//!
//! A file that changes while it is copied (a checkpoint still being written) is detected
//! ([`copy`]) and retried instead of being installed torn.
//!
//! What it trusts: only the two root paths the user gave (symlinks in them are followed once,
//! when planning opens them). SRC's tree is read through descriptors without following any
//! symlink inside it ([`beneath`]), and a file is copied only if the opened descriptor is the
//! planned file (or a new version of it by the same owner), so nothing outside SRC is ever
//! copied. DST may be writable by others (a group-writable lab directory): it is reached only
//! through directory descriptors beneath the root opened at planning, with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` (or one `O_NOFOLLOW` component at a time
//! where `openat2` is missing); temporaries are created `O_EXCL | O_NOFOLLOW` in such a
//! descriptor, renamed with `renameat` within it, directories made with `mkdirat` and removed
//! with `unlinkat` ([`dst`]). So nothing is ever written, renamed, re-moded or deleted outside
//! the DST tree that existed at planning, whatever is swapped in and whenever: a symlink
//! swapped in fails that path (named in the report; the next pass retries) instead of leading
//! out. Only files named exactly as stagefs names its temporaries are ever removed without
//! `--delete`, and only once their writer is gone, on whichever node it ran ([`temp`]).

pub mod beneath;
pub mod copy;
pub mod dst;
pub mod error;
pub mod pass;
pub mod plan;
pub mod signals;
pub mod stamp;
pub mod supervise;
pub mod temp;

pub use error::{FileError, SyncError};
pub use pass::{Report, SyncOptions, Syncer};
pub use plan::Plan;
