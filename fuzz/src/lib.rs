//! Shared pieces of the fuzz targets: an in-memory [`ByteSource`] holding one file, and a
//! bounded read of a view.
//!
//! Views are read from the start ([`READ_LIMIT`] bytes) and at the end: the start decodes the
//! first block (where a lying row count or size first bites), the end decodes the last one, and
//! a cap keeps one execution short even when a valid input claims a large view.

use std::io;
use std::path::Path;
use std::sync::Arc;

use stagefs_views::table::Table;
use stagefs_views::{ByteSource, EntryKind, SourceEntry, TableFormat, View};

/// Replaces libfuzzer-sys's panic hook, which aborts on every panic — even one that stagefs
/// catches by design (image decoders and the Parquet reader run under `catch_unwind`, so a bad
/// file fails its own view). A panic that escapes the code under test still aborts, in
/// `fuzz_target!`. `FUZZ_SHOW_PANICS=1` prints the caught ones.
pub fn count_only_escaping_panics() {
    std::panic::set_hook(Box::new(|info| {
        if std::env::var_os("FUZZ_SHOW_PANICS").is_some() {
            eprintln!("caught panic: {info}");
        }
    }));
}

/// Most bytes read from one view per execution, at its start (and as much again at its end).
pub const READ_LIMIT: u64 = 1 << 20;

/// A dataset of one file, `name`, holding `data`.
pub struct MemSource {
    /// The file's name at the dataset root.
    pub name: &'static str,
    /// Its contents.
    pub data: Vec<u8>,
}

impl MemSource {
    fn check(&self, rel: &Path) -> io::Result<()> {
        if rel == Path::new(self.name) {
            Ok(())
        } else {
            Err(io::Error::from(io::ErrorKind::NotFound))
        }
    }
}

impl ByteSource for MemSource {
    fn len(&self, rel: &Path) -> io::Result<u64> {
        self.check(rel)?;
        Ok(self.data.len() as u64)
    }

    fn read_at(&self, rel: &Path, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.check(rel)?;
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(self.data.len());
        let n = buf.len().min(self.data.len() - start);
        buf[..n].copy_from_slice(&self.data[start..start + n]);
        Ok(n)
    }

    fn list_dir(&self, rel: &Path) -> io::Result<Vec<SourceEntry>> {
        if rel.as_os_str().is_empty() {
            Ok(vec![SourceEntry {
                name: self.name.into(),
                kind: EntryKind::File,
            }])
        } else {
            Err(io::Error::from(io::ErrorKind::NotFound))
        }
    }
}

/// Reads up to [`READ_LIMIT`] bytes at the start and at the end of `view`; errors are fine
/// (a bad table fails its view), only a panic, an abort or a hang is a finding.
pub fn read_view(view: &dyn View) {
    let len = view.len();
    let mut buf = vec![0u8; 64 << 10];
    let mut pos = 0u64;
    while pos < len.min(READ_LIMIT) {
        match view.read_at(pos, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => pos += n as u64,
        }
    }
    if len > READ_LIMIT {
        let _ = view.read_at(len - READ_LIMIT.min(len), &mut buf);
    }
}

/// Opens `data` as the table file `name` in `format`, lists its view directory and reads
/// every file of it ([`read_view`]); a listed size must be the view's. The body of the table
/// targets: a bad table fails to open or fails its views, only a panic, an abort, a hang or
/// (under `parquet_pages`'s bounded allocator) an allocation past the bounds is a finding.
pub fn read_table(name: &'static str, format: TableFormat, data: &[u8]) {
    let src = Arc::new(MemSource {
        name,
        data: data.to_vec(),
    });
    let Ok(table) = Table::open(src, Path::new(name), format) else {
        return;
    };
    let table = Arc::new(table);
    for (entry, len) in table.entries() {
        if let Some(view) = table.view(&entry) {
            assert_eq!(
                view.len(),
                len,
                "{entry}: listed size differs from the view's"
            );
            read_view(view.as_ref());
        }
    }
}
