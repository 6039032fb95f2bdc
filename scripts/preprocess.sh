#!/usr/bin/env bash
#SBATCH --job-name=preprocess
#SBATCH --partition=amd
#SBATCH --cpus-per-task=16
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
#
# Job 1 of 2 (CPU partition): clean the raw tables into Parquet ON PERSISTENT STORAGE.
#
# Why /bigdata and not /scratch: /scratch is local to the node this job happens to run on and is
# wiped the moment the job ends. The training job (job 2) starts later, usually on another node
# (a GPU node), and would find nothing: the classic FileNotFoundError. So the handoff between
# the two jobs goes through persistent storage; job 2 then mounts it through stagefs's cache on
# its own node's scratch instead of copying it all first.
#
# Submit with scripts/submit.sh (which chains job 2 after this one), or alone:
#   sbatch scripts/preprocess.sh
# Every path below can be overridden from the environment (sbatch exports it to the job).
set -euo pipefail

BIGDATA=${BIGDATA:-/bigdata/${USER:-$(id -un)}}            # persistent, shared by all nodes
RAW=${RAW:-$BIGDATA/raw}                       # input: CSV/Parquet tables
PROCESSED=${PROCESSED:-$BIGDATA/processed}     # output: cleaned Parquet, read by job 2
STAGEFS=${STAGEFS:-stagefs}
# The whole preprocessing step as one shell command; the default is the real conversion
# (drop rows with missing values, standardize numeric columns; see `stagefs convert --help`).
PREPROCESS_CMD=${PREPROCESS_CMD:-"$STAGEFS" convert "$RAW" "$PROCESSED" --to parquet --dropna --standardize numeric}
export BIGDATA RAW PROCESSED STAGEFS

echo "preprocess: job ${SLURM_JOB_ID:-none} on $(hostname): $RAW -> $PROCESSED"
mkdir -p "$(dirname "$PROCESSED")"
# A failure here fails the job, and `--dependency=afterok` then never starts the training job.
bash -c "$PREPROCESS_CMD"
echo "preprocess: done; $(find "$PROCESSED" -type f | wc -l) files in $PROCESSED"
