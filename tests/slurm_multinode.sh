#!/usr/bin/env bash
# scripts/train-multinode.sh on a real single-node SLURM (scripts/slurm/start.sh), its per-node
# part run as 2 simulated nodes (STAGEFS_SIMULATE_NODES=2: two srun tasks, node id =
# SLURM_PROCID), 2 ranks each (a node-partitioned stagefs.Loader, tests/py/multinode_rank.py,
# standing in for torchrun's ranks). Checks: the index is written once and both mounts start
# from it; each node has its own mount and cache; every sample comes exactly once per epoch
# across the 4 ranks; the two mounts read about one dataset from the source in all (not two);
# only node 0's outputs are synced home. A real multi-node run needs several machines with
# SLURM, FUSE and shared storage; this machine has one.
# Needs root (the SLURM daemons run as root). Prints "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STAGEFS=${STAGEFS_BIN:-$ROOT/target/debug/stagefs}
PY=${PYTHON:-$ROOT/.venv/bin/python}
if [ "$(id -u)" != 0 ]; then
  echo "slurm_multinode: SKIPPED (needs root to run the SLURM daemons)"
  exit 0
fi
if [ ! -x /usr/sbin/slurmctld ] || ! command -v sbatch >/dev/null; then
  echo "slurm_multinode: SKIPPED (SLURM not installed)"
  exit 0
fi
if ! "$PY" -c 'import stagefs, numpy' 2>/dev/null; then
  echo "slurm_multinode: SKIPPED (needs the stagefs Python package: scripts/env.sh)"
  exit 0
fi
[ -x "$STAGEFS" ] || { echo "slurm_multinode: build first: $STAGEFS missing" >&2; exit 1; }

T=$(mktemp -d /tmp/stagefs-slurm-mn.XXXXXX)
chmod 0755 "$T"
cleanup() {
  "$ROOT/scripts/slurm/stop.sh" "$T/slurm" >/dev/null 2>&1
  for m in "$T"/scratch/*/node*/data; do
    mountpoint -q "$m" 2>/dev/null && "$STAGEFS" umount "$m" >/dev/null 2>&1
  done
  rm -rf "$T"
}
trap cleanup EXIT
# shellcheck source=tests/slurm_tap.sh
source "$ROOT/tests/slurm_tap.sh"

if ! "$ROOT/scripts/slurm/start.sh" "$T/slurm" >/dev/null; then
  not_ok "private SLURM cluster starts"
  summary
  exit 1
fi
export SLURM_CONF="$T/slurm/slurm.conf"
ok "private SLURM cluster starts"

mkdir -p "$T/bigdata/processed" "$T/results" "$T/jobs"
# 64 MiB of 4 KiB rows whose first int64 is the row id (the fixed cost of a node, the header
# block and one block shared at its part's edge, is then a few per cent).
"$PY" -c "
import numpy as np
a = np.zeros((16384, 512), dtype=np.int64); a[:, 0] = np.arange(16384)
np.save('$T/bigdata/processed/rows.npy', a)"
SIZE=$(stat -c %s "$T/bigdata/processed/rows.npy")

# Each simulated node: its 2 ranks (SLURM_LOCALID is the task's, not the rank's: unset), then
# its mount's stats and an output file.
# shellcheck disable=SC2016
TRAIN='for l in 0 1; do r=$((NODE_ID * 2 + l));
  env -u SLURM_LOCALID '"$PY $ROOT/tests/py/multinode_rank.py"' "$DATA" $r $((NODES * 2)) 2 0 2 '"$T/results"'/rank$r.npz & done;
  wait; cp "$DATA/.stagefs/stats" '"$T/results"'/stats$NODE_ID.json; echo "$NODE_ID" > "$OUT/from-node$NODE_ID"'
job=$(BIGDATA="$T/bigdata" SCRATCH_ROOT="$T/scratch" STAGEFS="$STAGEFS" STAGEFS_SIMULATE_NODES=2 \
  TRAIN_CMD="$TRAIN" WARN_TO=cmd SYNC_EVERY=0 \
  sbatch --parsable --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 \
  --partition=amd --time=5 --output="$T/jobs/%j.out" "$ROOT/scripts/train-multinode.sh")
state=
for _ in $(seq 240); do
  state=$(scontrol show job -o "$job" 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobState=//p')
  case $state in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) break ;; esac
  sleep 0.5
done
check "the job completes ($state)" test "$state" = COMPLETED
check "the index is written once, before the nodes mount" test -s "$T/bigdata/processed.stagefs-index"
check "each node has its own cache" test -d "$T/scratch/$job/node0/cache" -a -d "$T/scratch/$job/node1/cache"
verdict=$("$PY" - "$T/results" "$SIZE" <<'EOF'
import json, sys
import numpy as np
d, size = sys.argv[1], int(sys.argv[2])
ranks = [np.load(f"{d}/rank{r}.npz") for r in range(4)]
for e in range(2):
    c = np.bincount(np.concatenate([z[f"e{e}"] for z in ranks]), minlength=16384)
    assert (c == 1).all(), f"epoch {e}: not exactly once"
read = [json.load(open(f"{d}/stats{n}.json"))["source_bytes_read"] for n in range(2)]
assert sum(read) <= 1.1 * size, f"{read} for {size}"
assert all(r >= 0.4 * size for r in read), read
print(f"ok {read}")
EOF
)
check "every sample once per epoch; the 2 mounts read $verdict (dataset $SIZE)" test "${verdict%% *}" = ok
check "only node 0's outputs are synced home" \
  test -f "$T/bigdata/runs/$job/from-node0" -a ! -e "$T/bigdata/runs/$job/from-node1"
summary
