//! The cleaning job's CSV row reader (stagefs-clean `read`): schema inference, record-aligned
//! chunking (small chunks, so quotes and long records cross chunk edges) and decoding of every
//! chunk, both with `--bad-rows error` and `--bad-rows skip`. The reader works on paths, so each
//! input is written to one scratch file (on tmpfs when there is one).
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use stagefs_clean::read::{
    csv_chunks, decode_csv, open_input, unify_schemas, BufferPool, Kind, Span,
};
use stagefs_clean::BadRows;
use stagefs_fuzz::count_only_escaping_panics;

/// Bytes per chunk: small, so that a 1 KiB input is cut a few times (quotes and long records
/// cross chunk edges), yet not so small that building a decoder per chunk dominates each run.
const CHUNK: usize = 256;

fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("stagefs-fuzz-clean-{}.csv", std::process::id()))
    })
}

fuzz_target!(init: count_only_escaping_panics(), |data: &[u8]| {
    // Parquet input is the footer reader's business, not the CSV reader's.
    if data.starts_with(b"PAR1") {
        return;
    }
    let path = scratch();
    std::fs::write(path, data).expect("write scratch file");
    let Ok(input) = open_input(path, 1 << 20) else { return };
    assert_eq!(input.kind, Kind::Csv);
    let Ok(schema) = unify_schemas(std::slice::from_ref(&input)) else {
        return;
    };
    // Records up to 1 KiB: longer ones fail the run with file and line (the bound is tested
    // in the crate; here it keeps a record inside the fuzzer's input size).
    let pool = BufferPool::default();
    let _ = csv_chunks(path, CHUNK, 1 << 10, &pool, |span, bytes| {
        if let Span::Csv { offset, header, .. } = span {
            for mode in [BadRows::Error, BadRows::Skip] {
                let _ = decode_csv(path, &schema, None, &bytes, offset, header, mode);
            }
        }
        Ok(())
    });
});
