#!/usr/bin/env bash
# Builds and runs the libFuzzer targets on the stable toolchain, the way cargo-fuzz does
# (SanitizerCoverage through stable -C flags; no -Z flags, so no nightly and no
# RUSTC_BOOTSTRAP; no AddressSanitizer, which safe Rust rarely needs; overflow checks on).
#
#   fuzz/run.sh build                  build every target (fuzz/target/)
#   fuzz/run.sh seeds                  write the seed corpora to fuzz/corpus/ (generated)
#   fuzz/run.sh run TARGET [ARGS...]   fuzz TARGET on its corpus (libFuzzer ARGS, e.g. -runs=1000000)
#   fuzz/run.sh smoke [SECONDS]        every target for SECONDS (default 5) each, one after another
#   fuzz/run.sh list                   the targets, with the max input length used for each
set -euo pipefail
cd "$(dirname "$0")"
HOST=$(rustc -vV | sed -n 's/^host: //p')
BIN="target/$HOST/release"
TARGETS=(npy_header image_render table_parquet parquet_pages table_csv clean_csv cache_index protocol_request)

# Largest input per target: enough for every structure of its format, small enough that the
# fuzzer spends its time on structure rather than on long bodies.
max_len() {
  case "$1" in
    npy_header) echo 512 ;;
    image_render) echo 4096 ;;
    table_parquet | parquet_pages) echo 4096 ;;
    table_csv | clean_csv) echo 1024 ;;
    cache_index) echo 4096 ;;
    # Past MAX_LINE (64 KiB) so the too-long path is reached, and deep nesting fits.
    protocol_request) echo 70000 ;;
    *) echo "unknown target $1" >&2; return 1 ;;
  esac
}

build() {
  # --target keeps these flags off build scripts and proc macros (as cargo-fuzz does).
  RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks" \
    cargo build --release --target "$HOST" --bins "$@"
}

seeds() {
  [ -x "$BIN/seeds" ] || build
  "$BIN/seeds" corpus
}

run() {
  local t=$1
  shift
  [ -x "$BIN/$t" ] || build
  [ -d "corpus/$t" ] || seeds
  mkdir -p "artifacts/$t"
  # timeout is wall-clock seconds: generous, for a loaded shared machine (a unit that needs
  # seconds of CPU is reported as slow anyway).
  # rss limit: the renderer may legitimately hold a 2^28-pixel image (768 MiB) plus its resize.
  "$BIN/$t" "corpus/$t" -max_len="$(max_len "$t")" -timeout=120 -rss_limit_mb=3072 \
    -artifact_prefix="artifacts/$t/" -print_final_stats=1 "$@"
}

case "${1:-}" in
  build) shift; build "$@" ;;
  seeds) seeds ;;
  run) shift; run "$@" ;;
  smoke)
    secs=${2:-5}
    build
    seeds
    for t in "${TARGETS[@]}"; do run "$t" -max_total_time="$secs" 2>&1 | tail -n 3; done
    ;;
  list) for t in "${TARGETS[@]}"; do echo "$t max_len=$(max_len "$t")"; done ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
