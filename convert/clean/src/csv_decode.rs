//! The fast CSV decoder of the cleaning job: one unit of complete records → record batches of
//! the unified schema, every field parsed straight into its column's Arrow builder.
//!
//! Records and fields are split by `simd-csv` (SIMD search for the delimiter, quote and
//! newline, a state machine only inside quoted fields), numbers parsed from bytes by
//! `lexical-core` (the parser arrow-csv itself uses: Eisel-Lemire for floats, no UTF-8 step).
//! Compared with arrow-csv's decoder this skips the per-record DFA of `csv-core`, the copy of
//! every record into an intermediate buffer with offsets, and the parsing of columns that
//! `--columns` leaves out.
//!
//! It takes only input it is sure to read exactly as arrow-csv (the reference path, which
//! matches pandas) would: a unit with a quote in the middle of an unquoted field (`ab"c`,
//! literal for csv-core but a quote for simd-csv), a record with the wrong number of fields,
//! or a value that does not parse as its column's type makes [`decode`] return `None`, and the
//! caller falls back to arrow-csv and, for malformed rows, to the record-by-record path that
//! names the line. So this path needs no error reporting of its own.
//!
//! Semantics kept from the reference path: an empty field (quoted or not) is null; booleans
//! are `true`/`false` in any case; blank lines are skipped; a `\r` before the newline is not
//! part of the last field.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BinaryBuilder, BooleanBuilder, Float64Builder, Int64Builder, RecordBatch, StringArray,
};
use arrow::datatypes::{DataType, SchemaRef};

/// One output column being built.
enum Column {
    F64(Float64Builder),
    I64(Int64Builder),
    Bool(BooleanBuilder),
    /// Text is gathered as bytes and checked as UTF-8 once per batch when it becomes a
    /// `StringArray` (one pass over the values instead of a call per field).
    Text(BinaryBuilder),
}

impl Column {
    fn new(dt: &DataType, rows: usize, bytes: usize) -> Option<Column> {
        Some(match dt {
            DataType::Float64 => Column::F64(Float64Builder::with_capacity(rows)),
            DataType::Int64 => Column::I64(Int64Builder::with_capacity(rows)),
            DataType::Boolean => Column::Bool(BooleanBuilder::with_capacity(rows)),
            DataType::Utf8 => Column::Text(BinaryBuilder::with_capacity(rows, bytes)),
            _ => return None,
        })
    }

    /// Appends one field; `None` when it does not parse as the column's type.
    #[inline]
    fn push(&mut self, field: &[u8]) -> Option<()> {
        if field.is_empty() {
            match self {
                Column::F64(b) => b.append_null(),
                Column::I64(b) => b.append_null(),
                Column::Bool(b) => b.append_null(),
                Column::Text(b) => b.append_null(),
            }
            return Some(());
        }
        match self {
            Column::F64(b) => b.append_value(lexical_core::parse::<f64>(field).ok()?),
            Column::I64(b) => b.append_value(lexical_core::parse::<i64>(field).ok()?),
            Column::Bool(b) => {
                if field.eq_ignore_ascii_case(b"true") {
                    b.append_value(true)
                } else if field.eq_ignore_ascii_case(b"false") {
                    b.append_value(false)
                } else {
                    return None;
                }
            }
            Column::Text(b) => b.append_value(field),
        }
        Some(())
    }

    /// The column so far as an array (`None`: text that is not UTF-8).
    fn finish(&mut self) -> Option<ArrayRef> {
        Some(match self {
            Column::F64(b) => Arc::new(b.finish()),
            Column::I64(b) => Arc::new(b.finish()),
            Column::Bool(b) => Arc::new(b.finish()),
            Column::Text(b) => Arc::new(StringArray::try_from_binary(b.finish()).ok()?),
        })
    }
}

/// Whether every quote in `bytes` sits where a CSV quote can: opening a field (right after
/// the delimiter, a newline or the start), doubled inside a quoted field, or closing it (right
/// before the delimiter, `\r`, a newline or the end). Anything else (`5'10"` or `ab"c` in an
/// unquoted field) is literal for csv-core but a quote for simd-csv, so such a unit is left to
/// the reference path.
fn quotes_are_plain(bytes: &[u8]) -> bool {
    let mut quotes = memchr::memchr_iter(b'"', bytes);
    let mut in_quotes = false;
    while let Some(i) = quotes.next() {
        let after = bytes.get(i + 1).copied();
        if !in_quotes {
            if i > 0 && !matches!(bytes[i - 1], b',' | b'\n') {
                return false;
            }
            in_quotes = true;
        } else if after == Some(b'"') {
            quotes.next(); // a doubled quote: both are one literal quote
        } else if matches!(after, None | Some(b',' | b'\n' | b'\r')) {
            in_quotes = false;
        } else {
            return false;
        }
    }
    !in_quotes
}

