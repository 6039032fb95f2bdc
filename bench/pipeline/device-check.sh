#!/usr/bin/env bash
# One-command device check of the tensor stage, on a machine with an NVIDIA GPU:
#   1. scripts/gpu-check.sh (CUDA build and tests, copy peak, stagefs stream and the Loader on
#      the device; SIZE_GB=1 here unless set, to leave time for step 2);
#   2. the pipeline benchmark (bench/pipeline/run.py) at N JPEGs (default 2000; generated once
#      into DATA, default target/pipeline-data), with its real CUDA training step, DALI when
#      `nvidia.dali` imports, the mount contenders when `stagefs mount` works (--mount);
#      prints the table and leaves pipeline.md + pipeline.png in $OUT (or DATA-out).
# Python needs numpy, pillow, torch (with CUDA), torchvision and matplotlib; PYTHON picks the
# interpreter (default: .venv/bin/python if present, else python3). What is missing is said,
# and that step is skipped, never faked. Knobs: N, DATA, ROUNDS (2), CORES (1,2,all),
# STEP_MS (50), IMAGES (timed per measurement, 1280), SKIP_GPU_CHECK=1, STAGEFS_BIN (a release
# binary built elsewhere). Without a GPU (SKIP_GPU_CHECK=1) it runs too, with a CPU-sleep step.
set -uo pipefail
cd "$(dirname "$0")/../.."
N=${N:-2000}
DATA=${DATA:-$PWD/target/pipeline-data}
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
say() { printf '\n== %s\n' "$*"; }
status=0

if [[ "${SKIP_GPU_CHECK:-0}" != 1 ]]; then
  say "scripts/gpu-check.sh"
  SIZE_GB=${SIZE_GB:-1} bash scripts/gpu-check.sh || { status=1; echo "gpu-check.sh failed"; }
fi

say "pipeline benchmark ($N JPEGs)"
missing=$("$PYTHON" - <<'PY'
import importlib
need = ["numpy", "PIL", "torch", "torchvision", "matplotlib", "stagefs"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
if [[ -n "$missing" ]]; then
  echo "skipped: $PYTHON lacks: $missing (install them, or set PYTHON)"
  exit $status
fi
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
BIN=${STAGEFS_BIN:-}
if [[ -z "$BIN" ]]; then
  BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/stagefs
  [[ -x "$BIN" ]] || cargo build --release --bin stagefs || { echo "cannot build stagefs"; exit 1; }
fi
"$PYTHON" bench/pipeline/gen.py "$DATA" --n "$N" || exit 1
mount_flag=()
probe=$(mktemp -d)
mkdir -p "$probe/src" "$probe/mnt"
if "$BIN" mount "$probe/src" "$probe/mnt" --cache "$probe/cache" >/dev/null 2>&1; then
  "$BIN" umount "$probe/mnt" >/dev/null 2>&1
  mount_flag=(--mount)
else
  echo "stagefs mount does not work here (no /dev/fuse?): seed-mount skipped, the Loader reads a converted view"
fi
rm -rf "$probe"
out=${OUT:-$DATA-out}
"$PYTHON" bench/pipeline/run.py "$DATA" "${mount_flag[@]}" --stagefs "$BIN" --out "$out" \
  --rounds "${ROUNDS:-2}" --cores "${CORES:-1,2,all}" --step-ms "${STEP_MS:-50}" \
  --images "${IMAGES:-1280}" || status=1
cat /proc/loadavg
exit $status
