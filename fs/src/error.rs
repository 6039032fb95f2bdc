//! Every error the filesystem core can return, and the one place where each becomes an errno.

use std::io;

use stagefs_prefetch::SourceError;
use stagefs_views::ViewError;
use thiserror::Error;

/// An error answered to a filesystem request.
#[derive(Debug, Error)]
pub enum FsError {
    /// No such file or directory (in the source or the virtual trees).
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
    /// The file changed or vanished on the source since it was opened; serving it would mix
    /// versions.
    #[error("{0}")]
    Stale(SourceError),
    /// A view's input is corrupt or unsupported (logged with the reason).
    #[error("corrupt input: {0}")]
    Corrupt(String),
    /// An I/O error from the source or the cache.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// A source read failed.
    #[error("{0}")]
    Source(SourceError),
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
            FsError::Stale(_) => libc::ESTALE,
            FsError::Corrupt(_) => libc::EIO,
            FsError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            FsError::Source(SourceError::Io { source, .. }) => {
                source.raw_os_error().unwrap_or(libc::EIO)
            }
            FsError::Source(SourceError::Changed { .. } | SourceError::Gone { .. }) => libc::ESTALE,
            FsError::Source(SourceError::Outside { .. }) => libc::EACCES,
            FsError::View(ViewError::NotFound(_)) => libc::ENOENT,
            FsError::View(ViewError::Corrupt { .. } | ViewError::Unsupported { .. }) => libc::EIO,
            FsError::View(ViewError::Io(e)) => e.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}
