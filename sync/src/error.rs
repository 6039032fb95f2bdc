//! Error types: [`SyncError`] stops a whole pass, [`FileError`] fails one path and is collected
//! in the pass's report so that every failure can be named at the end.

use std::path::PathBuf;

/// An error that prevents a pass from running at all.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// SRC does not exist or is not a directory.
    #[error("source {path} is not a directory (give the directory whose contents to copy)")]
    SourceNotDir {
        /// The source path given.
        path: PathBuf,
    },
    /// DST lies inside SRC, which would copy the copy forever.
    #[error("destination {dst} lies inside source {src}; choose a destination outside it")]
    DestInsideSource {
        /// The source root.
        src: PathBuf,
        /// The destination root.
        dst: PathBuf,
    },
    /// SRC lies inside DST and `--delete` was given: SRC itself is not in SRC's listing, so it
    /// (and everything else in DST) would be deleted.
    #[error(
        "source {src} lies inside destination {dst}: with --delete that would delete the source \
         itself and everything else in the destination; choose a destination that does not \
         contain the source (or drop --delete)"
    )]
    SourceInsideDest {
        /// The source root.
        src: PathBuf,
        /// The destination root.
        dst: PathBuf,
    },
    /// An I/O error on a root or while walking a tree. (The cause is the error's source, not
    /// part of its text: the CLI prints the chain, which otherwise named it twice.)
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The worker thread pool could not be created.
    #[error("cannot start {jobs} copy threads: {message}")]
    ThreadPool {
        /// Number of threads asked for.
        jobs: usize,
        /// Rayon's description of the problem.
        message: String,
    },
}

/// Why one path could not be synchronised.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// An I/O operation failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done ("open source", "rename into place", ...).
        op: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A symlink (or a non-directory) is on a destination path: swapped in after planning.
    /// Nothing was followed, and nothing was done there.
    #[error(
        "{op}: a symlink or non-directory is now on its path in DST (swapped in after \
         planning?): {source}; not followed, nothing done there"
    )]
    NotFollowed {
        /// What was being done.
        op: &'static str,
        /// The error of the open that refused it (`ELOOP`, `ENOTDIR`).
        #[source]
        source: std::io::Error,
    },
    /// The source kept changing during every copy attempt.
    #[error(
        "changed while being copied in all {attempts} attempts (still being written?); \
         the old destination version is kept, the next pass retries"
    )]
    KeptChanging {
        /// How many attempts were made.
        attempts: u32,
    },
}

impl FileError {
    /// Wraps an I/O error with the operation that failed.
    pub fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> FileError {
        move |source| FileError::Io { op, source }
    }

    /// Like [`FileError::io`] for an operation in DST: a refused symlink or non-directory on
    /// the way becomes [`FileError::NotFollowed`], which says why.
    pub fn dst(op: &'static str) -> impl FnOnce(std::io::Error) -> FileError {
        move |source| {
            if crate::beneath::is_not_followed(&source) {
                FileError::NotFollowed { op, source }
            } else {
                FileError::Io { op, source }
            }
        }
    }
}
