#!/usr/bin/env bash
# scripts/train-multinode.sh, unchanged, on a private SLURM (scripts/slurm/start.sh), twice:
# 1. on 2 nodes that share no node-local state (SLURM_NODES=2: each slurmd in network, UTS and
#    mount namespaces of its own: its own address, hostname and scratch directory), the job
#    submitted with --nodes=2 as a user would;
# 2. on one node, its per-node part run as 2 simulated nodes (STAGEFS_SIMULATE_NODES=2: two
#    srun tasks, node id = SLURM_PROCID), the template's mode for a one-node cluster.
# Each node runs 2 ranks (a node-partitioned stagefs.Loader, tests/py/multinode_rank.py,
# standing in for torchrun's ranks). Checks: the index is written once and both mounts start
# from it; each node has its own mount and cache (on 2 nodes: in its own scratch, which neither
# the other node nor the machine sees); every sample comes exactly once per epoch across the 4
# ranks; the two mounts read about one dataset from the source in all (not two); only node 0's
# outputs are synced home.
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
  for c in "$T"/slurm "$T"/slurm2; do "$ROOT/scripts/slurm/stop.sh" "$c" >/dev/null 2>&1; done
  for m in "$T"/scratch/*/node*/data; do
    mountpoint -q "$m" 2>/dev/null && "$STAGEFS" umount "$m" >/dev/null 2>&1
  done
  rm -rf "$T"
}
trap cleanup EXIT
# shellcheck source=tests/slurm_tap.sh
source "$ROOT/tests/slurm_tap.sh"

mkdir -p "$T/bigdata/processed" "$T/jobs"
# 64 MiB of 4 KiB rows whose first int64 is the row id (the fixed cost of a node, the header
# block and one block shared at its part's edge, is then a few per cent).
"$PY" -c "
import numpy as np
a = np.zeros((16384, 512), dtype=np.int64); a[:, 0] = np.arange(16384)
np.save('$T/bigdata/processed/rows.npy', a)"
SIZE=$(stat -c %s "$T/bigdata/processed/rows.npy")

# train_job HOW SCRATCH_OF SBATCH_ARGS...: runs the template on the cluster in $SLURM_CONF with
# node-local scratch at $T/scratch; `SCRATCH_OF K JOB` prints where node K's scratch of JOB
# lies as seen from here. HOW names the run in the checks; SIMULATE=2 for simulated nodes.
# Sets JOB and RESULTS.
train_job() {
  local how=$1 scratch_of=$2
  shift 2
  RESULTS=$T/results-${how// /-}
  mkdir -p "$RESULTS"
  rm -f "$T/bigdata/processed.stagefs-index"
  # Each node: its 2 ranks (SLURM_LOCALID is the task's, not the rank's: unset), then its
  # mount's stats, its hostname and an output file.
  # shellcheck disable=SC2016
  local train='for l in 0 1; do r=$((NODE_ID * 2 + l));
    env -u SLURM_LOCALID '"$PY $ROOT/tests/py/multinode_rank.py"' "$DATA" $r $((NODES * 2)) 2 0 2 '"$RESULTS"'/rank$r.npz & done;
    wait; cp "$DATA/.stagefs/stats" '"$RESULTS"'/stats$NODE_ID.json; hostname > '"$RESULTS"'/host$NODE_ID;
    echo "$NODE_ID" > "$OUT/from-node$NODE_ID"'
  local state=
  JOB=$(BIGDATA="$T/bigdata" SCRATCH_ROOT="$T/scratch" STAGEFS="$STAGEFS" \
    STAGEFS_SIMULATE_NODES=${SIMULATE:-} TRAIN_CMD="$train" WARN_TO=cmd SYNC_EVERY=0 \
    sbatch --parsable "$@" --gpus-per-node=0 --cpus-per-task=1 \
    --partition=amd --time=5 --output="$T/jobs/%j.out" "$ROOT/scripts/train-multinode.sh" 2>"$T/jobs/sbatch.err")
  [ -n "$JOB" ] || not_ok "$how: sbatch: $(cat "$T/jobs/sbatch.err")"
  for _ in $(seq 240); do
    state=$(scontrol show job -o "$JOB" 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobState=//p')
    case $state in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) break ;; esac
    sleep 0.5
  done
  check "$how: the job completes ($state)" test "$state" = COMPLETED
  check "$how: the index is written once, before the nodes mount" test -s "$T/bigdata/processed.stagefs-index"
  check "$how: each node has its own cache" \
    test -d "$($scratch_of 0 "$JOB")/node0/cache" -a -d "$($scratch_of 1 "$JOB")/node1/cache"
  local verdict
  verdict=$("$PY" - "$RESULTS" "$SIZE" <<'EOF'
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
  check "$how: every sample once per epoch; the 2 mounts read $verdict (dataset $SIZE)" test "${verdict%% *}" = ok
  check "$how: only node 0's outputs are synced home" \
    test -f "$T/bigdata/runs/$JOB/from-node0" -a ! -e "$T/bigdata/runs/$JOB/from-node1"
}

# 1. Two nodes that share no scratch: each slurmd mounts its own directory at $T/scratch. Where
#    network namespaces are not to be had (a container without CAP_NET_ADMIN), this part says
#    so and counts as skipped.
CLUSTER=$T/slurm2
two_nodes() { echo "$CLUSTER/nodes/node$1/scratch/$2"; }
if ! command -v ip >/dev/null || ! ip netns add "stagefs-probe-$$" 2>/dev/null; then
  echo "ok - skipped: needs ip(8) and network namespaces: 2 nodes that share no scratch"
else
  ip netns delete "stagefs-probe-$$"
  if ! SLURM_NODES=2 SLURM_NODE_SCRATCH="$T/scratch" "$ROOT/scripts/slurm/start.sh" "$CLUSTER" >/dev/null; then
    not_ok "a private SLURM cluster of 2 nodes starts"
  else
    ok "a private SLURM cluster of 2 nodes starts"
    export SLURM_CONF="$CLUSTER/slurm.conf"
    train_job "2 nodes" two_nodes --nodes=2 --ntasks-per-node=1
    check "2 nodes: each node's part ran on its own host" \
      test "$(cat "$RESULTS/host0" "$RESULTS/host1" 2>/dev/null | tr '\n' ' ')" = "node0 node1 "
    check "2 nodes: neither node sees the other's scratch, nor does the machine" \
      test ! -e "$(two_nodes 0 "$JOB")/node1" -a ! -e "$(two_nodes 1 "$JOB")/node0" -a ! -e "$T/scratch/$JOB"
  fi
  "$ROOT/scripts/slurm/stop.sh" "$CLUSTER" >/dev/null 2>&1
fi

# 2. One node, two simulated.
CLUSTER=$T/slurm
if ! "$ROOT/scripts/slurm/start.sh" "$T/slurm" >/dev/null; then
  not_ok "private SLURM cluster starts"
  summary
  exit 1
fi
export SLURM_CONF="$T/slurm/slurm.conf"
ok "private SLURM cluster starts"
one_node() { echo "$T/scratch/$2"; }
SIMULATE=2 train_job "simulated nodes" one_node --nodes=1 --ntasks-per-node=2
summary
