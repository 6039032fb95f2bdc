//! One table file must never take down or lock up the mount. The cost of a read is
//! proved by counting work (blocks and row groups decoded, source requests), not by timing.
//! Each test is named after the finding it pins.

mod common;

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use common::Counting;

use arrow::array::{ArrayRef, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use stagefs_views::{TableFormat, ViewError, ViewOptions, ViewSet};

fn counting(dir: &Path) -> (Arc<Counting>, ViewSet) {
    let src = Arc::new(Counting::new(dir));
    let set = ViewSet::new(src.clone(), ViewOptions::default()).expect("scan");
    (src, set)
}

/// Peak resident memory of this process so far (bytes), from /proc.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb << 10)
}

fn read_at(set: &ViewSet, rel: &str, offset: u64, len: usize) -> Vec<u8> {
    let view = set.open(Path::new(rel)).expect("open view");
    let mut buf = vec![0u8; len];
    let n = view.read_at(offset, &mut buf).expect("read");
    buf.truncate(n);
    buf
}

#[test]
fn wide_csv_of_1e5_columns_does_not_kill_the_daemon() {
    // 10^5 columns × 50 rows (20 MB): the decoder reserved 64 Ki rows × 10^5 columns of
    // offsets (52 GB) and the process aborted. Blocks are now narrowed to the field budget.
    const COLS: usize = 100_000;
    const ROWS: usize = 50;
    let dir = tempfile::tempdir().expect("tmp");
    let mut text = String::with_capacity(COLS * ROWS * 4);
    let header: Vec<String> = (0..COLS).map(|c| format!("c{c}")).collect();
    text.push_str(&header.join(","));
    text.push('\n');
    for r in 0..ROWS {
        let row: Vec<String> = (0..COLS).map(|c| ((r + c) % 100).to_string()).collect();
        text.push_str(&row.join(","));
        text.push('\n');
    }
    std::fs::write(dir.path().join("wide.csv"), &text).expect("write");
    let (_, set) = counting(dir.path());
    let entries = set.read_dir(Path::new("wide.csv")).expect("listing");
    assert_eq!(
        entries.len(),
        COLS + 2,
        "one file per column + features + schema"
    );
    let table = set
        .table(Path::new("wide.csv"), TableFormat::Csv)
        .expect("table");
    let rows_per_block = stagefs_views::table::csv::block_rows(COLS);
    assert!(rows_per_block * COLS <= stagefs_views::table::csv::MAX_BLOCK_FIELDS);
    assert_eq!(table.blocks(), ROWS.div_ceil(rows_per_block));
    // A column and the features matrix read right.
    let col = read_at(&set, "wide.csv/c77777.npy", 0, 1 << 20);
    let (h, start) = stagefs_npy::NpyHeader::parse(&col).expect("npy");
    assert_eq!(h.shape, vec![ROWS as u64]);
    let vals: Vec<i64> = col[start..]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8")))
        .collect();
    let want: Vec<i64> = (0..ROWS).map(|r| ((r + 77_777) % 100) as i64).collect();
    assert_eq!(vals, want);
    let feats = read_at(&set, "wide.csv/features.npy", 0, 4096);
    assert_eq!(feats.len(), 4096);
    if let Some(peak) = peak_rss() {
        assert!(peak < 3 << 30, "peak RSS {peak} bytes for a 20 MB CSV");
    }
}

#[test]
fn csv_header_over_the_column_limit_is_refused_with_a_message() {
    // A 1.2 MB one-line header of 139k columns reached 2.97 GB; past MAX_COLUMNS the table
    // is refused before anything is built per column, and the message says what to do.
    let cols = stagefs_views::table::MAX_COLUMNS + 7_000;
    let dir = tempfile::tempdir().expect("tmp");
    let header: Vec<String> = (0..cols).map(|c| format!("{c}")).collect();
    std::fs::write(dir.path().join("huge.csv"), header.join(",") + "\n").expect("write");
    let (src, set) = counting(dir.path());
    match set.read_dir(Path::new("huge.csv")) {
        Err(e @ ViewError::Unsupported { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("huge.csv"), "{msg}");
            assert!(msg.contains("more than 131072 columns"), "{msg}");
            assert!(msg.contains("--columns"), "{msg}");
            assert_eq!(e.errno(), 5);
        }
        other => panic!("expected an unsupported-input error, got {other:?}"),
    }
    // Refused once: a second lookup does not read the file again.
    let before = src.reads();
    assert!(set.read_dir(Path::new("huge.csv")).is_err());
    assert_eq!(src.reads(), before);
}

fn write_row_groups(path: &Path, groups: usize, rows_per_group: usize) {
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(rows_per_group))
        .build();
    let mut w = ArrowWriter::try_new(
        File::create(path).expect("create"),
        schema.clone(),
        Some(props),
    )
    .expect("writer");
    let total = groups * rows_per_group;
    let step = 1 << 16;
    for start in (0..total).step_by(step) {
        let end = (start + step).min(total);
        let col: ArrayRef = Arc::new(Int64Array::from_iter_values(
            (start..end).map(|i| i as i64 * 3),
        ));
        w.write(&RecordBatch::try_new(schema.clone(), vec![col]).expect("batch"))
            .expect("write");
    }
    w.close().expect("close");
}

