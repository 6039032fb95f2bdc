//! Writes a Parquet file of many small row groups (one int64 column `x`, row i holding 3i),
//! the shape that once locked the mount up, for timing `stagefs convert --to npy` and the mount on it.
//!
//! `cargo run --release -p stagefs-views --example many_row_groups -- OUT.parquet [GROUPS] [ROWS_PER_GROUP]`
//! (defaults: 100000 groups of 1 row).

use std::fs::File;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = args
        .next()
        .ok_or("usage: many_row_groups OUT.parquet [GROUPS] [ROWS_PER_GROUP]")?;
    let groups: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(100_000);
    let per: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1);
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(per.max(1)))
        .build();
    let mut w = ArrowWriter::try_new(File::create(&out)?, schema.clone(), Some(props))?;
    let total = groups * per;
    for start in (0..total).step_by(1 << 16) {
        let end = (start + (1 << 16)).min(total);
        let col: ArrayRef = Arc::new(Int64Array::from_iter_values(
            (start..end).map(|i| i as i64 * 3),
        ));
        w.write(&RecordBatch::try_new(schema.clone(), vec![col])?)?;
    }
    w.close()?;
    Ok(())
}
