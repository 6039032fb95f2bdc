//! Where the views get their input bytes.
//!
//! Decoders never open files themselves: they ask a [`ByteSource`] for byte ranges of paths
//! relative to the dataset root. The mount passes its scratch-cache-backed source (so a decode
//! warms the cache and never bypasses it), `stagefs convert` passes a [`DirSource`] over plain
//! files. Paths given to a source are always relative and never contain `..`.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Seek};
use std::path::{Component, Path, PathBuf};
use std::time::SystemTime;

/// What a directory entry of the source is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// Anything else (symlink, device, socket): never viewed, never followed.
    Other,
}

/// One entry of [`ByteSource::list_dir`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceEntry {
    /// File name (no directory part).
    pub name: OsString,
    /// What it is.
    pub kind: EntryKind,
}

/// Random-access reads of the dataset's files, by path relative to the dataset root.
pub trait ByteSource: Send + Sync {
    /// Size in bytes of the file at `rel`.
    fn len(&self, rel: &Path) -> io::Result<u64>;
    /// Reads up to `buf.len()` bytes at `offset`; returns fewer only at end of file.
    fn read_at(&self, rel: &Path, offset: u64, buf: &mut [u8]) -> io::Result<usize>;
    /// The entries of the directory at `rel` (`""` is the root), in any order.
    fn list_dir(&self, rel: &Path) -> io::Result<Vec<SourceEntry>>;
    /// Appends up to `len` bytes read at `offset` to `buf` (fewer only at end of file) and
    /// returns the count. For large reads (a Parquet column chunk): the default zeroes the new
    /// space and calls [`ByteSource::read_at`]; sources override it to read into the spare
    /// capacity directly, since zeroing megabytes about to be overwritten is a measurable cost.
    fn read_at_append(
        &self,
        rel: &Path,
        offset: u64,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> io::Result<usize> {
        let start = buf.len();
        reserve(buf, len)?;
        buf.resize(start + len, 0);
        match self.read_at(rel, offset, &mut buf[start..]) {
            Ok(n) => {
                buf.truncate(start + n);
                Ok(n)
            }
            Err(e) => {
                buf.truncate(start);
                Err(e)
            }
        }
    }
    /// (size, mtime) of `rel`, for cache keys; the default has no mtime.
    fn signature(&self, rel: &Path) -> io::Result<(u64, Option<SystemTime>)> {
        Ok((self.len(rel)?, None))
    }
}

/// Room for `len` more bytes in `buf`, or an out-of-memory error (never an abort): for
/// [`ByteSource::read_at_append`], whose lengths come from files.
pub fn reserve(buf: &mut Vec<u8>, len: usize) -> io::Result<()> {
    buf.try_reserve_exact(len).map_err(|_| {
        io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!("cannot allocate {len} bytes"),
        )
    })
}

/// Reads the whole file at `rel`, refusing files larger than `limit` bytes.
pub fn read_all(src: &dyn ByteSource, rel: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    read_all_into(src, rel, limit, &mut buf)?;
    Ok(buf)
}

/// [`read_all`] into `buf` (cleared first), reusing its allocation.
pub fn read_all_into(
    src: &dyn ByteSource,
    rel: &Path,
    limit: u64,
    buf: &mut Vec<u8>,
) -> io::Result<()> {
    let len = src.len(rel)?;
    if len > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is {len} bytes, more than the {limit} bytes allowed",
                rel.display()
            ),
        ));
    }
    // Reused buffers are not zeroed again: every byte kept is read from the file below.
    let len = len as usize;
    if len > buf.len() {
        buf.try_reserve(len - buf.len()).map_err(|_| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                "cannot allocate the file buffer",
            )
        })?;
        buf.resize(len, 0);
    }
    buf.truncate(len);
    let mut done = 0;
    while done < buf.len() {
        let n = src.read_at(rel, done as u64, &mut buf[done..])?;
        if n == 0 {
            // The file shrank since `len`: return what is there, the decoder will call it truncated.
            buf.truncate(done);
            break;
        }
        done += n;
    }
    Ok(())
}

/// A [`ByteSource`] over a directory of plain files; never follows symlinks.
#[derive(Clone, Debug)]
pub struct DirSource {
    root: PathBuf,
}

impl DirSource {
    /// A source rooted at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        DirSource { root: root.into() }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `root/rel`, after checking `rel` is relative and has no `..`, and that no component on
    /// the way is a symlink (which could lead out of the root).
    fn resolve(&self, rel: &Path) -> io::Result<PathBuf> {
        let mut path = self.root.clone();
        for comp in rel.components() {
            match comp {
                Component::Normal(name) => {
                    path.push(name);
                    if std::fs::symlink_metadata(&path)?.file_type().is_symlink() {
                        return Err(io::Error::new(
                            io::ErrorKind::PermissionDenied,
                            format!(
                                "{} is a symlink; views never follow symlinks",
                                path.display()
                            ),
                        ));
                    }
                }
                Component::CurDir => {}
                _ => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{} is not a plain relative path", rel.display()),
                    ))
                }
            }
        }
        Ok(path)
    }
}

impl ByteSource for DirSource {
    fn len(&self, rel: &Path) -> io::Result<u64> {
        Ok(std::fs::metadata(self.resolve(rel)?)?.len())
    }

    fn read_at(&self, rel: &Path, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let file = File::open(self.resolve(rel)?)?;
        stagefs_parquet_bounds::read_full_at(&file, buf, offset)
    }

    fn read_at_append(
        &self,
        rel: &Path,
        offset: u64,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> io::Result<usize> {
        let mut file = File::open(self.resolve(rel)?)?;
        reserve(buf, len)?;
        file.seek(io::SeekFrom::Start(offset))?;
        // `read_to_end` reads into the reserved spare capacity without zeroing it first.
        file.take(len as u64).read_to_end(buf)
    }

    fn list_dir(&self, rel: &Path) -> io::Result<Vec<SourceEntry>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(self.resolve(rel)?)? {
            let entry = entry?;
            // DirEntry::file_type does not follow symlinks.
            let ft = entry.file_type()?;
            let kind = if ft.is_file() {
                EntryKind::File
            } else if ft.is_dir() {
                EntryKind::Dir
            } else {
                EntryKind::Other
            };
            out.push(SourceEntry {
                name: entry.file_name(),
                kind,
            });
        }
        Ok(out)
    }

    fn signature(&self, rel: &Path) -> io::Result<(u64, Option<SystemTime>)> {
        let meta = std::fs::metadata(self.resolve(rel)?)?;
        Ok((meta.len(), meta.modified().ok()))
    }
}

/// A sequential [`io::Read`] over one file of a [`ByteSource`], starting at an offset.
pub struct SourceReader<'a> {
    src: &'a dyn ByteSource,
    rel: &'a Path,
    pos: u64,
}

impl<'a> SourceReader<'a> {
    /// A reader of `rel` from byte `pos`.
    pub fn new(src: &'a dyn ByteSource, rel: &'a Path, pos: u64) -> Self {
        SourceReader { src, rel, pos }
    }
}

impl io::Read for SourceReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.src.read_at(self.rel, self.pos, buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}
