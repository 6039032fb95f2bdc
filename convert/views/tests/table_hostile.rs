//! Hostile tables: files whose metadata lies must fail their own views with a corrupt-input
//! error (EIO in the mount) and leave every other view working — never abort the process.
//! Each test is named after the bug it pins.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, BooleanArray, Float64Array, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::arrow::ArrowWriter;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataWriter, RowGroupMetaData};
use stagefs_views::{DirSource, ViewError, ViewOptions, ViewSet};

fn batch(rows: usize) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("x", DataType::Float64, false),
        Field::new("k", DataType::Int64, false),
        Field::new("b", DataType::Boolean, false),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Float64Array::from_iter_values(
            (0..rows).map(|i| i as f64 * 0.5),
        )),
        Arc::new(Int64Array::from_iter_values(
            (0..rows).map(|i| i as i64 * 3),
        )),
        Arc::new(BooleanArray::from_iter((0..rows).map(|i| Some(i % 3 == 0)))),
    ];
    RecordBatch::try_new(schema, cols).expect("batch")
}

fn write_parquet(path: &Path, rows: usize) {
    let b = batch(rows);
    let mut w = ArrowWriter::try_new(File::create(path).expect("create"), b.schema(), None)
        .expect("writer");
    w.write(&b).expect("write");
    w.close().expect("close");
}

/// Rewrites the footer of the Parquet file at `path` with `edit` applied to its metadata.
fn rewrite_footer(path: &Path, edit: impl FnOnce(ParquetMetaData) -> ParquetMetaData) {
    let bytes = std::fs::read(path).expect("read");
    let meta =
        ArrowReaderMetadata::load(&File::open(path).expect("open"), ArrowReaderOptions::new())
            .expect("footer");
    let n = bytes.len();
    let footer_len = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().expect("len")) as usize;
    let mut out = bytes[..n - 8 - footer_len].to_vec();
    let md = edit(meta.metadata().as_ref().clone());
    ParquetMetaDataWriter::new(&mut out, &md)
        .finish()
        .expect("footer write");
    std::fs::write(path, out).expect("write back");
}

fn with_row_groups(
    md: ParquetMetaData,
    f: impl Fn(RowGroupMetaData) -> RowGroupMetaData,
) -> ParquetMetaData {
    let groups = md.row_groups().iter().cloned().map(f).collect();
    md.into_builder().set_row_groups(groups).build()
}

fn set(dir: &Path) -> ViewSet {
    ViewSet::new(Arc::new(DirSource::new(dir)), ViewOptions::default()).expect("scan")
}

fn read_all(set: &ViewSet, rel: &str) -> Result<Vec<u8>, ViewError> {
    let view = set.open(Path::new(rel))?;
    let mut out = vec![0u8; view.len() as usize];
    let n = view.read_at(0, &mut out)?;
    out.truncate(n);
    Ok(out)
}

fn assert_corrupt(r: Result<impl std::fmt::Debug, ViewError>, what: &str) -> String {
    match r {
        Err(e @ ViewError::Corrupt { .. }) => {
            assert_eq!(e.errno(), 5, "a corrupt table answers EIO");
            e.to_string()
        }
        other => panic!("{what}: expected a corrupt-input error, got {other:?}"),
    }
}

/// The good table next to the bad one still reads, value for value.
fn assert_good_table_reads(set: &ViewSet) {
    let x = read_all(set, "good.parquet/x.npy").expect("good table still readable");
    let (h, start) = stagefs_npy::NpyHeader::parse(&x).expect("npy");
    assert_eq!(h.shape, vec![1000]);
    let v: Vec<f64> = x[start..]
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8")))
        .collect();
    assert_eq!(v[999], 499.5);
    let b = read_all(set, "good.parquet/b.npy").expect("bools");
    let (_, start) = stagefs_npy::NpyHeader::parse(&b).expect("npy");
    let want: Vec<u8> = (0..1000).map(|i| u8::from(i % 3 == 0)).collect();
    assert_eq!(&b[start..], &want[..]);
}

#[test]
fn parquet_footer_claiming_1e12_rows_fails_view_not_mount() {
    let dir = tempfile::tempdir().expect("tmp");
    write_parquet(&dir.path().join("good.parquet"), 1000);
    let bad = dir.path().join("bad.parquet");
    write_parquet(&bad, 1000);
    rewrite_footer(&bad, |md| {
        with_row_groups(md, |rg| {
            rg.into_builder()
                .set_num_rows(1_000_000_000_000)
                .build()
                .expect("rg")
        })
    });
    assert!(std::fs::metadata(&bad).expect("stat").len() < 20_000);
    let set = set(dir.path());
    let msg = assert_corrupt(set.read_dir(Path::new("bad.parquet")), "listing");
    assert!(msg.contains("claims more than"), "{msg}");
    assert_corrupt(read_all(&set, "bad.parquet/x.npy"), "reading");
    assert_good_table_reads(&set);
}