/// Decodes a unit of complete CSV records with `schema` (all the file's columns) into batches
/// of at most `batch_rows` rows of the `projection`'s columns. `header`: skip the first record.
/// `None`: the unit needs the reference path (see the module notes).
pub fn decode(
    schema: &SchemaRef,
    projection: Option<&Vec<usize>>,
    bytes: &[u8],
    header: bool,
    batch_rows: usize,
) -> Option<Vec<RecordBatch>> {
    if !quotes_are_plain(bytes) {
        return None;
    }
    let ncols = schema.fields().len();
    let all: Vec<usize>;
    let proj: &[usize] = match projection {
        Some(p) => p,
        None => {
            all = (0..ncols).collect();
            &all
        }
    };
    // Where each file column goes: its index among the output columns, if kept.
    let mut slot: Vec<Option<usize>> = vec![None; ncols];
    for (k, &c) in proj.iter().enumerate() {
        *slot.get_mut(c)? = Some(k);
    }
    let out_schema = Arc::new(schema.project(proj).ok()?);
    // A first guess of rows per batch from the record length, for the builders' capacity.
    let rows_hint = batch_rows.min(bytes.len() / (ncols.max(1) * 4) + 1);
    let text_hint = bytes.len().min(64 << 20) / ncols.max(1);
    let new_columns = || -> Option<Vec<Column>> {
        proj.iter()
            .map(|&c| Column::new(schema.field(c).data_type(), rows_hint, text_hint))
            .collect()
    };
    let mut columns = new_columns()?;
    let mut batches = Vec::new();
    let mut rows = 0usize;
    let mut reader = simd_csv::TotalReaderBuilder::new()
        .has_headers(false)
        .from_bytes(bytes);
    let mut record = simd_csv::ByteRecord::new();
    let mut first = true;
    let mut flush = |columns: &mut Vec<Column>, rows: &mut usize| -> Option<()> {
        let arrays = columns
            .iter_mut()
            .map(Column::finish)
            .collect::<Option<Vec<ArrayRef>>>()?;
        batches.push(RecordBatch::try_new(out_schema.clone(), arrays).ok()?);
        *rows = 0;
        Some(())
    };
    while reader.read_byte_record(&mut record) {
        if std::mem::take(&mut first) && header {
            continue;
        }
        if record.len() != ncols {
            return None;
        }
        for (field, s) in record.iter().zip(&slot) {
            if let Some(k) = s {
                columns[*k].push(field)?;
            }
        }
        rows += 1;
        if rows == batch_rows {
            flush(&mut columns, &mut rows)?;
        }
    }
    if rows > 0 {
        flush(&mut columns, &mut rows)?;
    }
    Some(batches)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::{Field, Schema};

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("s", DataType::Utf8, true),
            Field::new("x", DataType::Float64, true),
            Field::new("n", DataType::Int64, true),
            Field::new("b", DataType::Boolean, true),
        ]))
    }

    /// The reference: arrow-csv's decoder, as the rest of the job uses it.
    fn arrow_decode(bytes: &[u8], header: bool, proj: Option<&Vec<usize>>) -> Vec<RecordBatch> {
        let mut b = arrow::csv::ReaderBuilder::new(schema()).with_header(header);
        if let Some(p) = proj {
            b = b.with_projection(p.clone());
        }
        b.build(bytes)
            .expect("reader")
            .collect::<Result<Vec<_>, _>>()
            .expect("arrow decodes it")
    }

    fn concat(b: &[RecordBatch]) -> RecordBatch {
        arrow::compute::concat_batches(&b[0].schema(), b).expect("concat")
    }

    #[test]
    fn same_batches_as_arrow_csv() {
        let text = "s,x,n,b\n\
            plain,1.5,3,true\n\
            \"say \"\"hi\"\", ok\",-2e3,-7,FALSE\n\
            \"two\nlines\",nan,0,\n\
            ,,,\r\n\
            \"\",inf,42,True\n\
            \n\
            é,.5,+9,false\n";
        for proj in [None, Some(vec![3, 1])] {
            let ours = decode(&schema(), proj.as_ref(), text.as_bytes(), true, 4).expect("fast");
            assert_eq!(
                ours.iter().map(|b| b.num_rows()).collect::<Vec<_>>(),
                [4, 2]
            );
            let want = arrow_decode(text.as_bytes(), true, proj.as_ref());
            assert_eq!(concat(&ours), concat(&want), "projection {proj:?}");
        }
    }

    #[test]
    fn last_record_without_newline_is_kept() {
        let text = b"a,1.5,2,true\n\"b,c\",2.5,3,false";
        let ours = decode(&schema(), None, text, false, 8).expect("fast");
        assert_eq!(concat(&ours), concat(&arrow_decode(text, false, None)));
        assert_eq!(ours[0].num_rows(), 2);
    }

    #[test]
    fn leaves_what_it_cannot_be_sure_of_to_the_reference_path() {
        let s = schema();
        // A quote inside an unquoted field: literal for csv-core.
        assert!(decode(&s, None, b"5'10\",1,2,true\n", false, 8).is_none());
        assert!(decode(&s, None, b"a\"b,1,2,true\n", false, 8).is_none());
        assert!(decode(&s, None, b"\"a\"b,1,2,true\n", false, 8).is_none());
        assert!(decode(&s, None, b"\"open,1,2,true\n", false, 8).is_none());
        // Wrong field count, a float in an integer column, a word in a bool column.
        assert!(decode(&s, None, b"a,1,2\n", false, 8).is_none());
        assert!(decode(&s, None, b"a,1,2.5,true\n", false, 8).is_none());
        assert!(decode(&s, None, b"a,1,2,yes\n", false, 8).is_none());
        assert!(decode(&s, None, b"a,x1,2,true\n", false, 8).is_none());
        // Text that is not UTF-8.
        assert!(decode(&s, None, b"\xff\xfe,1,2,true\n", false, 8).is_none());
    }
}
