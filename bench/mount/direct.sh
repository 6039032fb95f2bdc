#!/usr/bin/env bash
# Direct reads past FUSE (`stagefs run`'s preload library) against a local copy on the same
# scratch and against the same mount read through FUSE (`stagefs run --no-direct`), as a normal
# user, on two kinds of scratch:
#   disk  a directory on the machine's own disk (this VM's reads ~1 GB/s: a node-local NVMe);
#   nvme  ext4 on a loop device over a tmpfs, every read and write of it throttled to NVME_MBS
#         (1000) MB/s by a blkio cgroup the epochs run in: the seed's node-local NVMe, whose
#         page cache drop_caches empties (this VM's disk is cached by its host: re-reads of it
#         run at 3-8 GB/s);
#   ram   the same without the throttle (RAM-backed, 4-8 GB/s; what bench/mount/large.sh uses).
# Run as root on a quiet machine (it prints the load); every epoch runs as BENCH_USER through
# setpriv, and the page cache is dropped before each. Per scratch: epoch 1 from a fresh cache
# under `stagefs run` (staging the files), then ROUNDS rounds of, per mode, local / direct /
# FUSE alternated, and rclone's cached mount where rclone is installed. Each mount side is one `stagefs run --mount SRC:MNT:CACHE -- ...` (the cache
# is kept between runs, as a later job reuses it). CPU seconds count the reader and the daemon.
#
#   bench/mount/direct.sh
# Mode `rows`: a shuffled stagefs.Loader epoch over rows.npy (ROWS_MB of 64 KiB rows) on the
# mount (direct, with its posix_fadvise ahead) and on the local copy (no read-ahead: the
# same order, read as it comes); the page cache is dropped after the Loader is made (a remount's
# verification is in the constructor) and before the timed epoch; needs PY, a python with
# numpy and stagefs.
# Knobs: WORK=/var/tmp/stagefs-direct, STAGEFS=target/release/stagefs, BENCH_USER=stagefs-test,
# FILES=8, MB=256, ROWS_MB=2048, ROUNDS=2, MODES="seq shuf mmap rows",
# SCRATCHES="disk nvme ram", NVME_MBS=1000, RCLONE (rclone's path; empty: no rclone side),
# PY=.venv/bin/python.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-/var/tmp/stagefs-direct}
STAGEFS=${STAGEFS:-$REPO/target/release/stagefs}
BENCH_USER=${BENCH_USER:-stagefs-test}
FILES=${FILES:-8} MB=${MB:-256} ROUNDS=${ROUNDS:-2} MODES=${MODES:-seq shuf mmap rows}
ROWS_MB=${ROWS_MB:-2048} PY=${PY:-$REPO/.venv/bin/python} NVME_MBS=${NVME_MBS:-1000}
SCRATCHES=${SCRATCHES:-disk nvme ram}
[[ $(id -u) -eq 0 ]] || { echo "run as root (drop_caches, loop devices, setpriv)" >&2; exit 1; }
uid=$(id -u "$BENCH_USER")
# shellcheck source=bench/mount/scratch.sh
source "$HERE/scratch.sh"
cpu_of() { awk -v t="$(getconf CLK_TCK)" '{ print ($14 + $15) / t }' "/proc/$1/stat"; }
# rclone's cached mount (`--vfs-cache-mode full`), the peer a cluster user would pick, where
# installed (Debian: apt-get install rclone); RCLONE= leaves it out.
RCLONE=${RCLONE-$(command -v rclone || true)}
load() { cut -d' ' -f1 /proc/loadavg; }
gb=$(python3 -c "print($FILES * $MB / 1000)")
# Mode rows drops the page cache between making its Loader and its epoch: it asks by creating
# this file (readable by the user), which the loop below removes once the cache is dropped.
mkdir -p "$WORK/req" && chown "$uid:$uid" "$WORK/req"
export STAGEFS_BENCH_DROP=$WORK/req/drop
rows_gb=$(python3 -c "print($ROWS_MB * 1.048576 / 1000)")

mkdir -p "$WORK/src"
chmod 755 "$WORK" "$WORK/src"
for i in $(seq 0 $((FILES - 1))); do
  [[ -s "$WORK/src/f$i.bin" ]] || head -c "${MB}M" /dev/urandom > "$WORK/src/f$i.bin"
done
if [[ " $MODES " == *" rows "* && ! -s "$WORK/src/rows.npy" ]]; then
  "$PY" - "$WORK/src/rows.npy" "$ROWS_MB" <<'PY'
import sys, numpy as np
rows = int(sys.argv[2]) * 16  # 64 KiB rows
a = np.lib.format.open_memmap(sys.argv[1], mode="w+", dtype=np.uint8, shape=(rows, 64 << 10))
rng = np.random.default_rng(0)
for i in range(0, rows, 1024):
    a[i:i + 1024] = rng.integers(0, 256, size=a[i:i + 1024].shape, dtype=np.uint8)
