#!/bin/bash
# The seed's preprocessing job on one CPU node, with stagefs instead of Dask:
#   read CSV/Parquet from SRC, dropna, keep value > 0, standardize the numeric columns,
#   write OUT/part.N.parquet (one per input file) and OUT/_stats.json.
# Submit:  SRC=/bigdata/raw OUT=/bigdata/processed sbatch scripts/sbatch-clean.sh
# Memory is bounded by --memory-budget whatever the input size, so --mem stays small; pass 1's
# kept rows beyond 30% of the budget spill to node-local scratch ($SLURM_TMPDIR, else $TMPDIR)
# as Arrow IPC, about 0.6x the CSV's size at most, removed when the job ends.
#SBATCH --job-name=stagefs-clean
#SBATCH --partition=cpu
#SBATCH --nodes=1
#SBATCH --cpus-per-task=16
#SBATCH --mem=3G
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
SRC=${SRC:-/bigdata/raw}
OUT=${OUT:-/bigdata/processed}
STAGEFS=${STAGEFS:-stagefs}

"$STAGEFS" convert "$SRC" "$OUT" --to parquet \
  --dropna --filter 'value > 0' --standardize numeric \
  --compression zstd --memory-budget 2G -j "${SLURM_CPUS_PER_TASK:-1}"
