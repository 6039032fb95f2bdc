#!/usr/bin/env bash
# Device check of the GPU streamer, one command on a machine with an NVIDIA GPU (a few minutes):
#   1. builds stagefs with --features cuda (release), unless STAGEFS_BIN names a binary built
#      elsewhere (a CUDA build needs no CUDA toolkit: libcuda is loaded at run time), and runs
#      the CUDA tests: gpu/tests/cuda.rs (or target/gpu-bin/test-cuda, built elsewhere) and
#      the Loader's pytest files, whose cuda:0 cases need torch with CUDA;
#   2. measures the pinned host-to-device cudaMemcpy peak;
#   3. generates a SIZE_GB (default 4) GB .npy of random bytes on local disk;
#   4. streams it to the GPU from page cache, from disk (evicted first) and, when
#      `stagefs mount` works, through a stagefs mount; checks the device buffers' checksums
#      against the file; prints ratios against the copy peak and against `dd` from disk;
#   5. the same file through the Python package (stagefs.Loader(device="cuda:N"),
#      bench/loader_gpu.py): GB/s against the copy peak, and the share of time a consumer at
#      0.9x the peak waited (with torch: batches checksummed on the device against the file).
#      The extension is built with cargo (no maturin needed) or taken from
#      target/gpu-bin/_native.abi3.so; skipped where python3 is missing.
# Output goes to stdout and, when $OUT is set, to $OUT/gpu-check.log and $OUT/gpu-check.json.
# Knobs: SIZE_GB, GPU=cpu (dry run of the script without a GPU), GPU (default 0), CHECK_DIR (default target/gpu-check, on local disk),
#        EPOCHS_WARM (passes from page cache, default 3), STAGEFS_BIN, KEEP=1 (keep the file).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE_GB=${SIZE_GB:-4}
GPU=${GPU:-0}
CHECK_DIR=${CHECK_DIR:-$PWD/target/gpu-check}
EPOCHS_WARM=${EPOCHS_WARM:-3}
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  exec > >(tee "$OUT/gpu-check.log") 2>&1
fi
say() { printf '\n== %s\n' "$*"; }
mkdir -p "$CHECK_DIR"

say "machine"
date -u
(nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max,memory.total --format=csv 2>/dev/null) || echo "nvidia-smi not available"
nproc; free -g | head -2
df -hT "$CHECK_DIR" | tail -1

say "build (--features cuda, release)"
# A GPU machine may have no crate registry: a binary built elsewhere with --features cuda
# (target/gpu-bin/stagefs, see docs/loader.md#device-check) is used when present.
if [[ -z "${STAGEFS_BIN:-}" && -x target/gpu-bin/stagefs ]]; then STAGEFS_BIN=$PWD/target/gpu-bin/stagefs; fi
if [[ -n "${STAGEFS_BIN:-}" ]]; then
  BIN=$STAGEFS_BIN
  echo "using prebuilt $BIN"
else
  start=$(date +%s)
  if ! CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --features cuda --bin stagefs; then
    echo "build failed (no crate registry here?): build on another machine with"
    echo "  cargo build --release --features cuda --bin stagefs && strip -o target/gpu-bin/stagefs target/release/stagefs"
    echo "and bring target/gpu-bin/stagefs along"
    exit 1
  fi
  echo "built in $(( $(date +%s) - start )) s"
  BIN=$PWD/target/release/stagefs
fi
"$BIN" --version
# The Python package's extension module: a plain cargo build (pyo3's extension-module feature
# needs no libpython), dropped next to the package's Python sources.
PYPKG=$PWD/gpu/python/python
if [[ -f target/gpu-bin/_native.abi3.so ]]; then
  cp target/gpu-bin/_native.abi3.so "$PYPKG/stagefs/_native.abi3.so"
elif command -v python3 >/dev/null && CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release -p stagefs-python; then
  cp target/release/lib_native.so "$PYPKG/stagefs/_native.abi3.so"
fi

say "CUDA tests (gpu/tests/cuda.rs; tests/py/test_loader*.py on cuda:0 with torch)"
# The Rust test binary: built with the streamer (cargo test --release --features cuda -p
# stagefs-gpu --test cuda --no-run), or brought along as target/gpu-bin/test-cuda.
TESTS_OK=1
if [[ -x target/gpu-bin/test-cuda ]]; then
  target/gpu-bin/test-cuda || TESTS_OK=0
else
  CARGO_PROFILE_RELEASE_DEBUG=0 cargo test --release --features cuda -p stagefs-gpu --test cuda || TESTS_OK=0
