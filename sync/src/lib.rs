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
//! What it trusts: SRC's tree is read through descriptors without following any symlink
//! inside it ([`beneath`]), and a file is copied only if the opened descriptor is the planned
//! file (or a new version of it by the same owner), so nothing outside SRC is ever copied.
//! DST must be writable only by the user (as any output directory): its own paths are used
//! as they are. Only files named exactly as stagefs names its temporaries are ever removed
//! without `--delete`, and only once their writer is gone, on whichever node it ran
//! ([`temp`]).

pub mod beneath;
pub mod copy;
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
