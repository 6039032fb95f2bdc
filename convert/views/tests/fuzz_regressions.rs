//! Inputs the fuzzer (`fuzz/`, target `table_parquet`) found to panic inside the `parquet`
//! crate, stored as the bytes it produced (`tests/fuzz-corpus/`, 1.8 and 2.5 KB: a mutated
//! footer cannot be rebuilt through the writer's API). The views run the Parquet reader under
//! `catch_unwind`, so each must fail its own view with a corrupt-input error — never panic out
//! of `Table` (a panic in a FUSE handler thread or in `convert` would take the process down).
#![allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)

use std::io;
use std::path::Path;
use std::sync::Arc;

use stagefs_views::table::Table;
use stagefs_views::{ByteSource, EntryKind, SourceEntry, TableFormat, ViewError};

/// A dataset holding one file, `t.parquet`.
struct OneFile(Vec<u8>);

impl ByteSource for OneFile {
    fn len(&self, _rel: &Path) -> io::Result<u64> {
        Ok(self.0.len() as u64)
    }
    fn read_at(&self, _rel: &Path, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let start = (offset as usize).min(self.0.len());
        let n = buf.len().min(self.0.len() - start);
        buf[..n].copy_from_slice(&self.0[start..start + n]);
        Ok(n)
    }
    fn list_dir(&self, _rel: &Path) -> io::Result<Vec<SourceEntry>> {
        Ok(vec![SourceEntry {
            name: "t.parquet".into(),
            kind: EntryKind::File,
        }])
    }
}

/// Opens `bytes` as a Parquet table and reads the start of every view file; returns the
/// errors met (opening included).
fn read_everything(bytes: &[u8]) -> Vec<ViewError> {
    let src = Arc::new(OneFile(bytes.to_vec()));
    let table = match Table::open(src, Path::new("t.parquet"), TableFormat::Parquet) {
        Ok(t) => Arc::new(t),
        Err(e) => return vec![e],
    };
    let mut errors = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    for (name, _) in table.entries() {
        if let Some(view) = table.view(&name) {
            if let Err(e) = view.read_at(0, &mut buf) {
                errors.push(e);
            }
        }
    }
    errors
}

fn corpus(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fuzz-corpus")
            .join(name),
    )
    .unwrap()
}

/// A footer whose column chunk has a negative start or length: parquet's
/// `ColumnChunkMetaData::byte_range` asserts ("column start and length should not be negative").
#[test]
fn parquet_negative_column_range_fails_view_not_process() {
    let errors = read_everything(&corpus("parquet_negative_column_range.parquet"));
    assert!(!errors.is_empty(), "a corrupt footer read without error");
    assert!(
        errors
            .iter()
            .all(|e| matches!(e, ViewError::Corrupt { .. })),
        "{errors:?}"
    );
}

/// Dictionary-encoded data pages without a dictionary page: parquet's decoder panics
/// ("Decoder for dict should have been set").
#[test]
fn parquet_dictionary_page_missing_fails_view_not_process() {
    let errors = read_everything(&corpus("parquet_dictionary_page_missing.parquet"));
    assert!(
        !errors.is_empty(),
        "a corrupt column chunk read without error"
    );
    assert!(
        errors
            .iter()
            .all(|e| matches!(e, ViewError::Corrupt { .. })),
        "{errors:?}"
    );
}

/// Fuzzer finding (`image_render`, slow): a 732-byte JPEG whose header declares 62979×905
/// pixels cost ~170 MB and seconds of CPU per decode before failing as truncated. It is now
/// refused from its header: more pixels than its byte count can hold.
#[test]
fn jpeg_declaring_57_mpx_in_732_bytes_is_refused_before_decoding() {
    let bytes = include_bytes!("../../../fuzz/findings/image_render_slow_jpeg_bomb.jpg");
    let mut out = vec![0u8; 3 * 16 * 16];
    let err = stagefs_views::image::decode::render(bytes, 16, &mut out).unwrap_err();
    assert!(err.contains("more than its format can hold"), "{err}");
}

/// Fuzzer finding (`parquet_pages`, timeout): a 347-byte file whose column chunk holds, after
/// the pages with its values, a page header with a list claiming 2^31 doubles. The parquet
/// crate reads page headers until the chunk's bytes run out (not until it has the values) and
/// its Thrift skipper walks such a list at the end of its input without error, one empty copy
/// per element: minutes of CPU. The page scan now checks every header up to the chunk's end.
#[test]
fn parquet_header_listing_2_31_doubles_after_the_values_fails_at_once() {
    let t = std::time::Instant::now();
    let errors = read_everything(&corpus("parquet_list_of_doubles_past_the_values.parquet"));
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t.elapsed()
    );
    assert!(
        errors
            .iter()
            .all(|e| matches!(e, ViewError::Corrupt { .. })),
        "{errors:?}"
    );
}
