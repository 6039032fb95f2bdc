//! The CSV table view (stagefs-views `table`): open any bytes as `t.csv` (header line,
//! type inference, record index), then list the view directory and read every file of it.
#![no_main]

use std::path::Path;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use stagefs_fuzz::{count_only_escaping_panics, read_view, MemSource};
use stagefs_views::table::Table;
use stagefs_views::TableFormat;

fuzz_target!(init: count_only_escaping_panics(), |data: &[u8]| {
    let src = Arc::new(MemSource {
        name: "t.csv",
        data: data.to_vec(),
    });
    let Ok(table) = Table::open(src, Path::new("t.csv"), TableFormat::Csv) else {
        return;
    };
    let table = Arc::new(table);
    for (name, len) in table.entries() {
        if let Some(view) = table.view(&name) {
            assert_eq!(
                view.len(),
                len,
                "{name}: listed size differs from the view's"
            );
            read_view(view.as_ref());
        }
    }
});