#[test]
fn parquet_column_chunk_outside_the_file_fails_view_not_mount() {
    let dir = tempfile::tempdir().expect("tmp");
    write_parquet(&dir.path().join("good.parquet"), 1000);
    let bad = dir.path().join("bad.parquet");
    write_parquet(&bad, 1000);
    rewrite_footer(&bad, |md| {
        with_row_groups(md, |rg| {
            let cols = rg
                .columns()
                .iter()
                .map(|c| {
                    c.clone()
                        .into_builder()
                        .set_data_page_offset(i64::MAX - 10)
                        .set_dictionary_page_offset(None)
                        .build()
                        .expect("col")
                })
                .collect();
            rg.into_builder()
                .set_column_metadata(cols)
                .build()
                .expect("rg")
        })
    });
    let set = set(dir.path());
    let msg = assert_corrupt(set.read_dir(Path::new("bad.parquet")), "listing");
    assert!(msg.contains("outside the file"), "{msg}");
    assert_good_table_reads(&set);
}

#[test]
fn parquet_footer_with_negative_row_count_fails_view_not_mount() {
    let dir = tempfile::tempdir().expect("tmp");
    write_parquet(&dir.path().join("good.parquet"), 1000);
    let bad = dir.path().join("bad.parquet");
    write_parquet(&bad, 1000);
    rewrite_footer(&bad, |md| {
        with_row_groups(md, |rg| {
            rg.into_builder().set_num_rows(-5).build().expect("rg")
        })
    });
    let set = set(dir.path());
    assert_corrupt(set.read_dir(Path::new("bad.parquet")), "listing");
    assert_good_table_reads(&set);
}

#[test]
fn parquet_row_group_shorter_than_its_footer_claims_fails_read_with_eio() {
    // A claim within the sanity limit (5x the real rows) passes the footer check; the read
    // finds the pages run out and fails that view only.
    let dir = tempfile::tempdir().expect("tmp");
    write_parquet(&dir.path().join("good.parquet"), 1000);
    let bad = dir.path().join("bad.parquet");
    write_parquet(&bad, 1000);
    rewrite_footer(&bad, |md| {
        with_row_groups(md, |rg| {
            rg.into_builder().set_num_rows(5000).build().expect("rg")
        })
    });
    let set = set(dir.path());
    assert_corrupt(read_all(&set, "bad.parquet/x.npy"), "reading");
    assert_corrupt(
        read_all(&set, "bad.parquet/features.npy"),
        "reading features",
    );
    assert_good_table_reads(&set);
}

#[test]
fn column_name_over_255_bytes_gets_a_short_file_name() {
    let dir = tempfile::tempdir().expect("tmp");
    write_parquet(&dir.path().join("good.parquet"), 1000);
    let long = "é".repeat(150); // 300 bytes
    let schema = Arc::new(Schema::new(vec![
        Field::new(&long, DataType::Float64, false),
        Field::new("y", DataType::Float64, false),
    ]));
    let b = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(Float64Array::from(vec![1.5, 2.5])) as ArrayRef,
            Arc::new(Float64Array::from(vec![3.0, 4.0])) as ArrayRef,
        ],
    )
    .expect("batch");
    let path = dir.path().join("long.parquet");
    let mut w =
        ArrowWriter::try_new(File::create(&path).expect("create"), schema, None).expect("writer");
    w.write(&b).expect("write");
    w.close().expect("close");
    let set = set(dir.path());
    let entries = set.read_dir(Path::new("long.parquet")).expect("listing");
    let names: Vec<String> = entries
        .iter()
        .map(|e| e.name.to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| n.len() <= 255 - 16), "{names:?}");
    let file = names
        .iter()
        .find(|n| n.starts_with('é'))
        .expect("the long column has a file");
    assert!(file.ends_with("_0.npy"), "{file}");
    let x = read_all(&set, &format!("long.parquet/{file}")).expect("readable");
    let (_, start) = stagefs_npy::NpyHeader::parse(&x).expect("npy");
    assert_eq!(
        &x[start..],
        [1.5f64.to_le_bytes(), 2.5f64.to_le_bytes()].concat()
    );
    let schema_json = read_all(&set, "long.parquet/schema.json").expect("schema");
    let doc: serde_json::Value = serde_json::from_slice(&schema_json).expect("json");
    assert_eq!(doc["columns"][0]["name"], long.as_str());
    assert_eq!(doc["columns"][0]["file"], file.as_str());
}

#[test]
fn csv_stray_quote_fails_view_with_bounded_memory() {
    // A quote opened on line 2 and never closed makes the rest of the file one field: the
    // table fails once 64 MiB pass without a record, instead of buffering it all.
    let dir = tempfile::tempdir().expect("tmp");
    write_parquet(&dir.path().join("good.parquet"), 1000);
    let mut text = b"a,b\n1,\"oops\n".to_vec();
    let line = b"2,3\n".repeat(1 << 10);
    while text.len() < (66 << 20) {
        text.extend_from_slice(&line);
    }
    std::fs::write(dir.path().join("bad.csv"), text).expect("write");
    let set = set(dir.path());
    let msg = assert_corrupt(set.read_dir(Path::new("bad.csv")), "listing");
    assert!(msg.contains("stray"), "{msg}");
    assert_good_table_reads(&set);
}
