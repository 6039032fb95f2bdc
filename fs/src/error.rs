//! Every error the filesystem core can return, and the one place where each becomes an errno.

use std::io;
use std::path::PathBuf;

use stagefs_prefetch::{CacheError, SourceError};
use stagefs_views::ViewError;
use thiserror::Error;

use crate::snapshot::SnapshotError;

/// An error answered to a filesystem request (or met while mounting).
#[derive(Debug, Error)]
pub enum FsError {
    /// No such file or directory (in the snapshot or the virtual trees).
    #[error("no such file or directory")]
    NotFound,
    /// The inode or handle is unknown (the kernel asked about something never looked up).
    #[error("unknown inode or handle")]
    BadHandle,
    /// Not a directory.
    #[error("not a directory")]
    NotDir,
    /// Is a directory.
    #[error("is a directory")]
    IsDir,
    /// The mount is read-only.
    #[error("read-only filesystem")]
    ReadOnly,
    /// Not a symbolic link.
    #[error("not a symbolic link")]
    NotSymlink,
    /// A request handler panicked (a bug; logged); the request fails, the mount stays.
    #[error("internal error")]
    Internal,
    /// The file changed or vanished on the source since the snapshot; serving it would mix
    /// versions.
    #[error("{0}")]
    Stale(SourceError),
    /// A source read failed.
    #[error("{0}")]
    Source(SourceError),
    /// The metadata snapshot could not be taken, loaded or asked.
    #[error("{0}")]
    Snapshot(#[from] SnapshotError),
    /// `--index` names a snapshot of another directory.
    #[error("{} is an index of {}, not of {}: give the index of this source (stagefs index {})", index.display(), of.display(), mounted.display(), mounted.display())]
    IndexMismatch {
        /// The index file.
        index: PathBuf,
        /// The source it was taken of.
        of: PathBuf,
        /// The source being mounted.
        mounted: PathBuf,
    },
    /// The cache directory could not be opened (privacy checks, I/O).
    #[error("{0}")]
    Cache(#[from] CacheError),
    /// An I/O error of the daemon itself (threads, the cache directory).
    #[error("{0}")]
    Io(#[from] io::Error),
    /// A tensor view could not be listed, opened or rendered.
    #[error("{0}")]
    View(#[from] ViewError),
}

impl From<SourceError> for FsError {
    fn from(e: SourceError) -> FsError {
        match e {
            SourceError::Changed { .. } | SourceError::Gone { .. } => FsError::Stale(e),
            SourceError::Io { .. } | SourceError::Outside { .. } => FsError::Source(e),
        }
    }
}

fn snapshot_errno(e: &SnapshotError) -> i32 {
    match e {
        // A directory that disappeared since the snapshot has nothing to list; other source
        // errors keep their errno (EACCES of an unreadable directory, EIO of a failing disk).
        SnapshotError::Source(SourceError::Gone { .. }) => libc::ENOENT,
        SnapshotError::Source(s) | SnapshotError::Root { source: s, .. } => s.errno(),
        SnapshotError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        SnapshotError::Corrupt { .. } | SnapshotError::WrongFormat { .. } => libc::EIO,
        SnapshotError::TimedOut { .. } => libc::ETIMEDOUT,
        SnapshotError::NotDir { .. } => libc::ENOTDIR,
        SnapshotError::Unlisted { errno, .. } if *errno > 0 => *errno,
        SnapshotError::Unlisted { .. } => libc::EIO,
        SnapshotError::TooLarge { .. } => libc::EOVERFLOW,
        SnapshotError::NoNode(_) => libc::ENOENT,
        SnapshotError::NoSource | SnapshotError::ScanStopped => libc::EIO,
    }
}

impl FsError {
    /// The errno answered to the kernel.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::BadHandle => libc::EBADF,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::ReadOnly => libc::EROFS,
            FsError::NotSymlink => libc::EINVAL,
            FsError::Internal => libc::EIO,
            FsError::Stale(e) | FsError::Source(e) => e.errno(),
            FsError::Snapshot(e) => snapshot_errno(e),
            FsError::IndexMismatch { .. } => libc::EINVAL,
            FsError::Cache(CacheError::Unsafe { .. }) => libc::EACCES,
            FsError::Cache(CacheError::InUse { .. }) => libc::EBUSY,
            FsError::Cache(CacheError::Dir { source, .. }) => {
                source.raw_os_error().unwrap_or(libc::EIO)
            }
            FsError::Cache(CacheError::Write(e)) | FsError::Io(e) => {
                e.raw_os_error().unwrap_or(libc::EIO)
            }
            FsError::View(ViewError::NotFound(_)) => libc::ENOENT,
            FsError::View(ViewError::Corrupt { .. } | ViewError::Unsupported { .. }) => libc::EIO,
            FsError::View(ViewError::Io(e)) => e.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}
