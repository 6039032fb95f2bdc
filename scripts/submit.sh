#!/usr/bin/env bash
# Submits the two-job pipeline: preprocess (CPU partition) then train (GPU partition), the
# second starting only if the first succeeded (`--dependency=afterok`).
#
#   scripts/submit.sh                       # paths from the defaults in the two job scripts
#   BIGDATA=/bigdata/me/projectX scripts/submit.sh
#
# Why two jobs: preprocessing needs many CPUs and no GPU; holding a GPU node while it runs wastes
# it. Why the data goes through /bigdata between them: each job's /scratch is on its own node
# and is wiped when the job ends, so job 2 cannot see job 1's /scratch.
#
# Environment (all optional): every variable the job scripts read (BIGDATA, RAW, PROCESSED,
# RUNS, SCRATCH_ROOT, STAGEFS, PREPROCESS_CMD, TRAIN_CMD, SYNC_EVERY, USE_MOUNT) is passed to the
# jobs, plus
#   PREPROCESS_SBATCH_OPTS / TRAIN_SBATCH_OPTS   extra sbatch options (override #SBATCH lines),
#                                                e.g. "--time=10 --cpus-per-task=4"
# Prints the two job ids, one per line.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
read -r -a PRE_OPTS <<<"${PREPROCESS_SBATCH_OPTS:-}"
read -r -a TRAIN_OPTS <<<"${TRAIN_SBATCH_OPTS:-}"

# --parsable prints "jobid" (or "jobid;cluster"): keep the id only.
PRE=$(sbatch --parsable "${PRE_OPTS[@]}" "$HERE/preprocess.sh")
PRE=${PRE%%;*}
# afterok: start only once job $PRE has completed with exit code 0. If it fails, the training
# job stays pending with reason DependencyNeverSatisfied (cancel it with scancel).
TRAIN=$(sbatch --parsable --dependency=afterok:"$PRE" "${TRAIN_OPTS[@]}" "$HERE/train.sh")
TRAIN=${TRAIN%%;*}
echo "$PRE"
echo "$TRAIN"
echo "submitted: preprocess $PRE, then train $TRAIN (after $PRE succeeds); watch: squeue -u ${USER:-$(id -un)}" >&2
