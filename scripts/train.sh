#!/usr/bin/env bash
#SBATCH --job-name=train
#SBATCH --partition=gpu
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
# Five minutes before the time limit, send SIGUSR1 to the batch shell only ("B:"): stagefs run
# (which IS the batch shell, see the `exec` below) forwards it to the training process, so it
# can checkpoint, and syncs what is already written right away.
#SBATCH --signal=B:USR1@300
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

mkdir -p "$SCRATCH"
MOUNT_ARGS=(--mount "$PROCESSED:$DATA:$SCRATCH/cache")
if [ "$USE_MOUNT" = 0 ]; then
  MOUNT_ARGS=()
  DATA=$PROCESSED
fi
export BIGDATA PROCESSED RUNS SCRATCH DATA OUT
echo "train: job ${SLURM_JOB_ID:-manual} on $(hostname): data $DATA, outputs $OUT -> $RUNS/${SLURM_JOB_ID:-manual}"

# `exec`: stagefs replaces this shell, so it is the process SLURM signals (B:USR1, SIGTERM) and
# the job's exit status is the training command's. Without exec, bash would receive SIGUSR1,
# die of it, and no final sync would happen.
exec "$STAGEFS" run "${MOUNT_ARGS[@]}" \
  --sync "$OUT:$RUNS/${SLURM_JOB_ID:-manual}" \
  --every "$SYNC_EVERY" \
  -- bash -c "$TRAIN_CMD"
