#!/usr/bin/env bash
# The benchmark of the mount (issue 2). Run as root from anywhere:   sudo bench/mount/run.sh
#
# Builds a realistically slow /bigdata and measures, side by side and in alternated rounds:
# rsync-to-scratch-then-read (today's workflow), direct reads of the slow filesystem, stagefs
# epoch 1 (cold cache, with and without background staging), stagefs epoch 2 (warm cache, with
# and without FUSE passthrough) and reads of a local copy on scratch; then prints the report.
#
# The slow storage: the datasets live in an ext4 image served by nbdkit through its `rate` filter
# (RATE_MBS, total over all connections) and `delay` filter (DELAY_MS per read request),
# exposed as a file by nbdfuse, attached read-only to a loop device (direct I/O, so the page
# cache holds each block once) and mounted as ext4. This box has no nbd kernel module, hence
# nbdfuse. nbdkit runs with cache=none, so `echo 3 > drop_caches` empties every layer.
#
# Node-local scratch is a tmpfs (RAM): this VM's virtual disk reads at ~90 MB/s, slower than
# the 200 MB/s "shared storage", while real scratch NVMe reads at GB/s. So the backend image,
# the local copy, rsync targets and stagefs caches all live in $WORK/ram (peak ~11 GB with the
# default sizes); the generated image is also kept on disk ($WORK/backend.img) for re-runs.
# `run.sh clean` unmounts that tmpfs and removes $WORK.
#
# Knobs (environment): WORK (state dir, default /var/tmp/stagefs-bench), STAGEFS (binary,
# default target/release/stagefs, built if missing), RAM_SIZE=14g (the tmpfs), RATE_MBS=200, DELAY_MS=2, LARGE_FILES=4,
# LARGE_MB=512, SMALL_FILES=20000, SMALL_CLASSES=100, SMALL_KB=100, ROUNDS=2, ONLY (a regex:
# run only the passes whose name matches, e.g. ONLY='small (local|cold)'; names are printed),
# ONCE (a regex: passes run in round 1 only; default 'small (direct seq|seed)', the two passes
# that take ~200 s each on small files and are 10-20x off the others: repeating them adds
# nothing to the comparison but 7 minutes), WORKAROUND=1 (0 once the open/release deadlock in
# fs/src/fuse.rs is fixed: small-file cold passes then keep passthrough on, warm ones 8 threads),
# TOP_DIRS=N (epochs read only the first N class folders; 0 = all).
# The image and the local copy are kept in WORK and reused while these sizes stay the same.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-/var/tmp/stagefs-bench}
STAGEFS=${STAGEFS:-$REPO/target/release/stagefs}
RATE_MBS=${RATE_MBS:-200}
DELAY_MS=${DELAY_MS:-2}
LARGE_FILES=${LARGE_FILES:-4}
LARGE_MB=${LARGE_MB:-512}
SMALL_FILES=${SMALL_FILES:-20000}
SMALL_CLASSES=${SMALL_CLASSES:-100}
SMALL_KB=${SMALL_KB:-100}
ROUNDS=${ROUNDS:-2}
RAM_SIZE=${RAM_SIZE:-14g}

RAM=$WORK/ram         # tmpfs standing in for node-local NVMe scratch (and holding the backend)
DISK_IMG=$WORK/backend.img
IMG=$RAM/backend.img
PARAMS="large=${LARGE_FILES}x${LARGE_MB}MB small=${SMALL_FILES}x${SMALL_KB}KB/${SMALL_CLASSES}"
SOCK=$WORK/nbdkit.sock
NBD=$WORK/nbd          # nbdfuse mountpoint; the device is the file $NBD/disk
BIGDATA=$WORK/bigdata  # the slow filesystem (ext4, read-only)
LOCAL=$RAM/local       # a local copy on scratch: the speed to beat
SCRATCH=$RAM/scratch   # rsync targets and stagefs caches
MNT=$WORK/mnt          # the stagefs mountpoint
RESULTS=$WORK/results

