#!/usr/bin/env bash
#SBATCH --job-name=train
#SBATCH --partition=gpu
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
# A requeued run appends to the same log instead of truncating it.
#SBATCH --open-mode=append
# Five minutes before the time limit, send SIGUSR1 to the batch shell only ("B:"): this shell
# passes it to stagefs run, which forwards it to the training process, so it can checkpoint,
# and syncs what is already written right away.
#SBATCH --signal=B:USR1@300
# The job may run again under the same id: after a warning checkpoint (below: this script calls
# `scontrol requeue`), and on preemption or node failure (SLURM requeues by itself).
#SBATCH --requeue
#
# Job 2 of 2 (GPU partition): train on the preprocessed data, keep the outputs.
#
# - Input: job 1 wrote it to persistent storage ($PROCESSED). `--mount` shows it at
#   $SCRATCH/data at once and copies what is read into this node's scratch as training goes: no
#   "rsync everything to /scratch first" step.
# - Output: training writes checkpoints to fast node-local $SCRATCH/out. /scratch is wiped when
#   the job ends, so `--sync` copies new and changed files to persistent storage every
#   $SYNC_EVERY, on the SIGUSR1 warning, on SIGTERM (time limit, scancel) and when training
#   exits. Each copy is crash-safe: $RUNS/<jobid> holds complete files only.
# - Time limit: on the warning the trainer checkpoints (model, optimizer, loader position) and
#   exits with $REQUEUE_EXIT; once stagefs run has synced that checkpoint home and exited, this
#   script requeues the job. The next run (same job id, SLURM_RESTART_COUNT=1, 2, ...) finds the
#   newest complete checkpoint in $RUNS/<jobid> ($RESUME_FROM) and continues mid-epoch.
#   SLURM itself never requeues a job that hit its time limit (--requeue covers preemption and
#   node failure), and an exit status cannot ask it to (RequeueExit is the admin's slurm.conf),
#   so the requeue is this script's, after the final sync: a requeue issued while stagefs run
#   still syncs would kill the sync.
set -euo pipefail

BIGDATA=${BIGDATA:-/bigdata/${USER:-$(id -un)}}
PROCESSED=${PROCESSED:-$BIGDATA/processed}     # written by job 1
RUNS=${RUNS:-$BIGDATA/runs}                    # persistent home of every run's outputs
SCRATCH_ROOT=${SCRATCH_ROOT:-/scratch/${USER:-$(id -un)}}   # node-local, wiped at job end
SCRATCH=$SCRATCH_ROOT/${SLURM_JOB_ID:-manual}
SYNC_EVERY=${SYNC_EVERY:-10m}
STAGEFS=${STAGEFS:-stagefs}
# 1 = read the data through the stagefs mount; 0 = read $PROCESSED directly (no FUSE on the node).
USE_MOUNT=${USE_MOUNT:-1}
DATA=$SCRATCH/data
OUT=$SCRATCH/out
# The training command: it reads $DATA and writes checkpoints to $OUT.
TRAIN_CMD=${TRAIN_CMD:-python train.py --data "$DATA" --out "$OUT"}
# The trainer's exit status for "checkpointed on the warning, run me again"
# (examples/train_stagefs.py --requeue-exit).
REQUEUE_EXIT=${REQUEUE_EXIT:-42}
# Where a requeued run finds its checkpoints: what stagefs run synced home for this job id.
RESUME_FROM=$RUNS/${SLURM_JOB_ID:-manual}

mkdir -p "$SCRATCH"
MOUNT_ARGS=(--mount "$PROCESSED:$DATA:$SCRATCH/cache")
if [ "$USE_MOUNT" = 0 ]; then
  MOUNT_ARGS=()
  DATA=$PROCESSED
fi
export BIGDATA PROCESSED RUNS SCRATCH DATA OUT RESUME_FROM
echo "train: job ${SLURM_JOB_ID:-manual} (run $((${SLURM_RESTART_COUNT:-0} + 1))) on $(hostname):" \
  "data $DATA, outputs $OUT -> $RUNS/${SLURM_JOB_ID:-manual}"

# stagefs run in the background, this shell passing SLURM's signals on: bash runs a trap only
# between commands, and `wait` is one it interrupts. (With `exec`, nothing could run after
# stagefs run to requeue; without the traps, bash would die of SIGUSR1 and skip the final sync.)
"$STAGEFS" run "${MOUNT_ARGS[@]}" \
  --sync "$OUT:$RUNS/${SLURM_JOB_ID:-manual}" \
  --every "$SYNC_EVERY" \
  -- bash -c "$TRAIN_CMD" &
child=$!
# This wait-and-requeue is also in scripts/train-multinode.sh, on purpose: SLURM runs a spooled copy of a batch
# script, so a template cannot source a shared file beside it; each must stand alone.
trap 'kill -USR1 "$child" 2>/dev/null || true' USR1
trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
rc=
while [ -z "$rc" ]; do
  status=0
  wait "$child" || status=$?
  # Interrupted by a forwarded signal: stagefs run still runs, wait again.
  kill -0 "$child" 2>/dev/null || rc=$status
done
trap - USR1 TERM INT
if [ "$rc" = "$REQUEUE_EXIT" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  echo "train: checkpointed on the warning and synced home; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID" || {
    echo "train: scontrol requeue failed; submit this script again to continue from $RESUME_FROM" >&2
    exit "$rc"
  }
  exit 0
fi
exit "$rc"
