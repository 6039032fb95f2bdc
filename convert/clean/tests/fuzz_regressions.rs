//! Inputs found by fuzzing (`fuzz/`, target `table_parquet`) that crashed the cleaning job,
//! stored as bytes (`tests/fuzz-corpus/`: a mutated footer cannot be rebuilt through the
//! writer's API). Each must fail the run with a named error, never panic.
#![allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)

use std::path::Path;

use stagefs_clean::read::{decode_parquet, open_input, parquet_spans, Span};

/// Dictionary-encoded pages without a dictionary page: the parquet crate panics ("Decoder for
/// dict should have been set"), which killed `stagefs convert --to parquet` (exit 101).
#[test]
fn parquet_dictionary_page_missing_fails_the_unit_not_the_process() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-corpus/parquet_dictionary_page_missing.parquet");
    // The record bound only matters for CSV input.
    let input = open_input(&path, 1 << 20).unwrap();
    let all: Vec<usize> = (0..input.schema.fields().len()).collect();
    let mut errors = Vec::new();
    for span in parquet_spans(&input, 1 << 20) {
        if let Span::Parquet { rg, skip, take, .. } = span {
            if let Err(e) = decode_parquet(&input, rg, skip, take, &all, &input.schema) {
                errors.push(e.to_string());
            }
        }
    }
    // The page scan (stagefs-parquet-bounds) now refuses this file's malformed page headers
    // before the parquet crate decodes, where it panicked; either way the unit fails, named.
    assert!(!errors.is_empty(), "a corrupt file decoded: {errors:?}");
    assert!(errors
        .iter()
        .all(|e| e.contains("parquet_dictionary_page_missing")));
}