#[test]
fn parquet_of_1e5_row_groups_reads_4k_touching_o1_row_groups() {
    // 10^5 one-row row groups: a 4 KiB read decoded one row group per row and searched a
    // cache list that grew with every group (quadratic: 10^5 groups took 76 s). A read now
    // costs the few blocks it touches, wherever it lands in the file.
    const GROUPS: usize = 100_000;
    let dir = tempfile::tempdir().expect("tmp");
    write_row_groups(&dir.path().join("t.parquet"), GROUPS, 1);
    let (src, set) = counting(dir.path());
    let entries = set.read_dir(Path::new("t.parquet")).expect("listing");
    assert_eq!(entries.len(), 3);
    let opened = src.reads();
    assert!(opened <= 4, "opening read the source {opened} times");
    // Listing and schema again: metadata is cached, no source read, no decode.
    set.read_dir(Path::new("t.parquet")).expect("listing");
    let schema = read_at(&set, "t.parquet/schema.json", 0, 1 << 20);
    assert!(String::from_utf8_lossy(&schema).contains("\"rows\": 100000"));
    assert_eq!(src.reads(), opened);
    let table = set
        .table(Path::new("t.parquet"), TableFormat::Parquet)
        .expect("table");
    assert_eq!(table.work().units_decoded, 0);
    let len = set.open(Path::new("t.parquet/x.npy")).expect("view").len();
    let block_groups = stagefs_views::table::parquet::BLOCK_GROUPS as u64;
    // 4 KiB = 512 rows = 512 row groups at least; a read touches at most 3 blocks of them.
    let bound = 3 * block_groups;
    for offset in [0, len / 2 + 3, len - 4096] {
        let (reads0, work0) = (src.reads(), table.work());
        let got = read_at(&set, "t.parquet/x.npy", offset, 4096);
        assert_eq!(got.len(), 4096);
        let work = table.work();
        let groups = work.units_decoded - work0.units_decoded;
        let blocks = work.blocks_decoded - work0.blocks_decoded;
        let reads = src.reads() - reads0;
        assert!(groups <= bound, "{groups} row groups decoded at {offset}");
        assert!(blocks <= 3, "{blocks} blocks decoded at {offset}");
        assert!(
            reads <= 2 * blocks,
            "{reads} source reads for {blocks} blocks"
        );
        // The values are right: row i holds 3i.
        let header = len - GROUPS as u64 * 8;
        if offset >= header && (offset - header).is_multiple_of(8) {
            let row = (offset - header) / 8;
            let v = i64::from_le_bytes(got[..8].try_into().expect("8"));
            assert_eq!(v, row as i64 * 3);
        }
    }
    // The same read again is served from the rendered-block cache.
    let work0 = table.work();
    read_at(&set, "t.parquet/x.npy", len - 4096, 4096);
    assert_eq!(table.work(), work0);
}

#[test]
fn wide_csv_of_1e4_columns_parses_each_block_once_for_all_column_files() {
    // 10^4 columns: every column file parsed the block's whole text again (10^4 parses of
    // the file; 34 s and 10 GB for a 2 MB file). A block is now decoded for all viewed
    // columns once, counted here as source reads of the block.
    const COLS: usize = 10_000;
    const ROWS: usize = 30;
    let dir = tempfile::tempdir().expect("tmp");
    let mut text: String = (0..COLS).map(|c| format!("c{c},")).collect();
    text.pop();
    text.push('\n');
    for r in 0..ROWS {
        let mut row: String = (0..COLS).map(|c| format!("{},", r * c % 997)).collect();
        row.pop();
        text.push_str(&row);
        text.push('\n');
    }
    std::fs::write(dir.path().join("w.csv"), &text).expect("write");
    let (src, set) = counting(dir.path());
    set.read_dir(Path::new("w.csv")).expect("listing");
    let table = set
        .table(Path::new("w.csv"), TableFormat::Csv)
        .expect("table");
    let blocks = table.blocks() as u64;
    let before = src.reads();
    for c in (0..COLS).step_by(7) {
        let col = read_at(&set, &format!("w.csv/c{c}.npy"), 0, 1 << 16);
        let (_, start) = stagefs_npy::NpyHeader::parse(&col).expect("npy");
        let last = i64::from_le_bytes(col[start + 8 * (ROWS - 1)..][..8].try_into().expect("8"));
        assert_eq!(last, ((ROWS - 1) * c % 997) as i64);
    }
    let reads = src.reads() - before;
    assert!(
        reads <= blocks,
        "{reads} source reads of {blocks} blocks for {} column files",
        COLS.div_ceil(7)
    );
}

#[test]
fn regression_csv_blocks_of_long_fields_held_the_whole_file() {
    // 20 records of a number and a 4 MiB text field (80 MiB): two columns give blocks of
    // 64 Ki records, so the whole file was one block, held whole by the indexing decoder and
    // by every read of a column. Blocks are now cut at MAX_BLOCK_BYTES.
    const ROWS: usize = 20;
    let dir = tempfile::tempdir().expect("tmp");
    let field = "x".repeat(4 << 20);
    let mut text = String::with_capacity(ROWS * (field.len() + 8) + 8);
    text.push_str("n,note\n");
    for r in 0..ROWS {
        text.push_str(&format!("{r},{field}\n"));
    }
    std::fs::write(dir.path().join("long.csv"), &text).expect("write");
    drop(text);
    let (_, set) = counting(dir.path());
    let table = set
        .table(Path::new("long.csv"), TableFormat::Csv)
        .expect("table");
    let max = stagefs_views::table::csv::MAX_BLOCK_BYTES;
    let per_block = (max as usize / field.len()).max(1);
    assert!(
        table.blocks() >= ROWS.div_ceil(per_block),
        "{} blocks for {} MiB of text",
        table.blocks(),
        (ROWS * field.len()) >> 20
    );
    let col = read_at(&set, "long.csv/n.npy", 0, 1 << 20);
    let (h, start) = stagefs_npy::NpyHeader::parse(&col).expect("npy");
    assert_eq!(h.shape, vec![ROWS as u64]);
    let vals: Vec<i64> = col[start..]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8")))
        .collect();
    assert_eq!(vals, (0..ROWS as i64).collect::<Vec<_>>());
}
