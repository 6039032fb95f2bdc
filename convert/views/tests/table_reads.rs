//! How the table views read their source: a Parquet column view must fetch each column chunk
//! with one request, as pyarrow does. The page reader parses page headers through a reader a
//! few bytes at a time; unbuffered, every one of those was a source read (21 490 of them for
//! one 80 MB column, each an open + pread + close on a directory source, through the cache on
//! a mount), and the view ran at 0.3× pyarrow.

mod common;

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use common::Counting;

use arrow::array::{ArrayRef, Float64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use stagefs_views::view::View;
use stagefs_views::{DirSource, ViewOptions, ViewSet};

/// Writes `batch` to `DIR/t.parquet` with `props`.
fn write_parquet(dir: &Path, batch: &RecordBatch, props: WriterProperties) {
    let file = File::create(dir.join("t.parquet")).expect("create");
    let mut w = ArrowWriter::try_new(file, batch.schema(), Some(props)).expect("writer");
    w.write(batch).expect("write");
    w.close().expect("close");
}

/// The whole of `view`, read front to back.
fn read_view(view: &dyn View) -> Vec<u8> {
    let mut out = vec![0u8; view.len() as usize];
    let mut off = 0;
    while off < out.len() {
        let n = view.read_at(off as u64, &mut out[off..]).expect("read");
        assert!(n > 0, "short view at {off}");
        off += n;
    }
    out
}

#[test]
fn regression_parquet_page_headers_read_a_few_bytes_at_a_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = 200_000usize;
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Float64, false)]));
    let col: ArrayRef = Arc::new(Float64Array::from_iter_values(
        (0..rows).map(|i| (i as f64).sin()),
    ));
    let batch = RecordBatch::try_new(schema, vec![col]).expect("batch");
    // Small pages (many headers) in two row groups.
    let props = WriterProperties::builder()
        .set_data_page_size_limit(4096)
        .set_write_batch_size(512)
        .set_dictionary_enabled(false)
        .set_max_row_group_row_count(Some(rows / 2))
        .build();
    write_parquet(dir.path(), &batch, props);

    let src = Arc::new(Counting::new(dir.path()));
    let set = ViewSet::new(src.clone(), ViewOptions::default()).expect("view set");
    let view = set.open(Path::new("t.parquet/x.npy")).expect("x.npy");
    let before = src.reads();
    let out = read_view(view.as_ref());
    let reads = src.reads() - before;
    // Two row groups: one request per column chunk (the footer was read at open).
    assert!(
        reads <= 2,
        "{reads} source reads to render a column of 2 row groups ({} pages)",
        rows * 8 / 4096
    );
    // And the bytes are right: the .npy data is the column, little-endian.
    let data = &out[out.len() - rows * 8..];
    for (i, v) in data.chunks_exact(8).enumerate().step_by(997) {
        let got = f64::from_le_bytes(v.try_into().expect("8 bytes"));
        assert_eq!(got, (i as f64).sin(), "row {i}");
    }
}

#[test]
fn regression_adjacent_column_chunks_read_from_the_right_chunk() {
    // `features.npy` decodes every numeric column of a row group at once: their chunks touch
    // (one ends where the next begins), and the next column's first page header was looked
    // up in the previous chunk at its very end — an empty read ("failed to fill whole
    // buffer") that failed every multi-column view of pyarrow's files.
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = 50_000usize;
    let schema = Arc::new(Schema::new(vec![
        Field::new("a", DataType::Float64, false),
        Field::new("b", DataType::Float64, false),
        Field::new("c", DataType::Float64, false),
    ]));
    let col = |k: f64| -> ArrayRef {
        Arc::new(Float64Array::from_iter_values(
            (0..rows).map(move |i| i as f64 * k),
        ))
    };
    let batch = RecordBatch::try_new(schema, vec![col(1.0), col(2.0), col(-0.5)]).expect("batch");
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(rows / 2))
        .build();
    write_parquet(dir.path(), &batch, props);

    let set = ViewSet::new(Arc::new(DirSource::new(dir.path())), ViewOptions::default())
        .expect("view set");
    let view = set
        .open(Path::new("t.parquet/features.npy"))
        .expect("features.npy");
    let out = read_view(view.as_ref());
    // float32 [rows, 3], row-major, at the end of the file after the header.
    let data = &out[out.len() - rows * 3 * 4..];
    for i in (0..rows).step_by(1231) {
        for (j, k) in [1.0f32, 2.0, -0.5].into_iter().enumerate() {
            let at = (i * 3 + j) * 4;
            let got = f32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes"));
            assert_eq!(got, i as f32 * k, "row {i} column {j}");
        }
    }
}
