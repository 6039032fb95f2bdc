//! Sources: which bytes of which file become rows, and how they are read.
//!
//! A [`Source`] is a `.npy` file (its header parsed with `stagefs_npy`), optionally cut
//! to a row range, or a raw byte range with a row size. Reads go through [`ReadAt`] so a file, a
//! cache or a test's deliberately slow reader all plug in; files are read with positioned reads
//! (`pread`), which need no shared file offset and so serve several reader threads at once.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use stagefs_npy::{DType, NpyHeader, MAX_HEADER_LEN};

use crate::error::StreamError;

/// Positioned reads from something with a length (a file, a cache, a test double).
pub trait ReadAt: Send + Sync {
    /// Reads up to `buf.len()` bytes at `offset`; returns how many were read (0 at end of data).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Current length in bytes.
    fn size(&self) -> io::Result<u64>;
}

impl ReadAt for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        FileExt::read_at(self, buf, offset)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
}

/// Rows to stream: a byte range of a file cut into rows of equal size.
#[derive(Clone)]
pub struct Source {
    /// The file, for messages and reports.
    pub path: PathBuf,
    /// Element type, when known from a `.npy` header.
    pub dtype: Option<DType>,
    /// Shape of one row (the array's shape without its first axis).
    pub row_shape: Vec<u64>,
    /// Bytes per row.
    pub row_bytes: u64,
    /// File offset of the first streamed row.
    pub offset: u64,
    /// Number of streamed rows.
    pub rows: u64,
    /// Where the bytes come from.
    pub reader: Arc<dyn ReadAt>,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source")
            .field("path", &self.path)
            .field("dtype", &self.dtype)
            .field("row_shape", &self.row_shape)
            .field("offset", &self.offset)
            .field("rows", &self.rows)
            .finish()
    }
}

impl Source {
    /// All rows of the `.npy` file at `path`.
    pub fn npy(path: impl AsRef<Path>) -> Result<Source, StreamError> {
        let path = path.as_ref().to_path_buf();
        let file = open_regular(&path)?;
        Source::npy_from_reader(path, Arc::new(file))
    }

    /// All rows of a `.npy` file read through `reader`; `path` names it in messages.
    pub fn npy_from_reader(path: PathBuf, reader: Arc<dyn ReadAt>) -> Result<Source, StreamError> {
        let io_err = |source| StreamError::Io {
            path: path.clone(),
            source,
        };
        let len = reader.size().map_err(io_err)?;
        // At most the longest header numpy writes (a length from the file, so bounded first).
        let mut head = vec![0u8; len.min(MAX_HEADER_LEN as u64 + 2) as usize];
        read_full(reader.as_ref(), &mut head, 0).map_err(io_err)?;
        let (header, data_start) =
            NpyHeader::parse(&head).map_err(|source| StreamError::Header {
                path: path.clone(),
                source,
            })?;
        let Some((&rows, row_shape)) = header.shape.split_first() else {
            return Err(StreamError::Scalar { path });
        };
        // Rows of no bytes fit any file: a 128-byte file of shape (10^12, 0) passed every
        // length check and its epoch order (8 bytes a row) aborted the interpreter.
        if row_shape.contains(&0) && rows > 0 {
            return Err(StreamError::Config(format!(
                "{}: its rows have no elements (shape {:?}): nothing to load",
                path.display(),
                header.shape
            )));
        }
        // `parse` refuses shapes whose byte count overflows; checked again here so a header that
        // slipped through could never make a size wrap to 0.
        let row_bytes = header
            .checked_row_bytes()
            .filter(|_| header.checked_data_len().is_some())
            .ok_or_else(|| StreamError::Header {
                path: path.clone(),
                source: stagefs_npy::NpyError::TooLarge(header.shape.clone()),
            })?;
        let source = Source {
            dtype: Some(header.dtype),
            row_shape: row_shape.to_vec(),
            row_bytes,
            offset: data_start as u64,
            rows,
            reader,
            path,
        };
        source.check_length()?;
        Ok(source)
    }

