#!/usr/bin/env bash
# Large files on a normal user's mount vs a local copy on the same scratch (issue 20).
# Run as root on a quiet machine (record the load it prints); every mount and epoch runs as
# BENCH_USER through setpriv, as an HPC user would (fusermount3, no passthrough).
#
#   bench/mount/large.sh [MOUNT ARGS...]     e.g. --direct-io, --no-push
#   B="--buffered-scratch" bench/mount/large.sh  # a second mount (B) with other arguments,
#                                               # alternated with the first in every round
#
# Scratch: ext4 on a loop device over a sparse file in a tmpfs (RAM-backed, droppable page
# cache), as bench/mount/run.sh sets it up. Data: FILES x MB (default 8 x 256 MB), random. The
# source is a plain directory: warm epochs never touch it. Per mode (seq, shuf, mmap) and round,
# alternated: drop caches, local epoch; drop caches, stagefs epoch; then one more epoch each
# without dropping caches. CPU seconds count the reader and, for stagefs, the daemon
# (/proc/PID/stat utime+stime), reported per GB read.
# Mode `small` is the same figure for small files: SMALL_FILES x SMALL_KB (default 10,000 x
# 100 KB in 100 folders, under src/small), shuffled, read whole by 8 threads.
# Knobs: WORK=/var/tmp/stagefs-large, STAGEFS=target/release/stagefs, BENCH_USER=stagefs-test,
# FILES=8, MB=256, SMALL_FILES=10000, SMALL_KB=100, ROUNDS=2, MODES="seq shuf mmap small",
# B (mount arguments of a second mount).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-/var/tmp/stagefs-large}
STAGEFS=${STAGEFS:-$REPO/target/release/stagefs}
BENCH_USER=${BENCH_USER:-stagefs-test}
FILES=${FILES:-8} MB=${MB:-256} ROUNDS=${ROUNDS:-2} MODES=${MODES:-seq shuf mmap small} B=${B-}
SMALL_FILES=${SMALL_FILES:-10000} SMALL_KB=${SMALL_KB:-100}
[[ $(id -u) -eq 0 ]] || { echo "run as root (drop_caches, loop devices)" >&2; exit 1; }
uid=$(id -u "$BENCH_USER")
as_user() { setpriv --reuid="$uid" --regid="$uid" --clear-groups env HOME=/tmp "$@"; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
load() { cut -d' ' -f1 /proc/loadavg; }

gb=$(python3 -c "print($FILES * $MB / 1000)")
small_gb=$(python3 -c "print($SMALL_FILES * $SMALL_KB / 1e6)")
data_mb=$(( FILES * MB + SMALL_FILES * SMALL_KB / 1000 ))
mkdir -p "$WORK/ram" "$WORK/scratch" "$WORK/src" "$WORK/bin"
# Scratch holds the local copy and one or two caches.
mountpoint -q "$WORK/ram" || mount -t tmpfs -o size=$(( data_mb * 9 / 2000 + 2 ))g tmpfs "$WORK/ram"
if ! mountpoint -q "$WORK/scratch"; then
  truncate -s $(( data_mb * 4 ))M "$WORK/ram/scratch.img"
  mkfs.ext4 -q -F "$WORK/ram/scratch.img"
  mount -o loop,discard "$WORK/ram/scratch.img" "$WORK/scratch"
fi
for i in $(seq 0 $((FILES - 1))); do
  [[ -s "$WORK/src/f$i.bin" ]] || head -c "${MB}M" /dev/urandom > "$WORK/src/f$i.bin"
done
if [[ " $MODES " == *" small "* && ! -f "$WORK/src/small/.done-$SMALL_FILES-$SMALL_KB" ]]; then
  rm -rf "$WORK/src/small" "$WORK/scratch/u/local/small"
  python3 - "$WORK/src/small" "$SMALL_FILES" "$SMALL_KB" <<'PY'
import os, sys
root, n, kb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    d = os.path.join(root, f"c{i % 100:03d}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"s{i:06d}.jpg"), "wb") as f:
        f.write(os.urandom(kb * 1000))
PY
  touch "$WORK/src/small/.done-$SMALL_FILES-$SMALL_KB"
fi
chmod -R a+rX "$WORK/src"
U="$WORK/scratch/u"; mkdir -p "$U/local" "$WORK/mnt" "$WORK/mnt-b"
cp -u "$WORK/src"/f*.bin "$U/local/"
[[ -d "$WORK/src/small" ]] && cp -ru "$WORK/src/small" "$U/local/"
chown -R "$BENCH_USER:" "$U" "$WORK/mnt" "$WORK/mnt-b"; chmod 700 "$U"
install -m 0755 "$STAGEFS" "$WORK/bin/stagefs"; install -m 0644 "$HERE/large_reader.py" "$WORK/bin/"
BIN=$WORK/bin/stagefs
for m in "$WORK/mnt" "$WORK/mnt-b"; do as_user "$BIN" umount "$m" 2>/dev/null || true; done
rm -rf "$U/cache" "$U/cache-b"
echo "# stagefs $(git -C "$REPO" rev-parse --short HEAD), A: ${*:-(defaults)}${B:+, B: $B}, $FILES x $MB MB, $(nproc) cores, load $(load)"
cpu_of() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }
declare -A PID
start() {  # MNT CACHE ARGS...: mount, fill the cache (epoch 1), wait for staging to finish
  local mnt=$1 cache=$2; shift 2
  as_user "$BIN" mount "$WORK/src" "$mnt" --cache "$cache" --cache-size $(( data_mb * 2 ))M "$@"
  PID[$mnt]=$(as_user cat "$mnt/.stagefs/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
  as_user python3 "$WORK/bin/large_reader.py" "$mnt" seq >/dev/null
  local want=$FILES
  if [[ -d "$WORK/src/small" ]]; then
    as_user python3 "$WORK/bin/large_reader.py" "$mnt" small >/dev/null
    want=$(( FILES + $(find "$WORK/src/small" -type f -name '*.jpg' | wc -l) ))
  fi
  for _ in $(seq 1 120); do
    as_user cat "$mnt/.stagefs/stats" | python3 -c "import json,sys; sys.exit(json.load(sys.stdin)['files_staged'] < $want)" && break
    sleep 1
  done
}
SIDES=("$U/local" "$WORK/mnt")
start "$WORK/mnt" "$U/cache" "$@"
if [[ -n "$B" ]]; then
  # shellcheck disable=SC2086 # B is a list of arguments
  start "$WORK/mnt-b" "$U/cache-b" $B
  SIDES+=("$WORK/mnt-b")
fi
epoch() {  # DIR MODE -> "seconds cpu" (the reader's CPU, plus the daemon's for a mount)
  local d0=0 d1=0 out
  [[ -n "${PID[$1]-}" ]] && d0=$(cpu_of "${PID[$1]}")
  out=$(as_user python3 "$WORK/bin/large_reader.py" "$1" "$2")
  [[ -n "${PID[$1]-}" ]] && d1=$(cpu_of "${PID[$1]}")
  python3 -c "w,c='$out'.split(); print(w, round(float(c) + $d1 - $d0, 2))"
}
row() {  # MODE CACHES "s c" per side -> a table row: seconds, local÷side, CPU-s/GB
  local g=$gb
  [[ $1 == small ]] && g=$small_gb
  python3 - "$@" "$g" "$(load)" <<'PY'
import sys
mode, caches, *sides, gb, load = sys.argv[1:]
w = [float(x.split()[0]) for x in sides]
c = [float(x.split()[1]) for x in sides]
cells = [mode, caches] + [f"{x:.3f}" for x in w] + [f"{w[0] / x:.2f}" for x in w[1:]]
cells += [f"{x / float(gb):.2f}" for x in c] + [load]
print("| " + " | ".join(cells) + " |")
PY
}
if [[ -n "$B" ]]; then
  printf '| mode | caches | local s | A s | B s | A ÷ local speed | B ÷ local speed | CPU-s/GB local | A | B | load |\n|---|---|---|---|---|---|---|---|---|---|---|\n'
else
  printf '| mode | caches | local s | stagefs s | stagefs ÷ local speed | CPU-s/GB local | CPU-s/GB stagefs | load |\n|---|---|---|---|---|---|---|---|\n'
fi
for mode in $MODES; do
  for _ in $(seq 1 "$ROUNDS"); do
    got=()
    for side in "${SIDES[@]}"; do drop; got+=("$(epoch "$side" "$mode")"); done
    row "$mode" dropped "${got[@]}"
  done
  # Without dropping caches: each side's second epoch in a row (the first warms its page cache).
  got=()
  for side in "${SIDES[@]}"; do epoch "$side" "$mode" >/dev/null; got+=("$(epoch "$side" "$mode")"); done
  row "$mode" kept "${got[@]}"
done
for side in "${SIDES[@]:1}"; do
  as_user cat "$side/.stagefs/stats" | python3 -c 'import json,sys; s=json.load(sys.stdin); print("# stats '"$side"':", {k: s[k] for k in ("reads","bytes_pushed","bytes_from_cache","replies_dropped")})'
  as_user "$BIN" umount "$side"
done
echo "# done, load $(load)"
