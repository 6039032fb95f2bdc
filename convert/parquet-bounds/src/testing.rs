//! Hostile Parquet files for tests and the fuzzer's seeds: their page headers lie about sizes,
//! which no writer does, so they are assembled here page by page.

use std::sync::Arc;

use parquet::basic::{Compression, Encoding};
use parquet::file::metadata::{
    ColumnChunkMetaData, FileMetaData, ParquetMetaData, ParquetMetaDataWriter, RowGroupMetaData,
};
use parquet::schema::parser::parse_message_type;
use parquet::schema::types::SchemaDescriptor;

use crate::header::{encode, PageHeader, PageKind};

/// Rows of every file made here.
pub const ROWS: i64 = 1000;

/// A snappy block holding `data` as one literal (at most 60 bytes).
fn snappy_literal(data: &[u8]) -> Vec<u8> {
    assert!(!data.is_empty() && data.len() <= 60, "one short literal");
    let mut out = vec![data.len() as u8, ((data.len() - 1) as u8) << 2];
    out.extend_from_slice(data);
    out
}

/// The physical type of a bomb's columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// int64: the scan can hold sizes against 8 bytes a value. Values read as 7.
    Int64,
    /// byte arrays: no width to hold sizes against, only the page cap and the budget. Values
    /// read as "a".
    Binary,
}

/// A Parquet file of `columns` required columns of [`ROWS`] rows, each dictionary encoded
/// with snappy: a dictionary page of two values whose header claims `dictionary_claim` bytes
/// uncompressed, and one data page of indices whose header claims `page_claim` bytes (`None`:
/// its true size).
pub fn dictionary_bomb(
    columns: usize,
    values: Values,
    dictionary_claim: i64,
    page_claim: Option<i64>,
) -> Vec<u8> {
    let ty = match values {
        Values::Int64 => "int64",
        Values::Binary => "binary",
    };
    let fields: String = (0..columns)
        .map(|c| format!("required {ty} c{c}; "))
        .collect();
    let schema = parse_message_type(&format!("message m {{ {fields}}}")).expect("schema");
    let descr = Arc::new(SchemaDescriptor::new(Arc::new(schema)));
    let mut out = b"PAR1".to_vec();
    let mut chunks = Vec::new();
    // Dictionary [7, 9] or ["a", "b"]; indices: bit width 1, one RLE run of ROWS zeros.
    let dict: Vec<u8> = match values {
        Values::Int64 => [7i64, 9].iter().flat_map(|v| v.to_le_bytes()).collect(),
        Values::Binary => vec![1, 0, 0, 0, b'a', 1, 0, 0, 0, b'b'],
    };
    let dict_body = snappy_literal(&dict);
    let mut indices = vec![1u8];
    let mut run = (ROWS as u64) << 1;
    while run >= 0x80 {
        indices.push((run as u8) | 0x80);
        run >>= 7;
    }
    indices.extend([run as u8, 0]);
    let data_body = snappy_literal(&indices);
    for c in 0..columns {
        let dict_at = out.len() as i64;
        out.extend(encode(&PageHeader {
            kind: PageKind::Dictionary,
            uncompressed: dictionary_claim,
            compressed: dict_body.len() as i64,
            num_values: Some(2),
        }));
        out.extend(&dict_body);
        let data_at = out.len() as i64;
        out.extend(encode(&PageHeader {
            kind: PageKind::Data,
            uncompressed: page_claim.unwrap_or(indices.len() as i64),
            compressed: data_body.len() as i64,
            num_values: Some(ROWS),
        }));
        out.extend(&data_body);
        let len = out.len() as i64 - dict_at;
        chunks.push(
            ColumnChunkMetaData::builder(descr.column(c))
                .set_compression(Compression::SNAPPY)
                .set_encodings(vec![
                    Encoding::PLAIN,
                    Encoding::RLE_DICTIONARY,
                    Encoding::RLE,
                ])
                .set_num_values(ROWS)
                .set_total_compressed_size(len)
                .set_total_uncompressed_size(len)
                .set_data_page_offset(data_at)
                .set_dictionary_page_offset(Some(dict_at))
                .build()
                .expect("column chunk"),
        );
    }
    let group = RowGroupMetaData::builder(descr.clone())
        .set_num_rows(ROWS)
        .set_total_byte_size(out.len() as i64)
        .set_column_metadata(chunks)
        .build()
        .expect("row group");
    let md = ParquetMetaData::new(
        FileMetaData::new(1, ROWS, None, None, descr, None),
        vec![group],
    );
    ParquetMetaDataWriter::new(&mut out, &md)
        .finish()
        .expect("footer");
    out
}