    /// `rows` bytes-rows of `row_bytes` each starting at byte `offset` of any file (no header).
    pub fn raw(
        path: impl AsRef<Path>,
        offset: u64,
        row_bytes: u64,
        rows: u64,
    ) -> Result<Source, StreamError> {
        let path = path.as_ref().to_path_buf();
        let file = open_regular(&path)?;
        if row_bytes == 0 {
            return Err(StreamError::Config(format!(
                "{}: a row must have at least one byte",
                path.display()
            )));
        }
        let source = Source {
            path,
            dtype: None,
            row_shape: vec![row_bytes],
            row_bytes,
            offset,
            rows,
            reader: Arc::new(file),
        };
        source.check_length()?;
        Ok(source)
    }

    /// The same source cut to `rows` (relative to the rows it has now).
    pub fn rows(mut self, rows: Range<u64>) -> Result<Source, StreamError> {
        if rows.start > rows.end || rows.end > self.rows {
            return Err(StreamError::RowRange {
                path: self.path,
                start: rows.start,
                end: rows.end,
                rows: self.rows,
            });
        }
        // Cannot overflow: the whole range was checked to fit in the file by `check_length`.
        self.offset += rows.start * self.row_bytes;
        self.rows = rows.end - rows.start;
        Ok(self)
    }

    /// Bytes of data this source streams (checked to fit in the file when it was opened).
    pub fn data_bytes(&self) -> u64 {
        self.rows.saturating_mul(self.row_bytes)
    }

    /// Reads rows `first..first + buf.len() / row_bytes` into `buf` with one positioned read
    /// (rows relative to the source's first row; the caller keeps them inside the source).
    pub fn read_rows(&self, buf: &mut [u8], first: u64) -> Result<(), StreamError> {
        // Cannot overflow: `first` is a row of the source, checked to fit in the file.
        let offset = self.offset + first * self.row_bytes;
        read_full(self.reader.as_ref(), buf, offset).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => StreamError::Truncated {
                path: self.path.clone(),
                need: self.data_bytes(),
                end: self.offset.saturating_add(self.data_bytes()),
                have: self.reader.size().unwrap_or(0),
            },
            _ => StreamError::Io {
                path: self.path.clone(),
                source: e,
            },
        })
    }

    /// Checks that the rows fit in the file, with every size checked for overflow: after
    /// this, any `offset + row * row_bytes` for a row of the source fits in `u64`.
    fn check_length(&self) -> Result<(), StreamError> {
        let have = self.reader.size().map_err(|source| StreamError::Io {
            path: self.path.clone(),
            source,
        })?;
        let need = self.rows.checked_mul(self.row_bytes);
        let Some((need, end)) = need.and_then(|n| Some((n, self.offset.checked_add(n)?))) else {
            return Err(StreamError::TooLarge {
                path: self.path.clone(),
                rows: self.rows,
                row_bytes: self.row_bytes,
            });
        };
        if have < end {
            return Err(StreamError::Truncated {
                path: self.path.clone(),
                need,
                end,
                have,
            });
        }
        Ok(())
    }
}

/// Fills `buf` from `offset`; fails with `UnexpectedEof` if the data ends first.
pub(crate) fn read_full(reader: &dyn ReadAt, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match reader.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "file ended at byte {} while reading {} bytes at {}",
                        offset + done as u64,
                        buf.len(),
                        offset
                    ),
                ))
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Opens `path` for reading if it is a regular file: opened non-blocking, so a FIFO (which
/// blocked `open` until a writer came, with SIGINT unable to interrupt it) or a device is
/// refused instead of waited on.
fn open_regular(path: &Path) -> Result<File, StreamError> {
    use std::os::unix::fs::OpenOptionsExt;
    let io_err = |source| StreamError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io_err)?;
    let kind = file.metadata().map_err(io_err)?.file_type();
    if !kind.is_file() {
        return Err(StreamError::Config(format!(
            "{}: not a regular file ({}): give a .npy or raw file",
            path.display(),
            if kind.is_dir() {
                "a directory"
            } else if std::os::unix::fs::FileTypeExt::is_fifo(&kind) {
                "a FIFO"
            } else {
                "a device or socket"
            }
        )));
    }
    // O_NONBLOCK is left set: Linux ignores it for reads of a regular file (they wait for the
    // disk as ever), and only regular files get here.
    Ok(file)
}
