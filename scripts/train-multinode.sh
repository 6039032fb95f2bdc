#!/usr/bin/env bash
#SBATCH --job-name=train-multinode
#SBATCH --partition=gpu
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
# As scripts/train.sh: SIGUSR1 to the batch shell five minutes before the limit, which passes it
# on (here through srun to every node), and the job may run again under the same id.
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#
# Training on N nodes × G GPUs, each node reading only its part of the dataset from /bigdata.
#
# - One `stagefs index` of $PROCESSED, written once (here, by the batch step, when missing):
#   every node mounts with `--index`, so no node lists /bigdata.
# - One step task per node (`srun --ntasks-per-node=1`), each running `stagefs run --mount`
#   with its own cache on its own node-local scratch and `--stage-hinted`: the mount stages what
#   this node's loaders declare (stagefs.Loader or stagefs.torch.DistributedSampler with
#   partition="node"), about 1/N of the dataset, not the whole tree.
# - Inside it, torchrun starts G training ranks (--nnodes N --node-rank $SLURM_NODEID,
#   rendezvous on the first node): RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are set,
#   which is what stagefs.Loader reads to find this node (rank // LOCAL_WORLD_SIZE).
# - Outputs (rank 0's checkpoints, on node 0) are synced home once: only node 0's stagefs run
#   has --sync. Time limit and requeue as in scripts/train.sh: on SIGUSR1 the trainers
#   checkpoint and exit with $REQUEUE_EXIT; once every node's stagefs run is done (node 0's
#   after its final sync), this script requeues the job and the next run resumes — also on
#   another number of nodes (stagefs.Loader.load_state_dict splits the rest of the epoch anew).
#
# Run as `sbatch scripts/train-multinode.sh`. The per-node part (node_step) is sent to srun
# as text (sbatch's copy of this script exists on the first node only) and reads SLURM_NODEID
# and SLURM_NNODES; STAGEFS_SIMULATE_NODES=K instead runs K "nodes" as K tasks on one node
# (node id = SLURM_PROCID, each with its own scratch and cache): how tests/slurm_multinode.sh
# checks it on a one-node SLURM.
set -euo pipefail

BIGDATA=${BIGDATA:-/bigdata/${USER:-$(id -un)}}
PROCESSED=${PROCESSED:-$BIGDATA/processed}
RUNS=${RUNS:-$BIGDATA/runs}
INDEX=${INDEX:-$PROCESSED.stagefs-index}
SCRATCH_ROOT=${SCRATCH_ROOT:-/scratch/${USER:-$(id -un)}}
SYNC_EVERY=${SYNC_EVERY:-10m}
STAGEFS=${STAGEFS:-stagefs}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-4}}
GPUS_PER_NODE=${GPUS_PER_NODE##*:}   # "a100:4" -> 4
RDZV_PORT=${RDZV_PORT:-29500}
REQUEUE_EXIT=${REQUEUE_EXIT:-42}
JOB=${SLURM_JOB_ID:-manual}
RESUME_FROM=$RUNS/$JOB
# What each node runs (evaluated on the node, so $NODES, $NODE_ID, $DATA and $OUT are that
# node's); reads $DATA, writes checkpoints to $OUT (rank 0 only).
# shellcheck disable=SC2016
TRAIN_CMD=${TRAIN_CMD:-'torchrun --nnodes "$NODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_ID" --master-addr "$MASTER_ADDR" --master-port "$RDZV_PORT" train.py --data "$DATA" --out "$OUT"'}
# Who gets SLURM's warning on a node: "ranks" (torchrun's children: torchrun itself dies of
# SIGUSR1, it handles TERM/INT/HUP/QUIT only) or "cmd" (a TRAIN_CMD that handles it itself).
WARN_TO=${WARN_TO:-ranks}

node_step() {
  if [ -n "${STAGEFS_SIMULATE_NODES:-}" ]; then
    NODE_ID=$SLURM_PROCID NODES=$STAGEFS_SIMULATE_NODES
  else
    NODE_ID=${SLURM_NODEID:?not in a SLURM step} NODES=${SLURM_NNODES:?not in a SLURM step}
  fi
  SCRATCH=$SCRATCH_ROOT/$JOB/node$NODE_ID
  DATA=$SCRATCH/data
  OUT=$SCRATCH/out
  mkdir -p "$SCRATCH" "$OUT"
  export NODE_ID NODES SCRATCH DATA OUT RESUME_FROM MASTER_ADDR GPUS_PER_NODE RDZV_PORT
  local sync=()
  if [ "$NODE_ID" = 0 ]; then
    sync=(--sync "$OUT:$RESUME_FROM" --every "$SYNC_EVERY")
  fi
  echo "train-multinode: node $NODE_ID of $NODES on $(hostname): data $DATA (cache $SCRATCH/cache)" \
    "${sync[*]:+, outputs -> $RESUME_FROM}"
  # stagefs run forwards the warning to this inner shell, which passes it on (WARN_TO).
  "$STAGEFS" run --mount "$PROCESSED:$DATA:$SCRATCH/cache" \
    --mount-arg=--index="$INDEX" --mount-arg=--stage-hinted "${sync[@]}" \
    -- bash -c 'eval "$TRAIN_CMD" & t=$!
      if [ "$WARN_TO" = ranks ]; then warn="pkill -USR1 -P $t"; else warn="kill -USR1 $t"; fi
      trap "$warn || true" USR1
      trap "kill -TERM $t 2>/dev/null || true" TERM INT
      while :; do s=0; wait $t || s=$?; kill -0 $t 2>/dev/null || exit $s; done'
}

# The batch step (on the first node): the index once, then one task per node.
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n 1 || hostname)}
MASTER_ADDR=${MASTER_ADDR:-$(hostname)}
export BIGDATA PROCESSED RUNS INDEX SCRATCH_ROOT SYNC_EVERY STAGEFS GPUS_PER_NODE RDZV_PORT \
  REQUEUE_EXIT MASTER_ADDR TRAIN_CMD WARN_TO JOB RESUME_FROM
if [ ! -s "$INDEX" ]; then
  echo "train-multinode: indexing $PROCESSED once -> $INDEX"
  "$STAGEFS" index "$PROCESSED" -o "$INDEX"
fi
echo "train-multinode: job $JOB (run $((${SLURM_RESTART_COUNT:-0} + 1))) on ${SLURM_NNODES:-1} nodes"
STEP=(--ntasks-per-node=1)
if [ -n "${STAGEFS_SIMULATE_NODES:-}" ]; then
  STEP=(--nodes=1 --ntasks="$STAGEFS_SIMULATE_NODES" --ntasks-per-node="$STAGEFS_SIMULATE_NODES")
fi
srun "${STEP[@]}" --kill-on-bad-exit=0 bash -c "set -euo pipefail; $(declare -f node_step); node_step" &
child=$!
# This wait-and-requeue is also in scripts/train.sh, on purpose: SLURM runs a spooled copy of a batch
# script, so a template cannot source a shared file beside it; each must stand alone.
# srun passes a signal it gets on to every task: the warning reaches every node.
trap 'kill -USR1 "$child" 2>/dev/null || true' USR1
trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
rc=
while [ -z "$rc" ]; do
  status=0
  wait "$child" || status=$?
  kill -0 "$child" 2>/dev/null || rc=$status
done
trap - USR1 TERM INT
if [ "$rc" = "$REQUEUE_EXIT" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  echo "train-multinode: checkpointed on the warning and synced home; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID" || {
    echo "train-multinode: scontrol requeue failed; submit again to continue from $RESUME_FROM" >&2
    exit "$rc"
  }
  exit 0
fi
exit "$rc"