log() { echo "$(date +%T) $*" >&2; }
die() { echo "run.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (drop_caches, loop devices, nbdfuse); run: sudo $0"

missing=()
for t in nbdkit:nbdkit nbdfuse:libnbd-bin rsync:rsync mkfs.ext4:e2fsprogs losetup:mount \
  fusermount3:fuse3 python3:python3; do
  command -v "${t%%:*}" >/dev/null || missing+=("${t#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
if [ ! -x "$STAGEFS" ]; then
  log "building $STAGEFS"
  (cd "$REPO" && cargo build --release -p stagefs)
fi

teardown() {
  set +e
  if mountpoint -q "$MNT"; then "$STAGEFS" umount "$MNT" || fusermount3 -uz "$MNT"; fi
  mountpoint -q "$BIGDATA" && umount "$BIGDATA"
  for dev in $(losetup -j "$NBD/disk" -O NAME -n 2>/dev/null); do losetup -d "$dev"; done
  mountpoint -q "$NBD" && fusermount3 -u "$NBD"
  if [ -f "$WORK/nbdkit.pid" ]; then
    kill "$(cat "$WORK/nbdkit.pid")" 2>/dev/null
    rm -f "$WORK/nbdkit.pid"
    sleep 0.5
  fi
  rm -f "$SOCK"
  return 0
}

teardown  # leftovers of an interrupted run
if [ "${1:-}" = clean ]; then
  mountpoint -q "$RAM" && umount "$RAM"
  rm -rf "$WORK"
  exit 0
fi
mkdir -p "$WORK" "$NBD" "$BIGDATA" "$RAM" "$MNT" "$RESULTS"
mountpoint -q "$RAM" || mount -t tmpfs -o size="$RAM_SIZE" stagefs-bench "$RAM"
mkdir -p "$LOCAL" "$SCRATCH"
trap teardown EXIT

# --- the image and the local copy (once per set of sizes) ---------------------------------------
if [ "$(cat "$WORK/params" 2>/dev/null)" != "$PARAMS" ]; then
  log "generating datasets ($PARAMS) into $DISK_IMG"
  rm -f "$WORK/params" "$RAM/params" "$DISK_IMG"
  data_mb=$((LARGE_FILES * LARGE_MB + SMALL_FILES * SMALL_KB * 14 / 10 / 1000))
  truncate -s $((data_mb * 115 / 100 + 256))M "$DISK_IMG"
  mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$DISK_IMG"
  gen=$WORK/gen
  mkdir -p "$gen"
  mount -o loop "$DISK_IMG" "$gen"
  python3 "$HERE/gen.py" "$gen" "$LARGE_FILES" "$LARGE_MB" "$SMALL_FILES" "$SMALL_CLASSES" "$SMALL_KB"
  umount "$gen"
  echo "$PARAMS" >"$WORK/params"
fi
if [ "$(cat "$RAM/params" 2>/dev/null)" != "$PARAMS" ]; then
  log "copying the image into RAM and making the local copy"
  rm -rf "$LOCAL" "$SCRATCH" "$IMG" && mkdir -p "$LOCAL" "$SCRATCH"
  cp --sparse=always "$DISK_IMG" "$IMG"
  gen=$WORK/gen
  mkdir -p "$gen"
  mount -o loop,ro,noload "$IMG" "$gen"
  rsync -a "$gen/large" "$gen/small" "$LOCAL/"
  umount "$gen"
  echo "$PARAMS" >"$RAM/params"
fi
rm -rf "${SCRATCH:?}"/*

# --- the slow backend ---------------------------------------------------------------------------
log "backend: nbdkit rate=${RATE_MBS} MB/s delay-read=${DELAY_MS} ms → nbdfuse → loop → ext4"
nbdkit -U "$SOCK" -P "$WORK/nbdkit.pid" --readonly --filter=rate --filter=delay \
  file file="$IMG" cache=none delay-read="${DELAY_MS}ms" rate=$((RATE_MBS * 8 * 1000000))
for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.1; done
nbdfuse --readonly "$NBD/disk" --unix "$SOCK" &
for _ in $(seq 50); do [ -f "$NBD/disk" ] && break; sleep 0.1; done
[ -f "$NBD/disk" ] || die "nbdfuse did not come up"
LOOP=$(losetup -f --show -r --direct-io=on "$NBD/disk")
mount -t ext4 -o ro,noload "$LOOP" "$BIGDATA"
log "slow /bigdata at $BIGDATA ($LOOP, read_ahead_kb=$(cat /sys/block/"${LOOP#/dev/}"/queue/read_ahead_kb))"

# --- the passes ---------------------------------------------------------------------------------
# Workaround: the daemon keeps one descriptor open per cached file (prefetch/src/store.rs,
# Entry::file, never closed), so 20,000 small files exhaust a 20,000 (or the usual 1,024) limit
# and reads fail with EMFILE. Raise the limit the daemon inherits until that is fixed.
if [ "${WORKAROUND:-1}" = 1 ]; then ulimit -n 1048576 2>/dev/null || ulimit -n "$(ulimit -Hn)"; fi
log "open-file limit for the daemon: $(ulimit -n)"
stamp=$(date +%Y%m%d-%H%M%S)
out=$RESULTS/results-$stamp.jsonl
log "results → $out"
python3 "$HERE/bench.py" run --bigdata "$BIGDATA" --local "$LOCAL" --scratch "$SCRATCH" \
  --mnt "$MNT" --stagefs "$STAGEFS" --device "$NBD/disk" --rounds "$ROUNDS" --out "$out" --only "${ONLY:-}" \
  --once "${ONCE-small (direct seq|seed)}" --workaround "${WORKAROUND:-1}" \
  --top-dirs "${TOP_DIRS:-0}" ||
  die "a pass failed (partial results in $out)"
{
  echo "stagefs $(git -C "$REPO" rev-parse --short HEAD), $(nproc) CPUs, $(free -g | awk '/Mem/{print $2}') GiB RAM," \
    "kernel $(uname -r); backend rate ${RATE_MBS} MB/s, ${DELAY_MS} ms per read; $PARAMS; rounds $ROUNDS."
  echo
  python3 "$HERE/bench.py" report "$out"
} | tee "$RESULTS/report-$stamp.md"
