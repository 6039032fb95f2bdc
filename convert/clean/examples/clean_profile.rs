//! The benchmark's cleaning job (dropna, `value > 0`, standardize temp,humidity,value; zstd)
//! as a small binary, for profiles and instruction counts without building the whole CLI:
//!
//! `cargo run --release -p stagefs-clean --example clean_profile -- SRC OUT [THREADS] [BUDGET_MIB]`
//!
//! `clean_profile --decode fast|arrow FILE.csv` decodes one whole CSV file with the fast path
//! or the arrow-csv reference path only, to compare the two under `valgrind --tool=callgrind`.

use std::path::PathBuf;

use stagefs_clean::{parse_filter, BadRows, CleanOptions, Codec, Mode, Progress, Selector, Step};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: clean_profile SRC OUT [THREADS] [BUDGET_MIB] | --decode fast|arrow FILE";
    let src = args.next().ok_or(usage)?;
    if src == "--decode" {
        let how = args.next().ok_or(usage)?;
        let file = PathBuf::from(args.next().ok_or(usage)?);
        let input = stagefs_clean::read::open_input(&file, 1 << 30)?;
        let bytes = std::fs::read(&file)?;
        let rows: usize = if how == "fast" {
            stagefs_clean::csv_decode::decode(&input.schema, None, &bytes, true, 65536)
                .ok_or("the fast path declined this file")?
                .iter()
                .map(|b| b.num_rows())
                .sum()
        } else {
            stagefs_clean::read::decode_all(&input.schema, None, &bytes, true, 65536)?
                .iter()
                .map(|b| b.num_rows())
                .sum()
        };
        eprintln!("{how}: {rows} rows");
        return Ok(());
    }
    let out = PathBuf::from(args.next().ok_or(usage)?);
    let threads: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(0);
    let budget: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1024);
    let opts = CleanOptions {
        inputs: vec![src],
        out,
        steps: vec![
            Step::DropNa,
            parse_filter("value > 0")?,
            Step::Standardize(Selector::Columns(vec![
                "temp".into(),
                "humidity".into(),
                "value".into(),
            ])),
        ],
        columns: Vec::new(),
        codec: Codec::Zstd,
        shard: None,
        mode: Mode::Convert,
        bad_rows: BadRows::Error,
        memory_budget: budget << 20,
        threads,
        scratch: None,
    };
    let s = stagefs_clean::run(&opts, &Progress::default())?;
    eprintln!(
        "{} rows read, {} written, {} passes, {} units from pass 1 ({} spilled, {} bytes)",
        s.rows_read, s.rows_written, s.passes, s.cached_units, s.spilled.1, s.spilled.0
    );
    Ok(())
}
