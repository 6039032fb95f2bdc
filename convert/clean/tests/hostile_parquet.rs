//! Parquet inputs whose footers lie: the cleaning job must check every size it takes from a
//! footer before using it. Each test is named after the bug it pins.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ArrowWriter;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataWriter, RowGroupMetaData};
use stagefs_clean::{BadRows, CleanOptions, Codec, Mode, Progress, Step};

fn write_parquet(path: &Path, rows: usize) {
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Float64, false)]));
    let x: ArrayRef = Arc::new(Float64Array::from_iter_values(
        (0..rows).map(|i| i as f64 - 10.0),
    ));
    let b = RecordBatch::try_new(schema.clone(), vec![x]).expect("batch");
    let mut w =
        ArrowWriter::try_new(File::create(path).expect("create"), schema, None).expect("writer");
    w.write(&b).expect("write");
    w.close().expect("close");
}

/// Rewrites the footer of the Parquet file at `path`, each row group edited by `f`.
fn rewrite_row_groups(path: &Path, f: impl Fn(RowGroupMetaData) -> RowGroupMetaData) {
    let bytes = std::fs::read(path).expect("read");
    let meta =
        ArrowReaderMetadata::load(&File::open(path).expect("open"), ArrowReaderOptions::new())
            .expect("footer");
    let n = bytes.len();
    let footer_len = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().expect("len")) as usize;
    let mut out = bytes[..n - 8 - footer_len].to_vec();
    let md: ParquetMetaData = meta.metadata().as_ref().clone();
    let groups = md.row_groups().iter().cloned().map(f).collect();
    let md = md.into_builder().set_row_groups(groups).build();
    ParquetMetaDataWriter::new(&mut out, &md)
        .finish()
        .expect("footer write");
    std::fs::write(path, out).expect("write back");
}

fn options(src: &Path, out: &Path) -> CleanOptions {
    CleanOptions {
        inputs: vec![src.display().to_string()],
        out: out.to_path_buf(),
        steps: vec![Step::DropNa],
        columns: Vec::new(),
        codec: Codec::Zstd,
        shard: None,
        mode: Mode::Convert,
        bad_rows: BadRows::Error,
        memory_budget: 64 << 20,
        threads: 2,
        scratch: None,
    }
}

#[test]
fn parquet_total_byte_size_9e18_does_not_decide_the_split() {
    // The footer's uncompressed size used to set the number of slices unchecked: 9e18 bytes
    // made one unit per row (2.8 GB of spans, then an abort). It is only an estimate now.
    let dir = tempfile::tempdir().expect("tmp");
    let src = dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    write_parquet(&src.join("t.parquet"), 50_000);
    rewrite_row_groups(&src.join("t.parquet"), |rg| {
        rg.into_builder()
            .set_total_byte_size(9_000_000_000_000_000_000)
            .build()
            .expect("rg")
    });
    let out = dir.path().join("out");
    let summary = stagefs_clean::run(&options(&src, &out), &Progress::default()).expect("run");
    assert_eq!(summary.rows_written, 50_000);
    let file = File::open(out.join("part.0.parquet")).expect("output");
    let rows: Vec<f64> = ParquetRecordBatchReaderBuilder::try_new(file)
        .expect("reader")
        .build()
        .expect("build")
        .flat_map(|b| {
            let b = b.expect("batch");
            let x = b
                .column(0)
                .as_any()
                .downcast_ref::<Float64Array>()
                .expect("f64")
                .values()
                .to_vec();
            x
        })
        .collect();
    assert_eq!(rows.len(), 50_000);
    assert_eq!(rows[49_999], 49_989.0);
}

#[test]
fn parquet_footer_claiming_1e12_rows_is_refused_before_any_allocation() {
    let dir = tempfile::tempdir().expect("tmp");
    let src = dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    write_parquet(&src.join("t.parquet"), 1000);
    rewrite_row_groups(&src.join("t.parquet"), |rg| {
        rg.into_builder()
            .set_num_rows(1_000_000_000_000)
            .build()
            .expect("rg")
    });
    let out = dir.path().join("out");
    let err = stagefs_clean::run(&options(&src, &out), &Progress::default())
        .expect_err("a lying footer must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains("t.parquet") && msg.contains("claims more than"),
        "{msg}"
    );
    let left: Vec<_> = std::fs::read_dir(&out)
        .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "nothing written: {left:?}");
}

#[test]
fn regression_the_cleaning_job_decoded_a_parquet_dictionary_bomb() {
    // The views' bomb: a sub-kilobyte file whose dictionary pages each claim 2 GiB. The job
    // must refuse it by name, from its page headers, before allocating from them.
    let dir = tempfile::tempdir().expect("tmp");
    let src = dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    std::fs::write(
        src.join("bomb.parquet"),
        stagefs_parquet_bounds::testing::dictionary_bomb(
            2,
            stagefs_parquet_bounds::testing::Values::Int64,
            (2 << 30) - 1,
            None,
        ),
    )
    .expect("write");
    let out = dir.path().join("out");
    let t = std::time::Instant::now();
    let err = stagefs_clean::run(&options(&src, &out), &Progress::default())
        .expect_err("a bomb must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains("bomb.parquet") && msg.contains("claims"),
        "{msg}"
    );
    assert!(t.elapsed().as_secs() < 10, "{:?}", t.elapsed());
}
