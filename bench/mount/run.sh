#!/usr/bin/env bash
# The mount benchmark (issue 9). Run as root from anywhere; see README.md.
#
#   bench/mount/run.sh            part 1 (slow backend) + part 2 (scale), then the report
#   bench/mount/run.sh backend    part 1 only        bench/mount/run.sh scale    part 2 only
#   bench/mount/run.sh levers     the FUSE-lever experiment (slow backend, small files)
#   bench/mount/run.sh all        parts 1 and 2 and the levers
#   bench/mount/run.sh large [ARGS]  large files: in order, shuffled, mmap random rows, one
#                                 reader in order, and small files; caches dropped and kept,
#                                 CPU-s per GB (bench/mount/large.sh)
#   bench/mount/run.sh hints      stagefs.Loader with and without read-order hints, cold, over
#                                 the slow backend (bench/loader_hints_bench.py; needs .venv)
#   bench/mount/run.sh report RESULTS.jsonl...   the report again, from saved results
#   bench/mount/run.sh clean      unmount the RAM disk, delete $WORK (keeps nothing)
#
# Part 1 builds a slow /bigdata: an ext4 image served by nbdkit through its `rate` filter
# (RATE_MBS, over all connections) and `delay` filter (DELAY_MS per read request), exposed as a
# file by nbdfuse (this kernel has no nbd module), attached read-only to a loop device with
# direct I/O (so the page cache holds each block once) and mounted ext4. nbdkit runs with
# cache=none, so `echo 3 > drop_caches` empties every layer. The backend image lives in a tmpfs
# ($WORK/ram, RAM_SIZE; generated once per set of sizes, kept until `clean` or a reboot), so the
# rate filter, not the VM's disk, limits /bigdata. Node-local scratch (the rsync copy and the
# stagefs caches) is, by default (SCRATCH_FS=ext4), ext4 on a loop device over a sparse file in
# that tmpfs, mounted with discard: a RAM-backed block device, faster than real NVMe, whose page
# cache `drop_caches` empties — as a node's NVMe behaves under a dataset larger than RAM. (The
# VM's own disk is slower than the emulated shared storage; a plain tmpfs, SCRATCH_FS=tmpfs,
# cannot be dropped: every "cold" local epoch would be a page-cache epoch.)
# Part 2 generates SCALE_FILES tiny files (holes, ~0.2 GB of disk for 1.28 M) under $WORK on the
# host disk, once, scaled down (and said so) if the inodes or the RAM disk for its cache do not
# allow that many.
#
# Every stagefs mount of the headline, every epoch, find and `stagefs index` runs as BENCH_USER
# (setpriv); the root-mounted variant (passthrough) is part 1's secondary line.
#
# Knobs (environment): WORK=/var/tmp/stagefs-bench, STAGEFS (binary; default
# target/release/stagefs, built if missing), BENCH_USER=stagefs-test, RAM_SIZE=16g, ROUNDS=2,
# RATE_MBS=200, DELAY_MS=2, LARGE_FILES=8, LARGE_MB=256, SMALL_FILES=20000, SMALL_CLASSES=100,
# SMALL_KB=100, LATER=3 (epochs measured after epoch 1), READERS=shuf8,seq, COMPUTE=1 (every
# epoch feeds a training step as slow per MB as a local read: how much of the I/O it hides),
# DATASETS=small,large, SIDES=seed,user,direct,root, SCALE_FILES=1280000, SCALE_CLASSES=1000,
# SCALE_ROUNDS=$ROUNDS, LEVERS=warm,cold,list, ONLY (a regex over pass names, printed as they
# run), HINT_IMAGES=4000, HINT_RAW_MB=1024, CACHE_SIZE=8G (the mounts' --cache-size),
# SCRATCH_FS=ext4|nvme|disk|tmpfs (nvme: the ext4 scratch with its reads and writes held to
# NVME_MBS=1000 MB/s by a blkio cgroup, the seed's node-local NVMe; disk: a directory on the
# machine's own disk, which this VM's host caches), SCRATCH_SIZE=9g.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-/var/tmp/stagefs-bench}
STAGEFS_SRC=${STAGEFS:-$REPO/target/release/stagefs}
BENCH_USER=${BENCH_USER:-stagefs-test}
RAM_SIZE=${RAM_SIZE:-16g}
ROUNDS=${ROUNDS:-2}
RATE_MBS=${RATE_MBS:-200}
DELAY_MS=${DELAY_MS:-2}
LARGE_FILES=${LARGE_FILES:-8}
LARGE_MB=${LARGE_MB:-256}
SMALL_FILES=${SMALL_FILES:-20000}
SMALL_CLASSES=${SMALL_CLASSES:-100}
SMALL_KB=${SMALL_KB:-100}
SCALE_FILES=${SCALE_FILES:-1280000}
SCALE_CLASSES=${SCALE_CLASSES:-1000}
SCALE_ROUNDS=${SCALE_ROUNDS:-$ROUNDS}
CACHE_SIZE=${CACHE_SIZE:-8G}
PY=/usr/bin/python3  # not a venv's: the unprivileged user runs it too
VENV_PY=$REPO/.venv/bin/python  # the hint benchmark: numpy, Pillow and the stagefs package
HINT_IMAGES=${HINT_IMAGES:-4000}
HINT_RAW_MB=${HINT_RAW_MB:-1024}