fi
if [[ "$GPU" != cpu && -f "$PYPKG/stagefs/_native.abi3.so" ]] && python3 -c 'import pytest, numpy' 2>/dev/null; then
  PYTHONPATH=$PYPKG python3 -m pytest -q -p no:cacheprovider tests/py/test_loader.py \
    tests/py/test_loader_augment.py tests/py/test_loader_resume.py 2>&1 | tail -25 || TESTS_OK=0
else
  echo "skipped: needs a GPU, python3 with pytest and numpy, and the built extension"
fi

say "pinned host-to-device copy peak"
PEAK_FLAG=--bench-peak
if [[ "$GPU" == cpu ]]; then
  PEAK_FLAG=   # a dry run of this script on a machine without a GPU
  echo "GPU=cpu: no peak to measure"
else
  PEAK_JSON=$("$BIN" stream --bench-peak --device "$GPU" --json)
  echo "$PEAK_JSON"
  PEAK=$(sed -n 's/.*"peak_h2d_gb_per_s":\([0-9.e+-]*\).*/\1/p' <<<"$PEAK_JSON")
  echo "peak: $PEAK GB/s"
fi

say "generate ${SIZE_GB} GB .npy (uint8 [rows, 1 MiB], random bytes)"
SRC=$CHECK_DIR/src
mkdir -p "$SRC"
FILE=$SRC/check.npy
ROWS=$(( SIZE_GB * 1000 * 1000 * 1000 / 1048576 ))
DICT="{'descr': '|u1', 'fortran_order': False, 'shape': ($ROWS, 1048576), }"
PAD=$(( (64 - (10 + ${#DICT} + 1) % 64) % 64 ))
HLEN=$(( ${#DICT} + PAD + 1 ))
if [[ ! -f "$FILE" || $(stat -c %s "$FILE") -ne $(( 10 + HLEN + ROWS * 1048576 )) ]]; then
  start=$(date +%s)
  {
    printf '\x93NUMPY\x01\x00'
    printf "\\x$(printf %02x $(( HLEN % 256 )))\\x$(printf %02x $(( HLEN / 256 )))"
    printf '%s%*s\n' "$DICT" "$PAD" ""
  } > "$FILE"
  [[ $(stat -c %s "$FILE") -eq $(( 10 + HLEN )) ]] || { echo "header size wrong"; exit 1; }
  # Writers of random bytes in parallel (one per core, up to 8), each filling its share of rows.
  PARTS=$(( $(nproc) < 8 ? $(nproc) : 8 ))
  per=$(( (ROWS + PARTS - 1) / PARTS ))
  pids=()
  for ((i = 0; i < PARTS; i++)); do
    first=$(( i * per )); n=$(( ROWS - first < per ? ROWS - first : per ))
    (( n > 0 )) || continue
    head -c $(( n * 1048576 )) /dev/urandom \
      | dd of="$FILE" bs=1M seek=$(( (10 + HLEN) + first * 1048576 )) oflag=seek_bytes conv=notrunc iflag=fullblock status=none &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  sync "$FILE"
  echo "generated in $(( $(date +%s) - start )) s"
fi
ls -l "$FILE"

run() {  # name, stagefs stream arguments...
  local name=$1; shift
  echo "-- $name: stagefs stream $*" >&2
  local json
  json=$("$BIN" stream "$@" --json)
  echo "$json" >&2
  printf '"%s": %s' "$name" "$json"
}
field() { sed -n "s/.*\"$2\":\([0-9.e+-]*\).*/\1/p" <<<"$1"; }
evict_all() {
  sync
  if [[ $(id -u) -eq 0 ]]; then echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; fi
}

RESULTS=()
say "page cache"
cat "$FILE" > /dev/null
RESULTS+=("$(run page_cache "$FILE" --device "$GPU" --epochs "$EPOCHS_WARM" $PEAK_FLAG)")
for r in 2 4 8 16; do
  RESULTS+=("$(run "page_cache_readers_$r" "$FILE" --device "$GPU" --epochs "$EPOCHS_WARM" --readers "$r" --ring $(( r + 4 )))")
done
# Fed at 0.9x the copy peak from page cache, a job should rarely wait.
if [[ -n "${PEAK:-}" ]]; then
  FEED=$(awk -v p="$PEAK" 'BEGIN { printf "%.3f", 0.9 * p }')
  RESULTS+=("$(run "page_cache_consumer_at_${FEED}GBps" "$FILE" --device "$GPU" --epochs "$EPOCHS_WARM" --consume-gbps "$FEED")")
fi
RESULTS+=("$(run page_cache_shuffled_verify "$FILE" --device "$GPU" --shuffle --seed 1 --verify)")

say "stagefs.Loader (Python) from page cache"
if [[ "$GPU" != cpu && -f "$PYPKG/stagefs/_native.abi3.so" ]] && command -v python3 >/dev/null; then
  while read -r line; do
    [[ "$line" == \{* ]] || continue
    echo "$line"
    name=$(sed -n 's/.*"name":"\([^"]*\)".*/\1/p' <<<"$line")
    RESULTS+=("\"$name\": $line")
  done < <(PYTHONPATH=$PYPKG python3 bench/loader_gpu.py "$FILE" --device "cuda:$GPU" --epochs "$EPOCHS_WARM" --peak-gbps "${PEAK:-0}" 2>&1 | tee /dev/stderr)
else
  echo "skipped: needs a GPU, python3 and the built extension (gpu/python)"
fi

say "local disk"
evict_all
start=$(date +%s.%N)
dd if="$FILE" of=/dev/null bs=16M iflag=direct status=none
DD_GBPS=$(awk -v s="$start" -v e="$(date +%s.%N)" -v b="$(stat -c %s "$FILE")" 'BEGIN { printf "%.3f", b / 1e9 / (e - s) }')
echo "dd iflag=direct bs=16M: $DD_GBPS GB/s"
evict_all
RESULTS+=("$(run disk_cpu_sink "$FILE" --device cpu --cold)")
evict_all
RESULTS+=("$(run disk "$FILE" --device "$GPU" --cold $PEAK_FLAG)")
# Fed at 0.9x the disk rate, a job should rarely wait (issue 6: < 5% of the time).
FEED=$(awk -v d="$DD_GBPS" 'BEGIN { printf "%.3f", 0.9 * d }')
evict_all
RESULTS+=("$(run "disk_consumer_at_${FEED}GBps" "$FILE" --device "$GPU" --cold --consume-gbps "$FEED")")
RESULTS+=("$(run disk_verify "$FILE" --device "$GPU" --cold --verify)")

say "through a stagefs mount"
MNT=$CHECK_DIR/mnt; CACHE=$CHECK_DIR/cache
mkdir -p "$MNT" "$CACHE"
if timeout 60 "$BIN" mount "$SRC" "$MNT" --cache "$CACHE" 2>"$CHECK_DIR/mount.err"; then
  evict_all
  RESULTS+=("$(run mount_first_read "$MNT/check.npy" --device "$GPU" --verify)" ) || true
  RESULTS+=("$(run mount_second_read "$MNT/check.npy" --device "$GPU" $PEAK_FLAG)") || true
  "$BIN" umount "$MNT" || fusermount3 -u "$MNT" || umount "$MNT" || true
else
  echo "skipped: stagefs mount failed: $(head -c 300 "$CHECK_DIR/mount.err")"
fi

say "summary"
JSON="{\"peak_h2d_gb_per_s\": ${PEAK:-null}, \"dd_direct_gb_per_s\": $DD_GBPS, \"size_gb\": $SIZE_GB, $(IFS=,; echo "${RESULTS[*]}")}"
[[ -n "${OUT:-}" ]] && echo "$JSON" > "$OUT/gpu-check.json"
status=0
for r in "${RESULTS[@]}"; do
  name=${r%%\":*}; name=${name#\"}
  gbps=$(field "$r" gb_per_s); wait_share=$(field "$r" device_wait_share)
  mism=$(sed -n 's/.*"verify_mismatches":\[\(.*\)\].*/\1/p' <<<"$r")
  [[ "$r" =~ \"verify_mismatches\":([1-9][0-9]*) ]] && mism=${BASH_REMATCH[1]}
  verified=$(field "$r" verified_batches)
  line=$(awk -v n="$name" -v g="$gbps" -v p="${PEAK:-0}" -v d="$DD_GBPS" -v w="$wait_share" \
    'BEGIN { printf "%-28s %7.2f GB/s  %5.2fx peak  %5.2fx dd  device waited %5.1f%%", n, g, (p > 0 ? g / p : 0), (d > 0 ? g / d : 0), 100 * w }')
  [[ -n "$verified" ]] && line+="  verified $verified batches"
  if [[ -n "$mism" ]]; then line+="  CHECKSUM MISMATCH"; status=1; fi
  echo "$line"
done
echo "targets (issue 6): >= 0.9x peak from page cache; >= 0.9x dd from disk with the device waiting < 5%"
echo "targets (issue 11): loader >= 0.9x peak; consumer at 0.9x peak waiting < 5%"
[[ "${KEEP:-0}" == 1 ]] || rm -f "$FILE"
if [[ $TESTS_OK == 0 ]]; then echo "CUDA TESTS FAILED (above)"; status=1; fi
exit $status
