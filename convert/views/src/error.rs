//! The one error type of the views: what the mount maps to an errno and `convert` reports.
//!
//! Every failure says which source file is at fault, so the mount's log line and `convert`'s list
//! of bad inputs point at the file a person has to fix.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// Why a view path could not be listed, opened or read.
#[derive(Debug, Error)]
pub enum ViewError {
    /// No view at this path (the mount answers ENOENT).
    #[error("no such view: {0}")]
    NotFound(PathBuf),
    /// The source file is corrupt or truncated (the mount answers EIO).
    #[error("corrupt input {path}: {reason}")]
    Corrupt {
        /// Source path (relative to the dataset root) of the bad file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading the source failed (the mount passes the I/O error's errno on).
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    /// The source is valid but uses a feature the views do not handle (the mount answers EIO).
    #[error("unsupported input {path}: {reason}")]
    Unsupported {
        /// Source path (relative to the dataset root).
        path: PathBuf,
        /// What is not supported.
        reason: String,
    },
}

impl ViewError {
    /// A [`ViewError::Corrupt`] for `path`.
    pub fn corrupt(path: impl Into<PathBuf>, reason: impl ToString) -> Self {
        ViewError::Corrupt {
            path: path.into(),
            reason: reason.to_string(),
        }
    }

    /// The errno the mount should answer with (one place for the mapping, no catch-all).
    pub fn errno(&self) -> i32 {
        match self {
            ViewError::NotFound(_) => libc_enoent(),
            ViewError::Corrupt { .. } | ViewError::Unsupported { .. } => libc_eio(),
            ViewError::Io(e) => e.raw_os_error().unwrap_or_else(libc_eio),
        }
    }
}

/// ENOENT on Linux (kept here so the crate needs no libc dependency).
const fn libc_enoent() -> i32 {
    2
}

/// EIO on Linux.
const fn libc_eio() -> i32 {
    5
}
