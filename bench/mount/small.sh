#!/usr/bin/env bash
# The seed's own job, as a user runs it: a folder of small files (JPEG-sized) read by a
# DataLoader's workers, in a chain of jobs that each mount anew. Per round, alternated with a
# local copy on the same scratch, all as the normal user $BENCH_USER:
#   job 1   one `stagefs run --mount SRC/DATA:MNT:CACHE -- small_epochs.py ... 3`: epoch 1
#           first (the cache empty at mount; the source here is the local disk, so staging
#           may fill much of it before the epoch starts: bench/mount/held_out.sh times a cold
#           epoch from a slow source), epochs 2 and 3 warm, the page cache dropped before each;
#   job 2   a new `stagefs run` on the warm cache: its first epoch (the next job of a chain;
#           for `walk` two listings, the second warm);
#   local   the same script over a copy of SRC on the same scratch (3 epochs).
# Modes (MODES): `threads` (8 threads), `pool` (8 forked worker processes), `walk` (os.walk
# + stat of every file of a tree of WALK_FILES files, warm and after a remount), and
# `imagefolder` (torchvision's ImageFolder + a DataLoader of 8 workers over JPEG_FILES real
# JPEGs, ~500x375 at quality 90; needs torch and torchvision in $PY).
#
#   bench/mount/small.sh              (as root; SCRATCH=/var/tmp/stagefs-small, the disk)
# Knobs: SCRATCH, STAGEFS=target/release/stagefs, BENCH_USER=stagefs-test, FILES=20000 (of
# 60-140 KB), WALK_FILES=200000, JPEG_FILES=5000, ROUNDS=2, MODES="threads pool walk",
# PY=python3 (the epochs' interpreter, run as the user: torch and torchvision for
# imagefolder, e.g. a venv of the user's), GEN_PY=the repository's .venv python (makes the
# JPEGs, as root: numpy and Pillow), NVME_MBS
# (set: scratch is a loop device over RAM throttled to that many MB/s, like a node's NVMe;
# scratch.sh).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SCRATCH=${SCRATCH:-/var/tmp/stagefs-small}
STAGEFS=${STAGEFS:-$REPO/target/release/stagefs}
BENCH_USER=${BENCH_USER:-stagefs-test}
FILES=${FILES:-20000} WALK_FILES=${WALK_FILES:-200000} ROUNDS=${ROUNDS:-2}
JPEG_FILES=${JPEG_FILES:-5000} PY=${PY:-python3} GEN_PY=${GEN_PY:-$REPO/.venv/bin/python}
MODES=${MODES:-threads pool walk} NVME_MBS=${NVME_MBS:-}
[[ $(id -u) -eq 0 ]] || { echo "run as root (drop_caches, setpriv)" >&2; exit 1; }
uid=$(id -u "$BENCH_USER")
# shellcheck source=bench/mount/scratch.sh
source "$HERE/scratch.sh"
mkdir -p "$SCRATCH/src" "$SCRATCH/bin"
chmod 755 "$SCRATCH" "$SCRATCH/src" "$SCRATCH/bin"
# The datasets, generated once: deterministic, incompressible.
"$GEN_PY" - "$SCRATCH/src" "$FILES" "$WALK_FILES" "$JPEG_FILES" "$MODES" <<'PY'
import os, random, sys
root, files, walk, jpegs, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
def make(top, n, lo, hi, classes):
    done = os.path.join(top, ".done")
    if os.path.exists(done):
        return
    rng = random.Random(n)
    for i in range(n):
        d = os.path.join(top, f"class{i % classes:04d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"img{i:07d}.jpg"), "wb") as f:
            f.write(os.urandom(rng.randint(lo, hi)))
    os.chmod(top, 0o755)
    for d in os.listdir(top):
        os.chmod(os.path.join(top, d), 0o755)
    open(done, "w").close()
make(os.path.join(root, "small"), files, 60_000, 140_000, 100)
if "walk" in modes:
    make(os.path.join(root, "tree"), walk, 512, 2048, 1000)
if "imagefolder" in modes and not os.path.exists(os.path.join(root, "jpeg", ".done")):
    # Photo-like content: smooth random colour fields with detail on top, ~500x375, q90.
    import numpy as np
    from PIL import Image
    top = os.path.join(root, "jpeg")
    rng = np.random.default_rng(1)
    for i in range(jpegs):
        w, h = int(rng.integers(400, 600)), int(rng.integers(300, 450))
        base = rng.integers(0, 255, size=(h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((w, h), Image.BICUBIC)
        arr = np.asarray(img, dtype=np.int16) + rng.integers(-24, 24, size=(h, w, 3))
        d = os.path.join(top, f"class{i % 100:03d}")
        os.makedirs(d, exist_ok=True)
        Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(
            os.path.join(d, f"img{i:06d}.JPEG"), quality=90)
    for d in [top] + [os.path.join(top, x) for x in os.listdir(top)]:
        os.chmod(d, 0o755)
    open(os.path.join(top, ".done"), "w").close()
PY
chmod -R a+rX "$SCRATCH/src"
install -m 755 "$STAGEFS" "$SCRATCH/bin/stagefs"
install -m 644 "$HERE/small_epochs.py" "$SCRATCH/bin/"
U=$SCRATCH/user
mkdir -p "$U"
if [[ -n $NVME_MBS ]]; then
  src_mb=$(du -sm "$SCRATCH/src" | cut -f1)
  ram_scratch "$U" "$SCRATCH/ramfs" $((src_mb * 5 / 2 + 1024))
  throttle "$U" stagefs-small "$NVME_MBS"
fi
own_scratch "$U" "$uid"
echo "stagefs: $STAGEFS ($(cd "$REPO" && git describe --always --dirty)); files: $FILES small, $WALK_FILES to list; user: $BENCH_USER; scratch: $U ($(df --output=source "$U" | tail -1)${NVME_MBS:+, throttled to $NVME_MBS MB/s}); load: $(cut -d' ' -f1-3 /proc/loadavg)"
run_job() { # MODE DATA EPOCHS: one `stagefs run` of small_epochs.py over a mount of SRC/DATA
  # (the dataset alone, as a user mounts it: staging of the other datasets would run in the
  # background of the epochs measured).
  as_user "$SCRATCH/bin/stagefs" run --mount "$SCRATCH/src/$2:$U/mnt:$U/cache" -- \
    "$PY" "$SCRATCH/bin/small_epochs.py" "$U/mnt" "$U/drop" "$1" "$3" "$U/mnt"
}
report() { # ROUND MODE SIDE JSON
  python3 - "$@" "$(cut -d' ' -f1 /proc/loadavg)" <<'PY'
import json, sys
r, mode, side, res, load = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
for k, e in enumerate(res["epochs"], 1):
    gb = e["amount"] / 1e9 if mode != "walk" else None
    cpu = e["cpu"] + e["daemon_cpu"]
    per = f"CPU-s/GB {cpu / gb:.3f} (daemon {e['daemon_cpu'] / gb:.3f})" if gb else f"CPU-s {cpu:.2f} (daemon {e['daemon_cpu']:.2f})"
    direct = f" | direct opens {e['direct_opens']} refused {e['direct_refused']}" if "direct_opens" in e else ""
    print(f"round {r} {mode} {side} epoch {k}: {e['secs']:.2f} s, {per}{direct} | load {load}")
PY
}
for r in $(seq 1 "$ROUNDS"); do
  for mode in $MODES; do
    data=small
    [[ $mode == walk ]] && data=tree
    [[ $mode == imagefolder ]] && data=jpeg
    mountpoint -q "$U/mnt" 2>/dev/null && as_user fusermount3 -uz "$U/mnt"
    as_user rm -rf "$U/cache" "$U/mnt" "$U/local"
    as_user mkdir -p "$U/mnt"
    report "$r" "$mode" job1 "$(run_job "$mode" "$data" 3)"
    # A listing's job 2 lists twice: after the remount (cold), then warm with nothing staging.
    report "$r" "$mode" job2 "$(run_job "$mode" "$data" "$([[ $mode == walk ]] && echo 2 || echo 1)")"
    as_user mkdir -p "$U/local"
    as_user cp -r "$SCRATCH/src/$data" "$U/local/$data"
    report "$r" "$mode" local "$(as_user "$PY" "$SCRATCH/bin/small_epochs.py" "$U/local/$data" "$U/drop" "$mode" 3)"
    as_user rm -rf "$U/local" "$U/cache"
  done
done
