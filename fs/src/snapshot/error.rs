//! Why a snapshot could not be taken, loaded, saved or asked.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use stagefs_prefetch::SourceError;
use thiserror::Error;

use super::NodeId;

/// A failure of the metadata snapshot.
#[derive(Debug, Error)]
pub enum SnapshotError {
    /// A source operation failed (revalidation, or a directory listed on demand).
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The source root itself could not be read.
    #[error("cannot read the source {path}: {source}")]
    Root {
        /// The source root.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: SourceError,
    },
    /// Reading or writing a snapshot file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A snapshot file is damaged or was not written by stagefs (checked before use).
    #[error("{path} is not a usable stagefs index: {reason}; write it again with `stagefs index`")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A file that is not a stagefs index at all, or one of another format version.
    #[error("{path}: {reason}")]
    WrongFormat {
        /// The file.
        path: PathBuf,
        /// What it is instead.
        reason: String,
    },
    /// A directory's listing did not arrive within the wait timeout.
    #[error("listing {path:?} on the source took longer than {waited:?}")]
    TimedOut {
        /// The directory, relative to the source root.
        path: PathBuf,
        /// How long the caller waited.
        waited: Duration,
    },
    /// A directory was expected.
    #[error("{path:?} is not a directory")]
    NotDir {
        /// The path, relative to the source root (or the source root itself).
        path: PathBuf,
    },
    /// The directory could not be listed when the snapshot was taken (it serves no entries).
    #[error("directory {path:?} could not be listed on the source: {}", io::Error::from_raw_os_error(*errno))]
    Unlisted {
        /// The directory, relative to the source root.
        path: PathBuf,
        /// The errno of the failure.
        errno: i32,
    },
    /// The tree exceeds what a snapshot can index (4 G entries, 4 GiB of names).
    #[error("the source has too many {what} for one snapshot")]
    TooLarge {
        /// What overflowed.
        what: &'static str,
    },
    /// The id names no node.
    #[error("node {0} is not in the snapshot")]
    NoNode(NodeId),
    /// The snapshot was loaded from a file and no source was attached, but the operation
    /// needs one (revalidation, a directory that was not listed when the file was written).
    #[error("the snapshot has no source attached to re-read metadata from")]
    NoSource,
    /// The listing threads stopped before the listing was complete (a bug; see the log).
    #[error("the listing threads stopped before the source was listed")]
    ScanStopped,
}
