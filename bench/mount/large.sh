#!/usr/bin/env bash
# Large files on a normal user's mount vs a local copy on the same scratch (issue 20).
# Run as root on a quiet machine (record the load it prints); every mount and epoch runs as
# BENCH_USER through setpriv, as an HPC user would (fusermount3, no passthrough).
#
#   bench/mount/large.sh [MOUNT ARGS...]     e.g. --direct-io, --no-push
#
# Scratch: ext4 on a loop device over a sparse file in a tmpfs (RAM-backed, droppable page
# cache), as bench/mount/run.sh sets it up. Data: FILES x MB (default 8 x 256 MB), random. The
# source is a plain directory: warm epochs never touch it. Per mode (seq, shuf, mmap) and round,
# alternated: drop caches, local epoch; drop caches, stagefs epoch; then one more epoch each
# without dropping caches. CPU seconds count the reader and, for stagefs, the daemon
# (/proc/PID/stat utime+stime), reported per GB read.
# Knobs: WORK=/var/tmp/stagefs-large, STAGEFS=target/release/stagefs, BENCH_USER=stagefs-test,
# FILES=8, MB=256, ROUNDS=2, MODES="seq shuf mmap".
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-/var/tmp/stagefs-large}
STAGEFS=${STAGEFS:-$REPO/target/release/stagefs}
BENCH_USER=${BENCH_USER:-stagefs-test}
FILES=${FILES:-8} MB=${MB:-256} ROUNDS=${ROUNDS:-2} MODES=${MODES:-seq shuf mmap}
[[ $(id -u) -eq 0 ]] || { echo "run as root (drop_caches, loop devices)" >&2; exit 1; }
uid=$(id -u "$BENCH_USER")
as_user() { setpriv --reuid="$uid" --regid="$uid" --clear-groups env HOME=/tmp "$@"; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
load() { cut -d' ' -f1 /proc/loadavg; }

gb=$(python3 -c "print($FILES * $MB / 1000)")
mkdir -p "$WORK/ram" "$WORK/scratch" "$WORK/src" "$WORK/bin"
mountpoint -q "$WORK/ram" || mount -t tmpfs -o size=$(( FILES * MB * 3 / 1000 + 2 ))g tmpfs "$WORK/ram"
if ! mountpoint -q "$WORK/scratch"; then
  truncate -s $(( FILES * MB * 5 / 2 ))M "$WORK/ram/scratch.img"
  mkfs.ext4 -q -F "$WORK/ram/scratch.img"
  mount -o loop,discard "$WORK/ram/scratch.img" "$WORK/scratch"
fi
for i in $(seq 0 $((FILES - 1))); do
  [[ -s "$WORK/src/f$i.bin" ]] || head -c "${MB}M" /dev/urandom > "$WORK/src/f$i.bin"
done
chmod -R a+rX "$WORK/src"
U="$WORK/scratch/u"; mkdir -p "$U/local" "$WORK/mnt"
cp -u "$WORK/src"/f*.bin "$U/local/"
chown -R "$BENCH_USER:" "$U" "$WORK/mnt"; chmod 700 "$U"
install -m 0755 "$STAGEFS" "$WORK/bin/stagefs"; install -m 0644 "$HERE/large_reader.py" "$WORK/bin/"
BIN=$WORK/bin/stagefs MNT=$WORK/mnt
as_user "$BIN" umount "$MNT" 2>/dev/null || true
rm -rf "$U/cache"
echo "# stagefs $(git -C "$REPO" rev-parse --short HEAD), mount args: ${*:-(defaults)}, $FILES x $MB MB, $(nproc) cores, load $(load)"
as_user "$BIN" mount "$WORK/src" "$MNT" --cache "$U/cache" --cache-size $(( FILES * MB * 2 ))M "$@"
pid=$(as_user cat "$MNT/.stagefs/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
cpu_of() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }
as_user python3 "$WORK/bin/large_reader.py" "$MNT" seq >/dev/null   # epoch 1 fills the cache
for _ in $(seq 1 120); do
  as_user cat "$MNT/.stagefs/stats" | grep -q "\"files_staged\":$FILES" && break; sleep 1
done
epoch() {  # DIR MODE -> "seconds cpu"
  local d0 d1 out
  d0=$(cpu_of "$pid")
  out=$(as_user python3 "$WORK/bin/large_reader.py" "$1" "$2")
  d1=$(cpu_of "$pid")
  if [[ "$1" == "$MNT" ]]; then
    python3 -c "w,c='$out'.split(); print(w, round(float(c) + $d1 - $d0, 2))"
  else
    echo "$out"
  fi
}
printf '| mode | caches | local s | stagefs s | ratio (local/stagefs) | CPU-s/GB local | CPU-s/GB stagefs | load |\n|---|---|---|---|---|---|---|---|\n'
for mode in $MODES; do
  for r in $(seq 1 "$ROUNDS"); do
    drop; read -r lw lc <<<"$(epoch "$U/local" "$mode")"
    drop; read -r sw sc <<<"$(epoch "$MNT" "$mode")"
    python3 -c "print(f'| $mode | dropped | $lw | $sw | {$lw/$sw:.2f} | {$lc/$gb:.2f} | {$sc/$gb:.2f} | $(load) |')"
  done
  # Without dropping caches: each side's second epoch in a row (the first warms its page cache).
  epoch "$U/local" "$mode" >/dev/null; read -r lw lc <<<"$(epoch "$U/local" "$mode")"
  epoch "$MNT" "$mode" >/dev/null; read -r sw sc <<<"$(epoch "$MNT" "$mode")"
  python3 -c "print(f'| $mode | kept | $lw | $sw | {$lw/$sw:.2f} | {$lc/$gb:.2f} | {$sc/$gb:.2f} | $(load) |')"
done
as_user cat "$MNT/.stagefs/stats" | python3 -c 'import json,sys; s=json.load(sys.stdin); print("# stats:", {k: s[k] for k in ("reads","bytes_pushed","bytes_from_cache","replies_dropped")})'
as_user "$BIN" umount "$MNT"
echo "# done, load $(load)"