SCRATCH_FS=${SCRATCH_FS:-ext4}
SCRATCH_SIZE=${SCRATCH_SIZE:-9g}
RAM=$WORK/ram          # tmpfs: the backend image, and scratch's backing file
IMG=$RAM/backend.img
PARAMS="large=${LARGE_FILES}x${LARGE_MB}MB small=${SMALL_FILES}x${SMALL_KB}KB/${SMALL_CLASSES}"
if [ "${1:-}" = hints ]; then
  IMG=$RAM/hints.img
  PARAMS="hints images=$HINT_IMAGES raw=${HINT_RAW_MB}MB"
fi
SOCK=$WORK/nbdkit.sock
NBD=$WORK/nbd          # nbdfuse mountpoint; the device is the file $NBD/disk
BIGDATA=$WORK/bigdata  # the slow filesystem (ext4, read-only)
# rsync targets and stagefs caches: $SCRATCH/user (0700, BENCH_USER), /root
case $SCRATCH_FS in
  ext4) SCRATCH=$WORK/scratch ;;
  disk) SCRATCH=$WORK/scratch-disk ;;  # the machine's own disk, as a node's NVMe (~1 GB/s)
  *) SCRATCH=$RAM/scratch ;;
esac
MNT=$WORK/mnt          # the stagefs mountpoint (owned by BENCH_USER)
BIN=$WORK/bin          # copies of the scripts and binary, readable by BENCH_USER wherever the
                       # checkout lives
RESULTS=$WORK/results

log() { echo "$(date +%T) $*" >&2; }
die() { echo "run.sh: $*" >&2; exit 1; }

cmd=${1:-default}
[ "$cmd" = report ] && { shift; exec "$PY" "$HERE/bench.py" report "$@"; }
[ "$cmd" = large ] && { shift; exec "$HERE/large.sh" "$@"; }
case $cmd in default | all | backend | scale | levers | hints | clean) ;;
  *) die "unknown command $cmd (default, all, backend, scale, levers, hints, report, clean)" ;; esac
[ "$(id -u)" = 0 ] || die "needs root (drop_caches, loop devices, nbdfuse); run it as root"

# Whether something is mounted at $1 (mountinfo, not stat: root may not stat another user's FUSE
# mount without allow_other).
mounted() { awk -v m="$(realpath -m "$1")" '$5 == m { f = 1 } END { exit !f }' /proc/self/mountinfo; }

teardown() {
  set +e
  if mounted "$MNT"; then
    "$BIN/stagefs" umount --lazy "$MNT" 2>/dev/null || fusermount3 -uz "$MNT" || umount -l "$MNT"
  fi
  mounted "$BIGDATA" && umount "$BIGDATA"
  mounted "$WORK/scratch" && umount "$WORK/scratch"
  for dev in $(losetup -j "$NBD/disk" -O NAME -n 2>/dev/null); do losetup -d "$dev"; done
  mounted "$NBD" && fusermount3 -u "$NBD"
  if [ -f "$WORK/nbdkit.pid" ]; then
    kill "$(cat "$WORK/nbdkit.pid")" 2>/dev/null
    rm -f "$WORK/nbdkit.pid"
    sleep 0.5
  fi
  rm -f "$SOCK"
  return 0
}

