//! The Parquet table view (stagefs-views `table`): open any bytes as `t.parquet` (footer,
//! schema, row groups), then list the view directory and read every file of it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagefs_fuzz::{count_only_escaping_panics, read_table};
use stagefs_views::TableFormat;

fuzz_target!(init: count_only_escaping_panics(), |data: &[u8]| {
    read_table("t.parquet", TableFormat::Parquet, data);
});
