//! The benchmark's cleaning job (dropna, `value > 0`, standardize temp,humidity,value; zstd)
//! as a small binary, for profiles and instruction counts without building the whole CLI:
//!
//! `cargo run --release -p stagefs-clean --example clean_profile -- SRC OUT [THREADS] [BUDGET_MIB]`

use std::path::PathBuf;

use stagefs_clean::{parse_filter, BadRows, CleanOptions, Codec, Mode, Progress, Selector, Step};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: clean_profile SRC OUT [THREADS] [BUDGET_MIB]";
    let src = args.next().ok_or(usage)?;
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