a.flush()
PY
fi
chmod 644 "$WORK"/src/*
cleanup() {
  for s in $SCRATCHES; do
    mountpoint -q "$WORK/$s/mnt" 2>/dev/null && fusermount3 -uz "$WORK/$s/mnt" || true
    mountpoint -q "$WORK/$s/rmnt" 2>/dev/null && fusermount3 -uz "$WORK/$s/rmnt" || true
  done
  for s in ram nvme; do
    mountpoint -q "$WORK/$s" && umount -l "$WORK/$s" || true
    mountpoint -q "$WORK/ramfs-$s" && umount -l "$WORK/ramfs-$s" || true
  done
}
dropper "$STAGEFS_BENCH_DROP" &
dropper_pid=$!
trap 'kill $dropper_pid 2>/dev/null; cleanup' EXIT
echo "stagefs: $STAGEFS; data: $FILES x $MB MB; user: $BENCH_USER; load at start: $(load)"
echo "columns: scratch mode round | local s | direct s (x local) | fuse s (x local) | rclone s (x local) | CPU-s/GB local direct fuse rclone | direct opens"
for s in $SCRATCHES; do
  S=$WORK/$s
  if [[ $s == ram || $s == nvme ]]; then
    # Room for the local copy, the cache and rclone's cache, each the whole source, and a
    # half more: a scratch too small for all of them leaves the cache less room than the
    # dataset, and warm opens are refused as not staged.
    src_mb=$(( $(du -sm "$WORK/src" | cut -f1) ))
    img_mb=$(( src_mb * 7 / 2 + 256 ))
    ram_scratch "$S" "$WORK/ramfs-$s" "$img_mb"
  fi
  [[ $s == nvme ]] && throttle "$S" stagefs-nvme "$NVME_MBS"
  mkdir -p "$S"
  chown "$uid:$uid" "$S"
  as_user rm -rf "$S/local" "$S/cache" "$S/mnt"
  as_user mkdir -p "$S/mnt"
  as_user cp -r "$WORK/src" "$S/local"
  run_mount() {  # ARGS...: one epoch under `stagefs run` (direct unless ARGS say --no-direct)
    local extra=$1 mode=$2
    # shellcheck disable=SC2086
    as_user "$STAGEFS" run $extra --mount "$WORK/src:$S/mnt:$S/cache" -- \
      "$PY" "$HERE/direct_epoch.py" "$S/mnt" "$mode" "$S/mnt"
  }
  run_rclone() {  # MODE: one epoch over rclone's cached mount of the same source
    as_user mkdir -p "$S/rmnt"
    as_user rclone mount --read-only --vfs-cache-mode full --vfs-cache-max-size 100G \
      --cache-dir "$S/rclone-cache" --daemon "$WORK/src" "$S/rmnt"
    for _ in $(seq 100); do mountpoint -q "$S/rmnt" && break; sleep 0.1; done
    local pid out c0
    pid=$(pgrep -u "$uid" -n -f "rclone mount.*$S/rmnt")
    c0=$(cpu_of "$pid")
    out=$(as_user "$PY" "$HERE/direct_epoch.py" "$S/rmnt" "$1")
    # The daemon's CPU goes where the stagefs daemon's would (the third field).
    read -r w rd _ rest <<<"$out"
    echo "$w $rd $(python3 -c "print(f'{$(cpu_of "$pid") - $c0:.3f}')") $rest"
    as_user fusermount3 -u "$S/rmnt"
  }
  drop
  echo "$s epoch1 (fresh cache, staging): $(run_mount "" seq) (load $(load))"
  [[ -n $RCLONE ]] && echo "$s rclone epoch1 (fresh cache): $(run_rclone seq) (load $(load))"
  [[ " $MODES " == *" rows "* ]] && echo "$s rows epoch1: $(run_mount "" rows) (load $(load))"
  # The copies complete in epoch 1 are verified in the background; let that finish.
  sleep 5
  for r in $(seq 1 "$ROUNDS"); do
    for mode in $MODES; do
      drop; l=$(as_user "$PY" "$HERE/direct_epoch.py" "$S/local" "$mode")
      drop; d=$(run_mount "" "$mode")
      drop; f=$(run_mount --no-direct "$mode")
      c="-"; [[ -n $RCLONE ]] && { drop; c=$(run_rclone "$mode"); }
      g=$gb; [[ $mode == rows ]] && g=$rows_gb
      python3 - "$s" "$mode" "$r" "$g" "$l" "$d" "$f" "$c" "$(load)" <<'PY'
import sys
s, mode, r, gb = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
l, d, f = (list(map(float, a.split())) for a in sys.argv[5:8])
c = list(map(float, sys.argv[8].split())) if sys.argv[8] != "-" else None
cpu = lambda x: (x[1] + x[2]) / gb
rc = f"{c[0]:.2f} ({l[0] / c[0]:.2f}x)" if c else "-"
print(f"{s} {mode} {r} | {l[0]:.2f} | {d[0]:.2f} ({l[0] / d[0]:.2f}x) | {f[0]:.2f} ({l[0] / f[0]:.2f}x) "
      f"| {rc} | {cpu(l):.2f} {cpu(d):.2f} {cpu(f):.2f} {cpu(c) if c else '-':.4} | {int(d[3])} "
      f"(load {sys.argv[9]})")
PY
    done
  done
  as_user rm -rf "$S/local" "$S/cache" "$S/rclone-cache"
  CG=
  if [[ $s == ram || $s == nvme ]]; then umount "$S" && umount "$WORK/ramfs-$s"; fi
done
echo "load at end: $(load)"
