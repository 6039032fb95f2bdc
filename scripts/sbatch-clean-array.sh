#!/bin/bash
# The cleaning job over N nodes as a SLURM job array, same result as one node:
#   1. N array tasks:  stagefs convert ... --stats-only --shard I/N   (OUT/_stats.shard-I.json)
#   2. one task:       stagefs convert ... --merge-stats             (OUT/_stats.json)
#   3. N array tasks:  stagefs convert ... --shard I/N               (OUT/part.K.parquet)
# Input file K (in sorted order) belongs to task K mod N; every stage must use the same steps
# (they are recorded in the statistics files and checked).
#
# Submit all three stages, chained with afterok dependencies, from a login node:
#   SRC=/bigdata/raw OUT=/bigdata/processed N=8 scripts/sbatch-clean-array.sh
#SBATCH --job-name=stagefs-clean
#SBATCH --partition=cpu
#SBATCH --nodes=1
#SBATCH --cpus-per-task=16
#SBATCH --mem=3G
#SBATCH --time=01:00:00
#SBATCH --output=%x-%A_%a.out
set -euo pipefail
SRC=${SRC:-/bigdata/raw}
OUT=${OUT:-/bigdata/processed}
N=${N:-8}
STAGEFS=${STAGEFS:-stagefs}
STEPS=(--dropna --filter 'value > 0' --standardize numeric)
COMMON=(--to parquet "${STEPS[@]}" --memory-budget 2G -j "${SLURM_CPUS_PER_TASK:-1}")

case "${STAGE:-submit}" in
  submit)
    script=$(readlink -f "$0")
    stats=$(sbatch --parsable --array=0-$((N - 1)) --export=ALL,STAGE=stats,N="$N" "$script")
    merge=$(sbatch --parsable --dependency=afterok:"$stats" --cpus-per-task=1 \
      --export=ALL,STAGE=merge,N="$N" "$script")
    write=$(sbatch --parsable --array=0-$((N - 1)) --dependency=afterok:"$merge" \
      --export=ALL,STAGE=transform,N="$N" "$script")
    echo "statistics: $stats  merge: $merge  transform: $write"
    ;;
  stats)
    "$STAGEFS" convert "$SRC" "$OUT" "${COMMON[@]}" --stats-only --shard "$SLURM_ARRAY_TASK_ID/$N"
    ;;
  merge)
    "$STAGEFS" convert "$SRC" "$OUT" "${COMMON[@]}" --merge-stats
    ;;
  transform)
    "$STAGEFS" convert "$SRC" "$OUT" "${COMMON[@]}" --shard "$SLURM_ARRAY_TASK_ID/$N"
    ;;
  *)
    echo "unknown STAGE=$STAGE (submit, stats, merge or transform)" >&2
    exit 2
    ;;
esac
