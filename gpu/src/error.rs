//! The errors of the streamer: one enum for device failures, one for the pipeline.
//!
//! Device errors carry the backend's own words (a CUDA error name, "libcuda not found") so the
//! user sees what failed; pipeline errors always name the file and what to do about it.

use std::path::PathBuf;

use stagefs_npy::NpyError;
use thiserror::Error;

/// A failure of the device backend (allocation, copy, event, driver loading).
#[derive(Debug, Error)]
pub enum DeviceError {
    /// The CUDA driver library could not be loaded (no NVIDIA driver on this machine).
    #[error("the CUDA driver (libcuda.so) could not be loaded: {0}; install the NVIDIA driver or use --device cpu")]
    DriverMissing(String),
    /// A CUDA driver call failed.
    #[error("CUDA call {call} failed: {error}")]
    Cuda {
        /// The operation that failed.
        call: &'static str,
        /// The driver's error code, as text.
        error: String,
    },
    /// A buffer of this size cannot be allocated.
    #[error("cannot allocate {bytes} bytes of {kind} memory: {reason}")]
    Alloc {
        /// `pinned host` or `device`.
        kind: &'static str,
        /// Requested size.
        bytes: usize,
        /// Why it failed.
        reason: String,
    },
    /// The CPU device keeps batches in host memory; there is no device memory to copy back.
    #[error("the CPU device has no device memory: read the batch's host buffer")]
    NoDeviceMemory,
    /// The host-memory device's stream thread is gone (it panicked or was shut down).
    #[error("the host-memory device's stream worker stopped")]
    StreamGone,
}

/// A failure of the streaming pipeline.
#[derive(Debug, Error)]
pub enum StreamError {
    /// A file could not be opened, sized or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A file's `.npy` header could not be parsed.
    #[error("{path}: {source}")]
    Header {
        /// The file.
        path: PathBuf,
        /// What is wrong with the header.
        #[source]
        source: NpyError,
    },
    /// The file is shorter than its header (or the requested range) says.
    #[error("{path}: truncated: the data needs {need} bytes up to offset {end} but the file has {have}; re-create the file (was a copy or conversion interrupted?)")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes of data expected.
        need: u64,
        /// File offset where the data should end.
        end: u64,
        /// The file's actual size.
        have: u64,
    },
    /// Rows × row size overflow 64 bits (a hostile or corrupt header or arguments).
    #[error("{path}: {rows} rows of {row_bytes} bytes do not fit in 64 bits; the file's header is corrupt")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Rows claimed.
        rows: u64,
        /// Bytes per row claimed.
        row_bytes: u64,
    },
    /// A row range outside the array.
    #[error("{path}: rows {start}..{end} are outside the array's {rows} rows")]
    RowRange {
        /// The file.
        path: PathBuf,
        /// First requested row.
        start: u64,
        /// One past the last requested row.
        end: u64,
        /// Rows in the array.
        rows: u64,
    },
    /// A 0-d array, which has no rows to batch.
    #[error("{path}: a 0-dimensional array has no rows to stream")]
    Scalar {
        /// The file.
        path: PathBuf,
    },
    /// A setting that cannot work (zero batch rows, a ring too small, batches too large).
    #[error("invalid streamer setting: {0}")]
    Config(String),
    /// The device backend failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The consumer holds all ring buffers and asked for one more batch.
    #[error("the consumer holds all {ring} ring buffers; drop a batch before asking for the next (or use a larger ring)")]
    RingHeld {
        /// Ring size K.
        ring: usize,
    },
    /// A reader thread died without reporting an error (a bug).
    #[error("a reader thread stopped unexpectedly")]
    ReaderGone,
}