teardown  # leftovers of an interrupted run
if [ "$cmd" = clean ]; then
  mountpoint -q "$RAM" && umount "$RAM"
  rm -rf "$WORK"
  exit 0
fi

missing=()
for t in nbdkit:nbdkit nbdfuse:libnbd-bin rsync:rsync mkfs.ext4:e2fsprogs losetup:mount \
  fusermount3:fuse3 setpriv:util-linux; do
  command -v "${t%%:*}" >/dev/null || missing+=("${t#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
id "$BENCH_USER" >/dev/null 2>&1 || die "no user $BENCH_USER (useradd -m $BENCH_USER, or BENCH_USER=...)"
[ -c /dev/fuse ] && [ "$(stat -c %a /dev/fuse)" = 666 ] ||
  die "/dev/fuse must be mode 0666 for unprivileged mounts (chmod 0666 /dev/fuse)"
if [ ! -x "$STAGEFS_SRC" ]; then
  log "building $STAGEFS_SRC"
  (cd "$REPO" && cargo build --release -p stagefs)
fi

mkdir -p "$WORK" "$NBD" "$BIGDATA" "$RAM" "$MNT" "$RESULTS" "$BIN"
chmod 0755 "$WORK" "$BIN"
chown "$BENCH_USER:" "$MNT" && chmod 0755 "$MNT"
install -m 0755 "$STAGEFS_SRC" "$BIN/stagefs"
# The direct side preloads the library the binary carries, as `stagefs run` writes it out
# (into its first mount's cache): taken from a throwaway run.
lib_tmp=$(mktemp -d)
mkdir "$lib_tmp/src" "$lib_tmp/mnt"
"$BIN/stagefs" run --mount "$lib_tmp/src:$lib_tmp/mnt:$lib_tmp/cache" -- true 2>/dev/null
install -m 0755 "$lib_tmp"/cache/direct-*.so "$BIN/libstagefs_direct.so"
rm -rf "$lib_tmp"
install -m 0644 "$HERE"/*.py "$BIN/"
COMMIT=$(git -C "$REPO" describe --always --dirty --abbrev=12 2>/dev/null || echo unknown)
export BENCH_COMMIT="$COMMIT (binary $(stat -c %y "$STAGEFS_SRC" | cut -d. -f1))"
mountpoint -q "$RAM" || mount -t tmpfs -o size="$RAM_SIZE",mode=0755 stagefs-bench "$RAM"
trap teardown EXIT
case $SCRATCH_FS in
  ext4 | nvme)
    mkdir -p "$SCRATCH"
    rm -f "$RAM/scratch.img"
    truncate -s "$SCRATCH_SIZE" "$RAM/scratch.img"
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$RAM/scratch.img"
    mount -o loop,discard "$RAM/scratch.img" "$SCRATCH"
    log "scratch: ext4 on $(findmnt -n -o SOURCE "$SCRATCH") over $RAM/scratch.img ($SCRATCH_SIZE, RAM)"
    if [ "$SCRATCH_FS" = nvme ]; then
      # Every command of the benchmark (rsync, mounts, epochs) runs in this blkio cgroup, which
      # holds scratch's reads and writes to NVME_MBS: the seed's node-local NVMe.
      export BENCH_CGROUP=/sys/fs/cgroup/blkio/stagefs-bench-nvme
      mkdir -p "$BENCH_CGROUP"
      dev=$(findmnt -n -o MAJ:MIN --target "$SCRATCH" | tr -d ' ')
      echo "$dev $((${NVME_MBS:-1000} * 1000000))" >"$BENCH_CGROUP/blkio.throttle.read_bps_device"
      echo "$dev $((${NVME_MBS:-1000} * 1000000))" >"$BENCH_CGROUP/blkio.throttle.write_bps_device"
      log "scratch throttled to ${NVME_MBS:-1000} MB/s for the benchmark's commands ($BENCH_CGROUP)"
    fi
    ;;
  tmpfs) log "scratch: the tmpfs $RAM (drop_caches cannot empty it)" ;;
  disk)
    mkdir -p "$SCRATCH"
    log "scratch: $SCRATCH on the machine's disk ($(findmnt -n -o SOURCE --target "$SCRATCH"))"
    ;;
  *) die "SCRATCH_FS must be ext4, nvme, disk or tmpfs" ;;
esac
export BENCH_SCRATCH="$SCRATCH_FS"
rm -rf "$SCRATCH"/*
mkdir -p "$SCRATCH/user" "$SCRATCH/direct" "$SCRATCH/root"
chown "$BENCH_USER:" "$SCRATCH/user" "$SCRATCH/direct"
chmod 0700 "$SCRATCH/user" "$SCRATCH/direct" "$SCRATCH/root"
chmod 0755 "$SCRATCH"

stamp=$(date +%Y%m%d-%H%M%S)
out=$RESULTS/results-$stamp.jsonl
log "results → $out (commit $COMMIT)"
common=(--scratch "$SCRATCH" --mnt "$MNT" --stagefs "$BIN/stagefs" --out "$out"
  --user "$BENCH_USER" --only "${ONLY:-}" --cache-size "$CACHE_SIZE")

backend_up() {
  if [ "$(cat "$RAM/params" 2>/dev/null)" != "$PARAMS" ] || [ ! -f "$IMG" ]; then
    log "generating the backend datasets ($PARAMS) into $IMG (RAM)"
    rm -f "$RAM/params" "$IMG"
    local data_mb=$((LARGE_FILES * LARGE_MB + SMALL_FILES * SMALL_KB * 14 / 10 / 1000))
    truncate -s $((data_mb * 115 / 100 + 256))M "$IMG"
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$IMG"
    local gen=$WORK/gen
    mkdir -p "$gen"
    mount -o loop "$IMG" "$gen"
    if [ "$cmd" = hints ]; then
      "$VENV_PY" "$REPO/bench/loader_hints_bench.py" --generate "$gen" --images "$HINT_IMAGES" \
        --raw-mb "$HINT_RAW_MB" || { umount "$gen"; die "generating the hint dataset failed"; }
    else
      "$PY" "$HERE/gen.py" backend "$gen" "$LARGE_FILES" "$LARGE_MB" "$SMALL_FILES" \
        "$SMALL_CLASSES" "$SMALL_KB" || { umount "$gen"; die "generating the datasets failed"; }
    fi
    umount "$gen"
    echo "$PARAMS" >"$RAM/params"
  fi
  log "backend: nbdkit rate=${RATE_MBS} MB/s delay-read=${DELAY_MS} ms → nbdfuse → loop → ext4"
  nbdkit -U "$SOCK" -P "$WORK/nbdkit.pid" --readonly --filter=rate --filter=delay \
    file file="$IMG" cache=none delay-read="${DELAY_MS}ms" rate=$((RATE_MBS * 8 * 1000000))
  for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.1; done
  nbdfuse --readonly "$NBD/disk" --unix "$SOCK" &
  for _ in $(seq 50); do [ -f "$NBD/disk" ] && break; sleep 0.1; done
  [ -f "$NBD/disk" ] || die "nbdfuse did not come up"
  local loop
  loop=$(losetup -f --show -r --direct-io=on "$NBD/disk")
  mount -t ext4 -o ro,noload "$loop" "$BIGDATA"
  log "slow /bigdata at $BIGDATA ($loop)"
}

part_backend() {
  "$PY" "$BIN/bench.py" backend "${common[@]}" --bigdata "$BIGDATA" --device "$NBD/disk" \
    --rounds "$ROUNDS" --later "${LATER:-3}" --readers "${READERS:-shuf8,seq}" \
    --datasets "${DATASETS:-small,large}" --sides "${SIDES:-seed,user,direct,root}" \
    --params "$PARAMS rate=${RATE_MBS}MB/s delay=${DELAY_MS}ms${COMPUTE:+ compute}" \
    ${COMPUTE:+--compute} ||
    log "part 1 ended with an error (partial results in $out)"
}

part_hints() {
  # As root with --no-passthrough (the daemon-served path a user gets); every mount on a fresh
  # cache on scratch, caches dropped before each: the view rendered and the raw file fetched
  # from the slow backend.
  mkdir -p "$SCRATCH/root/hints"
  "$VENV_PY" "$REPO/bench/loader_hints_bench.py" --src "$BIGDATA" --bin "$BIN/stagefs" \
    --work "$SCRATCH/root/hints" --rounds "$ROUNDS" --drop-caches | tee "$RESULTS/hints-$stamp.txt"
}

part_levers() {
  "$PY" "$BIN/bench.py" levers "${common[@]}" --bigdata "$BIGDATA" --rounds "$ROUNDS" \
    --levers "${LEVERS:-warm,cold,list}" --params "$PARAMS" ||
    log "levers ended with an error (partial results in $out)"
}

part_scale() {
  # Fit N to the host: one inode per file (plus 10% and 100k spare) on $WORK's filesystem,
  # and the cache (files are packed 4 KiB-aligned: ~4.6 KB per 1-4 KB file with the index) in
  # what scratch (and the RAM disk under it) has free.
  local n=$SCALE_FILES free_inodes ram_free fit
  free_inodes=$(df --output=iavail "$WORK" | tail -1)
  ram_free=$(($(df --output=avail -B1 "$RAM" | tail -1) - 256 * 1024 * 1024))
  fit=$(($(df --output=avail -B1 "$SCRATCH" | tail -1) - 256 * 1024 * 1024))
  [ "$fit" -lt "$ram_free" ] && ram_free=$fit
  fit=$(((free_inodes - 100000) * 10 / 11))
  if [ "$fit" -lt "$n" ]; then
    log "scale: only $free_inodes free inodes on $WORK: N scaled down from $n to $fit"
    n=$fit
  fi
  fit=$((ram_free / 4600))
  if [ "$fit" -lt "$n" ]; then
    log "scale: the RAM disk has $((ram_free >> 20)) MiB free: N scaled down from $n to $fit (raise RAM_SIZE)"
    n=$fit
  fi
  # Disk: the files are holes, but directories take ~60 B per entry (and 0.1 GB to spare).
  fit=$((($(df --output=avail -B1 "$WORK" | tail -1) - 100 * 1024 * 1024) / 60))
  if [ "$fit" -lt "$n" ]; then
    log "scale: little disk free on $WORK: N scaled down from $n to $fit"
    n=$fit
  fi
  n=$((n / SCALE_CLASSES * SCALE_CLASSES))
  [ "$n" -gt 0 ] || die "scale: no room for any file"
  local dir=$WORK/scale-$n-$SCALE_CLASSES
  if [ ! -f "$dir/complete" ]; then
    rm -rf "$dir"
    log "generating the scale tree ($n files in $SCALE_CLASSES classes) in $dir"
    "$PY" "$HERE/gen.py" scale "$dir" "$n" "$SCALE_CLASSES"
  fi
  chmod 0755 "$dir"
  local last deep
  last=$(find "$dir/train" -mindepth 1 -maxdepth 1 -type d | sort | tail -1)
  deep=${last#"$dir/"}/$(ls "$last" | sort | tail -1)
  deep=${deep#train/}
  "$PY" "$BIN/bench.py" scale "${common[@]}" --source "$dir/train" --deep "$deep" \
    --n-files "$n" --rounds "$SCALE_ROUNDS" --params "N=$n classes=$SCALE_CLASSES" ||
    log "part 2 ended with an error (partial results in $out)"
}

case $cmd in
  default) backend_up; part_backend; part_scale ;;
  all) backend_up; part_backend; part_levers; part_scale ;;
  backend) backend_up; part_backend ;;
  levers) backend_up; part_levers ;;
  scale) part_scale ;;
  hints) backend_up; part_hints; teardown; exit 0 ;;
esac
teardown
trap - EXIT
{
  echo "Run: \`${0##*/} $cmd\`, $(date +%F), results $out"
  echo
  "$PY" "$BIN/bench.py" report "$out"
} | tee "$RESULTS/report-$stamp.md"
log "report → $RESULTS/report-$stamp.md"
