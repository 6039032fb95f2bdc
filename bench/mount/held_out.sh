#!/usr/bin/env bash
# The direct path's acceptance check, as a user runs it: ONE `stagefs run --mount SRC:MNT:CACHE
# -- script` as a normal user with no other flags. The script (held_out_epochs.py) reads every
# file under MNT/large with 8 Python threads, three times: epoch 1 from a fresh cache, then two
# warm epochs in the same mount, the page cache dropped before each (the script asks; root drops
# it: a normal user cannot). Then a second `stagefs run` on the warm cache, one epoch (the next
# job of a chain, against the local copy's first epoch). Then the same script over a local copy
# on the same scratch. Prints
# the seconds of each epoch, the warm epochs' ratio to the local copy's, and the daemon's direct
# counters.
#
#   bench/mount/held_out.sh            (as root; SCRATCH=/var/tmp/stagefs-heldout by default,
#                                       the machine's disk: ~1 GB/s like a node's NVMe)
# Knobs: SCRATCH, STAGEFS=target/release/stagefs, BENCH_USER=stagefs-test, FILES=8, MB=256,
# ROUNDS=2 (mount and local alternated), NVME_MBS (set: the user's scratch is a loop device
# over RAM throttled to that many MB/s, like a node's NVMe; this VM's disk is cached by its
# host, so its re-reads run at 3-8 GB/s).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SCRATCH=${SCRATCH:-/var/tmp/stagefs-heldout}
STAGEFS=${STAGEFS:-$REPO/target/release/stagefs}
BENCH_USER=${BENCH_USER:-stagefs-test}
FILES=${FILES:-8} MB=${MB:-256} ROUNDS=${ROUNDS:-2} NVME_MBS=${NVME_MBS:-}
[[ $(id -u) -eq 0 ]] || { echo "run as root (drop_caches, setpriv)" >&2; exit 1; }
uid=$(id -u "$BENCH_USER")
# shellcheck source=bench/mount/scratch.sh
source "$HERE/scratch.sh"
mkdir -p "$SCRATCH/src/large" "$SCRATCH/bin"
chmod 755 "$SCRATCH" "$SCRATCH/src" "$SCRATCH/src/large" "$SCRATCH/bin"
for i in $(seq 0 $((FILES - 1))); do
  [[ -s "$SCRATCH/src/large/f$i.bin" ]] || head -c "${MB}M" /dev/urandom >"$SCRATCH/src/large/f$i.bin"
done
chmod 644 "$SCRATCH"/src/large/*
install -m 755 "$STAGEFS" "$SCRATCH/bin/stagefs"
install -m 644 "$HERE/held_out_epochs.py" "$SCRATCH/bin/"
U=$SCRATCH/user
mkdir -p "$U"
if [[ -n $NVME_MBS ]]; then
  # The user's scratch: the local copy and the cache, each the whole source, and more.
  ram_scratch "$U" "$SCRATCH/ramfs" $((FILES * MB * 5 / 2 + 512))
  throttle "$U" stagefs-heldout "$NVME_MBS"
fi
own_scratch "$U" "$uid"
echo "stagefs: $STAGEFS; data: $FILES x $MB MB; user: $BENCH_USER; scratch: $U ($(df --output=source "$U" | tail -1)${NVME_MBS:+, throttled to $NVME_MBS MB/s}); load: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
  # A mount left by an interrupted run would make the rm below fail on a read-only tree.
  mountpoint -q "$U/mnt" 2>/dev/null && as_user fusermount3 -uz "$U/mnt"
  as_user rm -rf "$U/cache" "$U/mnt" "$U/local"
  as_user mkdir -p "$U/mnt"
  m=$(as_user "$SCRATCH/bin/stagefs" run --mount "$SCRATCH/src:$U/mnt:$U/cache" -- \
    python3 "$SCRATCH/bin/held_out_epochs.py" "$U/mnt/large" "$U/drop" "$U/mnt")
  # Job 2: a new `stagefs run` on the warm cache (the next job of a chain), its first epoch.
  j2=$(as_user env EPOCHS=1 "$SCRATCH/bin/stagefs" run --mount "$SCRATCH/src:$U/mnt:$U/cache" -- \
    python3 "$SCRATCH/bin/held_out_epochs.py" "$U/mnt/large" "$U/drop" "$U/mnt")
  as_user cp -r "$SCRATCH/src" "$U/local"
  l=$(as_user python3 "$SCRATCH/bin/held_out_epochs.py" "$U/local/large" "$U/drop")
  python3 - "$r" "$m" "$l" "$(cut -d' ' -f1 /proc/loadavg)" "$j2" <<'PY'
import json, sys
r, m, l, load = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
j2 = json.loads(sys.argv[5])["epochs"][0]
gb = m["bytes"] / 1e9
pairs = list(zip(m["epochs"], l["epochs"])) + [(j2, l["epochs"][0])]
for k, (a, b) in enumerate(pairs, 1):
    k = k if k <= len(m["epochs"]) else "1 of job 2 (remount)"
    print(f"round {r} epoch {k}: mount {a['secs']:.2f} s, local {b['secs']:.2f} s "
          f"(mount x local {b['secs'] / a['secs']:.2f}) | CPU-s/GB mount {(a['cpu'] + a['daemon_cpu']) / gb:.2f} "
          f"(daemon {a['daemon_cpu'] / gb:.2f}), local {b['cpu'] / gb:.2f} | direct opens "
          f"{a.get('direct_opens')} refused {a.get('direct_refused')}")
print(f"round {r} load at end {load}")
PY
  as_user rm -rf "$U/local" "$U/cache"
done
