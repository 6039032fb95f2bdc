#!/usr/bin/env bash
# The metadata snapshot at ImageNet scale (issue 9): listing a 1.28 M-file tree with
# `stagefs index` against `find` (names only, and with a stat per entry, which is what the
# snapshot needs), then loading the index (`stagefs index --check`: what a remount with
# --index pays), with memory per file. Rounds alternate A B C D, so load drifts hit all alike.
#
# Usage: bench/snapshot_scale.sh [TREE] [ROUNDS]
#   TREE    generated once if missing (default /var/tmp/stagefs-1m: 1000 dirs x 1280 sparse files)
#   ROUNDS  default 5
#   env BIN=path/to/stagefs (default target/release/stagefs, built if missing),
#       THREADS=N (--threads of stagefs index, default 64),
#       DROP=1 to drop the page cache before every run (root; otherwise all runs are warm).
set -euo pipefail
cd "$(dirname "$0")/.."
TREE=${1:-/var/tmp/stagefs-1m}
ROUNDS=${2:-5}
BIN=${BIN:-target/release/stagefs}
THREADS=${THREADS:-64}
OUT=$(mktemp -d /var/tmp/stagefs-bench.XXXXXX)
trap 'rm -rf "$OUT"' EXIT

python3 bench/gen_tree.py "$TREE"
[ -x "$BIN" ] || cargo build --release -p stagefs
INDEX="$OUT/tree.stagefs-index"

drop() {
    if [ "${DROP:-0}" = 1 ]; then sync; echo 3 > /proc/sys/vm/drop_caches; fi
}

# run NAME CMD...: appends "NAME wall_s maxrss_kb user_s sys_s" to $OUT/runs.
run() {
    local name=$1; shift
    drop
    /usr/bin/time -f "$name %e %M %U %S" -a -o "$OUT/runs" "$@" > /dev/null 2>> "$OUT/log"
}

echo "load before: $(uptime)"
"$BIN" index "$TREE" -o "$INDEX" -q --threads "$THREADS"   # warm-up (and the file C loads)
for r in $(seq "$ROUNDS"); do
    run find-names find "$TREE"
    run find-stat find "$TREE" -printf '%s %T@ %m %U %G\n'
    run index "$BIN" index "$TREE" -o "$INDEX" -q --threads "$THREADS"
    run load "$BIN" index --check "$INDEX"
done
echo "load after:  $(uptime)"
"$BIN" index --check "$INDEX" | tee -a "$OUT/log"
"$BIN" index "$TREE" -o "$INDEX" --threads "$THREADS" 2>&1 | tail -1

python3 - "$OUT/runs" "$(find "$TREE" | wc -l)" <<'EOF'
import statistics, sys
runs, entries = {}, int(sys.argv[2])
for line in open(sys.argv[1]):
    name, wall, rss, user, sys_ = line.split()
    runs.setdefault(name, []).append((float(wall), int(rss), float(user) + float(sys_)))
# Floored at 10 ms: `time` rounds tiny runs to 0.
med = lambda name, i: max(statistics.median(r[i] for r in runs[name]), 0.01)
print(f"\n{entries} entries, {len(runs['index'])} rounds, medians (warm page cache unless DROP=1)")
print(f"{'run':<12}{'wall s':>8}{'min s':>7}{'vs find -printf':>16}{'vs find':>9}"
      f"{'CPU s':>7}{'CPU vs printf':>14}{'max RSS MB':>11}{'B/entry':>9}")
for name in ["find-names", "find-stat", "index", "load"]:
    rss = max(r[1] for r in runs[name]) * 1024
    wall = med(name, 0)
    print(f"{name:<12}{wall:>8.2f}{min(r[0] for r in runs[name]):>7.2f}"
          f"{wall / med('find-stat', 0):>16.2f}{wall / med('find-names', 0):>9.2f}"
          f"{med(name, 2):>7.2f}{med(name, 2) / med('find-stat', 2):>14.2f}"
          f"{rss / 1e6:>11.0f}{rss / entries:>9.0f}")
EOF
