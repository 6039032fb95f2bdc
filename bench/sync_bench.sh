#!/usr/bin/env bash
# Sync throughput: `stagefs sync` vs `rsync -a --fsync` (same durability: every file fsynced)
# vs `cp -r` followed by `sync` (no per-file fsync, not crash-safe; the plain-copy baseline),
# on the same generated data, runs alternated A B C A B C (noisy shared VM), destination removed
# and dirty pages flushed before each run. Prints each run and the median ratios.
#
#   bench/sync_bench.sh [ROUNDS] [DIR]      # defaults: 3 rounds, a temp dir under target/
#
# Data (scaled to finish in a few minutes on 2 cores): 8 "checkpoints" of 32 MiB and 2000 small
# files of 4-64 KiB in 20 directories (~340 MB), on the same disk as the destination.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
BASE=${2:-$PWD/target/sync-bench}
# The release build if there is one, else the debug build: the copy runs in the kernel
# (copy_file_range, fsync) and stagefs's own CPU time is ~0.1 s of a 7 s run in either build.
BIN=${STAGEFS_BENCH_BIN:-}
if [ -z "$BIN" ]; then
  BIN=$PWD/target/release/stagefs
  [ -x "$BIN" ] || BIN=$PWD/target/debug/stagefs
fi
[ -x "$BIN" ] || cargo build -p stagefs
echo "stagefs: $BIN"
SRC=$BASE/src
mkdir -p "$BASE"
if [ ! -e "$SRC/.complete" ]; then
  rm -rf "$SRC"
  mkdir -p "$SRC/ckpt"
  for i in $(seq 8); do head -c $((32 << 20)) /dev/urandom >"$SRC/ckpt/model-$i.pt"; done
  python3 - "$SRC" <<'PY'
import os, random, sys
root = sys.argv[1]
rng = random.Random(7)
for i in range(2000):
    d = os.path.join(root, "logs", f"d{i % 20}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i}.json"), "wb") as f:
        f.write(rng.randbytes(rng.randint(4 << 10, 64 << 10)))
PY
  touch "$SRC/.complete"
fi
BYTES=$(du -sb --exclude=.complete "$SRC" | cut -f1)
FILES=$(find "$SRC" -type f | wc -l)
echo "data: $FILES files, $((BYTES / 1000000)) MB in $SRC"

run() { # run NAME -> seconds
  local dst=$BASE/dst
  rm -rf "$dst"
  sync
  local t0 t1
  t0=$(date +%s.%N)
  case $1 in
    stagefs) "$BIN" sync -q "$SRC" "$dst" ;;
    rsync) rsync -a --fsync "$SRC/" "$dst/" ;;
    cp) cp -r "$SRC" "$dst" && sync ;;
  esac
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }' 
}

mbs() { awk -v b="$BYTES" -v s="$1" 'BEGIN { printf "%.1f", b / s / 1e6 }'; }
div() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }
declare -A T
for r in $(seq "$ROUNDS"); do
  for tool in stagefs rsync cp; do
    s=$(run $tool)
    T[$tool]="${T[$tool]:-} $s"
    printf 'round %d %-8s %6.2f s %7.1f MB/s\n' "$r" "$tool" "$s" "$(mbs "$s")"
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ms=$(median <<<"${T[stagefs]}")
mr=$(median <<<"${T[rsync]}")
mc=$(median <<<"${T[cp]}")
printf 'median: stagefs %.2f s (%.0f MB/s), rsync --fsync %.2f s (%.0f MB/s), cp -r + sync %.2f s (%.0f MB/s)\n' \
  "$ms" "$(mbs "$ms")" "$mr" "$(mbs "$mr")" "$mc" "$(mbs "$mc")"
printf 'throughput ratio: stagefs/rsync = %.2fx, stagefs/cp = %.2fx\n' \
  "$(div "$mr" "$ms")" "$(div "$mc" "$ms")"
rm -rf "$BASE/dst"
