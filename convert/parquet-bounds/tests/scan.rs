//! The page scan against files real writers make (every physical type, dictionaries,
//! statistics, nulls, several pages) and against the bombs of `testing`.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BinaryArray, BooleanArray, Float32Array, Float64Array, Int32Array, Int64Array,
    RecordBatch, StringArray,
};
use arrow::datatypes::{DataType, Field, Schema};
use bytes::Bytes;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use parquet::file::reader::{FileReader, SerializedFileReader};
use stagefs_parquet_bounds::testing::{self, Values};
use stagefs_parquet_bounds::{decode_cost, MAX_PAGE_BYTES};

fn read_from(file: &[u8]) -> impl FnMut(u64, usize) -> Result<Bytes, String> + '_ {
    move |at, len| {
        let at = at as usize;
        let end = (at + len).min(file.len());
        Ok(Bytes::copy_from_slice(&file[at.min(end)..end]))
    }
}

fn written(props: WriterProperties, rows: usize) -> Vec<u8> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("f64", DataType::Float64, true),
        Field::new("f32", DataType::Float32, false),
        Field::new("i64", DataType::Int64, false),
        Field::new("i32", DataType::Int32, true),
        Field::new("b", DataType::Boolean, false),
        Field::new("s", DataType::Utf8, true),
        Field::new("bin", DataType::Binary, false),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Float64Array::from_iter(
            (0..rows).map(|i| (i % 7 != 0).then_some(i as f64)),
        )),
        Arc::new(Float32Array::from_iter_values(
            (0..rows).map(|i| (i % 13) as f32),
        )),
        Arc::new(Int64Array::from_iter_values(
            (0..rows).map(|i| i as i64 * 31),
        )),
        Arc::new(Int32Array::from_iter(
            (0..rows).map(|i| (i % 5 != 0).then_some(3)),
        )),
        Arc::new(BooleanArray::from_iter((0..rows).map(|i| Some(i % 3 == 0)))),
        Arc::new(StringArray::from_iter((0..rows).map(|i| {
            (i % 11 != 0).then(|| format!("a long string value number {}", i % 97))
        }))),
        Arc::new(BinaryArray::from_iter_values(
            (0..rows).map(|i| vec![(i % 251) as u8; i % 40]),
        )),
    ];
    let batch = RecordBatch::try_new(schema.clone(), cols).expect("batch");
    let mut out = Vec::new();
    let mut w = ArrowWriter::try_new(&mut out, schema, Some(props)).expect("writer");
    w.write(&batch).expect("write");
    w.close().expect("close");
    out
}

#[test]
fn files_of_real_writers_pass_the_scan_with_every_page_seen() {
    let variants = [
        WriterProperties::builder().build(),
        WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_data_page_row_count_limit(1000)
            .set_write_batch_size(1000)
            .build(),
        WriterProperties::builder()
            .set_compression(Compression::ZSTD(Default::default()))
            .set_dictionary_enabled(false)
            .set_writer_version(parquet::file::properties::WriterVersion::PARQUET_2_0)
            .build(),
    ];
    for props in variants {
        let file = written(props, 20_000);
        let bytes = Bytes::from(file.clone());
        let reader = SerializedFileReader::new(bytes).expect("reader");
        let md = reader.metadata();
        let leaves: Vec<usize> = (0..md.file_metadata().schema_descr().num_columns()).collect();
        let cost = decode_cost(md, 0..md.num_row_groups(), &leaves, &mut read_from(&file))
            .expect("a real writer's file passes");
        assert!(cost > 0 && cost < 64 << 20, "{cost}");
    }
}

#[test]
fn regression_a_dictionary_page_claiming_2_gib_is_refused_before_any_allocation() {
    let file = testing::dictionary_bomb(3, Values::Int64, (2 << 30) - 1, None);
    assert!(file.len() < 1024, "the bomb is under 1 KB: {}", file.len());
    let reader = SerializedFileReader::new(Bytes::from(file.clone())).expect("footer parses");
    let md = reader.metadata();
    let e = decode_cost(md, 0..1, &[0, 1, 2], &mut read_from(&file)).expect_err("refused");
    assert!(e.contains("claims") && e.contains("c0"), "{e}");
}

#[test]
fn a_dictionary_page_claiming_more_than_its_values_can_hold_is_refused() {
    // Under the page cap, but 1 MiB for two 8-byte values.
    let file = testing::dictionary_bomb(1, Values::Int64, 1 << 20, None);
    let reader = SerializedFileReader::new(Bytes::from(file.clone())).expect("footer parses");
    let e = decode_cost(reader.metadata(), 0..1, &[0], &mut read_from(&file)).expect_err("refused");
    assert!(e.contains("for 2 values of 8 bytes"), "{e}");
}

#[test]
fn a_data_page_over_the_page_cap_is_refused() {
    let file = testing::dictionary_bomb(1, Values::Int64, 16, Some(MAX_PAGE_BYTES as i64 + 1));
    let reader = SerializedFileReader::new(Bytes::from(file.clone())).expect("footer parses");
    let e = decode_cost(reader.metadata(), 0..1, &[0], &mut read_from(&file)).expect_err("refused");
    assert!(e.contains("more than the 256 MiB"), "{e}");
}

#[test]
fn the_bomb_generator_makes_a_valid_file_when_its_claims_are_true() {
    // The generator is only a fair test of the scan if, with honest sizes, parquet reads it.
    let file = testing::dictionary_bomb(2, Values::Int64, 16, None);
    let mut r = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(file.clone()))
        .expect("opens")
        .build()
        .expect("reader");
    let batch = r.next().expect("a batch").expect("decodes");
    assert_eq!(batch.num_rows(), testing::ROWS as usize);
    let c = batch
        .column(1)
        .as_any()
        .downcast_ref::<Int64Array>()
        .expect("int64");
    assert!(c.iter().all(|v| v == Some(7)));
    let reader = SerializedFileReader::new(Bytes::from(file.clone())).expect("footer parses");
    let cost = decode_cost(reader.metadata(), 0..1, &[0, 1], &mut read_from(&file)).expect("ok");
    assert!(cost < 1024, "{cost}");
}

#[test]
fn a_binary_bomb_under_the_page_cap_costs_what_it_claims() {
    // Byte arrays have no width: the claim passes the page checks and is what the budget
    // sees, so eight such columns (8 × 2 × 200 MiB) are more than the default budget.
    let file = testing::dictionary_bomb(8, Values::Binary, 200 << 20, None);
    let reader = SerializedFileReader::new(Bytes::from(file.clone())).expect("footer parses");
    let leaves: Vec<usize> = (0..8).collect();
    let cost = decode_cost(reader.metadata(), 0..1, &leaves, &mut read_from(&file)).expect("ok");
    assert!(
        cost > stagefs_parquet_bounds::budget::DEFAULT_LIMIT,
        "{cost}"
    );
    let e = stagefs_parquet_bounds::reserve_decode(
        reader.metadata(),
        0..1,
        &leaves,
        "wide.parquet",
        &mut read_from(&file),
    )
    .expect_err("over the budget");
    assert!(e.contains("more than the whole decode budget"), "{e}");
    // Honest, it decodes to "a".
    let file = testing::dictionary_bomb(1, Values::Binary, 10, None);
    let mut r = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(file))
        .expect("opens")
        .build()
        .expect("reader");
    let batch = r.next().expect("a batch").expect("decodes");
    let c = batch
        .column(0)
        .as_any()
        .downcast_ref::<BinaryArray>()
        .expect("binary");
    assert!(c.iter().all(|v| v == Some(&b"a"[..])));
}
