//! Errors of the cache and of the source it reads from.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// A failure reading from the source (the slow shared filesystem).
#[derive(Debug, Error)]
pub enum SourceError {
    /// The file's size or mtime is no longer what the caller saw: it changed or was replaced.
    #[error("{path} changed on the source while being read")]
    Changed {
        /// Path relative to the source root.
        path: PathBuf,
    },
    /// The file vanished from the source.
    #[error("{path} no longer exists on the source")]
    Gone {
        /// Path relative to the source root.
        path: PathBuf,
    },
    /// The path leaves the source tree (`..`, an absolute path, a symlink in a component).
    #[error("{path} is not a path inside the source")]
    Outside {
        /// The offending path.
        path: PathBuf,
    },
    /// Any other I/O error from the source.
    #[error("reading {path} from the source: {source}")]
    Io {
        /// Path relative to the source root.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

impl SourceError {
    /// The errno this error stands for: `ESTALE` for a file that changed or vanished (serving
    /// it would mix versions), `EACCES` for a path outside the source, the OS error of an I/O
    /// failure (`EIO` when it has none). The filesystem's errno map answers source errors with
    /// it, and a directory that failed to list records it.
    pub fn errno(&self) -> i32 {
        match self {
            SourceError::Changed { .. } | SourceError::Gone { .. } => libc::ESTALE,
            SourceError::Outside { .. } => libc::EACCES,
            SourceError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

/// A failure of the scratch cache itself. Callers treat these as misses and read the source:
/// a broken cache must never fail a read that the source can serve.
#[derive(Debug, Error)]
pub enum CacheError {
    /// The cache directory could not be created or written.
    #[error("cache directory {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The cache directory exists but may not hold a private cache (symlink, other owner,
    /// writable by others).
    #[error("cache directory {path} {reason}; use a directory you own, e.g. under $SLURM_TMPDIR, or remove it and let stagefs create it (mode 0700)")]
    Unsafe {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Another live process holds the cache directory's lock (another mount of it).
    #[error("cache directory {path} is in use by another mount{}: two mounts sharing one cache would overwrite each other's blocks; give this mount its own --cache, or unmount the other first", pid.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    InUse {
        /// The directory.
        path: PathBuf,
        /// The holder's pid, as it recorded it.
        pid: Option<u32>,
    },
    /// Writing a block or header failed (e.g. scratch full).
    #[error("writing the cache: {0}")]
    Write(#[source] io::Error),
}
