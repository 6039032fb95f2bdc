//! When scratch cannot take the spill, the job still finishes with the same result: the units
//! pass 1 could not keep are read and parsed again in pass 2.

use std::io::Write;
use std::path::Path;

use stagefs_clean::{parse_filter, BadRows, CleanOptions, Codec, Mode, Progress, Selector, Step};

fn options(src: &Path, out: &Path, scratch: &Path) -> CleanOptions {
    CleanOptions {
        inputs: vec![src.display().to_string()],
        out: out.to_path_buf(),
        steps: vec![
            Step::DropNa,
            parse_filter("x > 0").expect("filter"),
            Step::Standardize(Selector::Numeric),
        ],
        columns: Vec::new(),
        codec: Codec::Snappy,
        shard: None,
        mode: Mode::Convert,
        bad_rows: BadRows::Error,
        memory_budget: 64 << 20,
        threads: 2,
        scratch: Some(scratch.to_path_buf()),
    }
}

#[test]
fn unwritable_scratch_falls_back_to_reparsing_with_the_same_result() {
    let dir = tempfile::tempdir().expect("tmp");
    let src = dir.path().join("t.csv");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&src).expect("create"));
    writeln!(f, "x,y").expect("write");
    for i in 0..3_000_000u64 {
        // ~57 MB; kept rows (~34 MiB of Arrow) well past the 19 MiB the 64 MiB budget keeps in memory.
        writeln!(f, "{}.25,{}", (i % 1000) as i64 - 300, i).expect("write");
    }
    drop(f);
    let good = dir.path().join("scratch");
    std::fs::create_dir(&good).expect("mkdir");
    // A regular file where the scratch directory should be: every spill fails.
    let bad = dir.path().join("not-a-dir");
    std::fs::write(&bad, b"").expect("file");

    let out_a = dir.path().join("a");
    let a = stagefs_clean::run(&options(&src, &out_a, &good), &Progress::default()).expect("a");
    assert!(a.spilled.1 > 0, "the normal run spills: {:?}", a.spilled);
    let out_b = dir.path().join("b");
    let b = stagefs_clean::run(&options(&src, &out_b, &bad), &Progress::default()).expect("b");
    assert_eq!(b.spilled, (0, 0));
    assert!(
        b.cached_units < a.cached_units,
        "{} vs {}",
        b.cached_units,
        a.cached_units
    );
    assert_eq!(a.rows_written, b.rows_written);
    assert_eq!(a.stats, b.stats);
    let bytes = |p: &Path| std::fs::read(p.join("part.0.parquet")).expect("part");
    assert_eq!(bytes(&out_a), bytes(&out_b), "same output, byte for byte");
    assert_eq!(std::fs::read_dir(&good).expect("scratch").count(), 0);
}
