#!/usr/bin/env bash
# Reader-count sweep on a GPU machine (about 2 minutes): how many reader threads the streamer
# (`stagefs stream`) and `stagefs.Loader` need to move a page-cached .npy to the GPU at the
# pinned copy peak. The copy out of the page cache runs on the readers' cores, about 3–4 GB/s
# each on the H200 machine (scripts/gpu-check.sh, 2026-12-04), so the peak (55 GB/s there)
# needs a reader per core; this measures where more stop helping. Uses the binaries that
# scripts/gpu-check.sh uses (target/gpu-bin, or STAGEFS_BIN). Output also in $OUT/gpu-sweep.log.
# Knobs: SIZE_GB=4, GPU=0, STREAM_READERS="8 16 24 32", LOADER_READERS="2 4 8 16" (a count
# given twice, "8 16 8 16", alternates two settings in one run).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE_GB=${SIZE_GB:-4} GPU=${GPU:-0}
STREAM_READERS=${STREAM_READERS:-8 16 24 32} LOADER_READERS=${LOADER_READERS:-2 4 8 16}
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  exec > >(tee "$OUT/gpu-sweep.log") 2>&1
fi
BIN=${STAGEFS_BIN:-$PWD/target/gpu-bin/stagefs}
LOADER_DEVICE=cuda:$GPU
[[ "$GPU" == cpu ]] && LOADER_DEVICE=cpu  # a dry run without a GPU
PYPKG=$PWD/gpu/python/python
[[ -f target/gpu-bin/_native.abi3.so ]] && cp target/gpu-bin/_native.abi3.so "$PYPKG/stagefs/"
brief() {  # the first JSON line on stdin -> GB/s and the device's waiting share
  python3 -c 'import json, sys; j = json.loads(sys.stdin.readline()); print("%.2f GB/s, device waited %.1f %%" % (j["gb_per_s"], 100 * j["device_wait_share"]))'
}
FILE=$(mktemp -d)/sweep.npy
# A uint8 [rows, 1 MiB] .npy; the bytes do not matter for a copy's speed.
python3 -c "import numpy as np, sys; a = np.lib.format.open_memmap(sys.argv[1], mode='w+', dtype=np.uint8, shape=(int(sys.argv[2]) * 1000 * 1000 * 1000 >> 20, 1 << 20)); a[:] = 7; a.flush()" "$FILE" "$SIZE_GB"
cat "$FILE" > /dev/null
echo "cores $(nproc); $(uptime)"
[[ "$GPU" == cpu ]] || "$BIN" stream --bench-peak --device "$GPU" --json
for r in $STREAM_READERS; do
  printf 'stream readers %2d: ' "$r"
  "$BIN" stream "$FILE" --device "$GPU" --epochs 3 --readers "$r" --ring $(( r + 4 )) --json \
    | brief
done
for r in $LOADER_READERS; do
  printf 'Loader readers %2d: ' "$r"
  PYTHONPATH=$PYPKG python3 bench/loader_gpu.py "$FILE" --device "$LOADER_DEVICE" --epochs 3 \
    --readers "$r" --no-verify \
    | brief
done
rm -f "$FILE"
echo "done; $(uptime)"
