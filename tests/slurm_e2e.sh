#!/usr/bin/env bash
# The sbatch templates on a real single-node SLURM (Debian's slurmctld/slurmd/munge, started by
# scripts/slurm/start.sh under a temp dir). Scaled down: tiny data, 1-5 minute limits, a
# stand-in trainer (tests/slurm_train.py) and a cp-based preprocessing command, so that this test
# does not depend on `stagefs convert`. Checks:
#   1. scripts/submit.sh chains preprocess -> train with --dependency=afterok; training waits,
#      sees exactly the preprocessed data, and its outputs reach "persistent" storage although
#      the job's scratch is wiped at job end (an Epilog does that, like a real cluster).
#   2. a failed preprocess never starts training (DependencyNeverSatisfied).
#   3. a training job warned with `scancel --signal=USR1 --batch` checkpoints and syncs while
#      still running, then is killed by its time limit, and its last checkpoint is still home.
#   4. requeue: examples/train_stagefs.py (torch, CPU, deterministic) under scripts/train.sh is
#      warned mid-epoch, checkpoints model/optimizer/loader state, exits; stagefs run syncs the
#      checkpoint home, train.sh requeues the job; the next run resumes from the checkpoint on
#      "persistent" storage and finishes. Its final weights and per-step sample checksums equal
#      those of an uninterrupted run. (Skipped without torch and the stagefs Python package.)
# Needs root (the daemons run as root). Prints "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STAGEFS=${STAGEFS_BIN:-$ROOT/target/debug/stagefs}
if [ "$(id -u)" != 0 ]; then
  echo "slurm_e2e: SKIPPED (needs root to run the SLURM daemons)"
  exit 0
fi
if [ ! -x /usr/sbin/slurmctld ] || ! command -v sbatch >/dev/null; then
  if [ -n "${CI:-}" ]; then
    echo "slurm_e2e: SLURM not installed (apt-get install slurmctld slurmd slurm-client munge)" >&2
    exit 1
  fi
  echo "slurm_e2e: SKIPPED (SLURM not installed)"
  exit 0
fi
[ -x "$STAGEFS" ] || { echo "slurm_e2e: build first: $STAGEFS missing" >&2; exit 1; }

T=$(mktemp -d /tmp/stagefs-slurm.XXXXXX)
chmod 0755 "$T"
cleanup() {
  "$ROOT/scripts/slurm/stop.sh" "$T/slurm" >/dev/null 2>&1
  rm -rf "$T"
}
trap cleanup EXIT

# shellcheck source=tests/slurm_tap.sh
source "$ROOT/tests/slurm_tap.sh"
job_field() { scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p"; }
wait_done() { # wait_done JOBID TIMEOUT_S -> prints the final state
  local state
  for _ in $(seq $((${2} * 2))); do
    state=$(job_field "$1" JobState)
    case "$state" in
      COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | DEADLINE)
        echo "$state"
        return
        ;;
    esac
    sleep 0.5
  done
  echo "STILL-${state:-UNKNOWN}"
}
wait_file() { # wait_file PATH TIMEOUT_S
  for _ in $(seq $((${2} * 10))); do [ -e "$1" ] && return 0; sleep 0.1; done
  return 1
}
uniform_ckpt() { # a complete checkpoint: 1 MiB, every byte the same step number
  [ "$(stat -c %s "$1")" = 1048576 ] &&
    [ "$(od -An -v -tu1 "$1" | tr -s ' ' '\n' | grep -v '^$' | sort -u | wc -l)" = 1 ]
}
same_data() { # the trainer's seen.txt lists exactly the files (and hashes) of PROCESSED
  (cd "$PROCESSED" && find . -type f -printf '%P\n' | sort | while read -r f; do
    echo "$f $(sha256sum "$f" | cut -d' ' -f1)"
  done) | diff - "$1" >/dev/null
}

export SLURM_SCRATCH_ROOT="$T/scratch"
if ! SLURM_KILLWAIT=20 "$ROOT/scripts/slurm/start.sh" "$T/slurm" >/dev/null; then
  not_ok "private SLURM cluster starts"
  summary
  exit 1
fi
export SLURM_CONF="$T/slurm/slurm.conf"
ok "private SLURM cluster starts (partitions: $(sinfo -h -o %P | tr '\n' ' '))"

# Inputs on "persistent storage".
export BIGDATA="$T/bigdata" RAW="$T/bigdata/raw" PROCESSED="$T/bigdata/processed"
export RUNS="$T/bigdata/runs" SCRATCH_ROOT="$T/scratch" STAGEFS
mkdir -p "$RAW" "$SCRATCH_ROOT" "$T/jobs"
for i in 1 2 3; do
  { echo "x,y"; for r in $(seq 50); do echo "$((r * i)),$((r + i))"; done; } >"$RAW/part-$i.csv"
done
# The real mount when this build has it; otherwise training reads $PROCESSED directly.
if "$STAGEFS" mount --help 2>/dev/null | grep -q -- '--cache'; then USE_MOUNT=1; else USE_MOUNT=0; fi
export USE_MOUNT
# sleep 3: long enough to see the training job held back by its dependency.
export PREPROCESS_CMD='sleep 3; mkdir -p "$PROCESSED/tables" && for f in "$RAW"/*.csv; do grep -v "^$" "$f" > "$PROCESSED/tables/$(basename "$f" .csv).clean.csv"; done'
export PREPROCESS_SBATCH_OPTS="--cpus-per-task=1 --time=5 --output=$T/jobs/%x-%j.out"
export TRAIN_SBATCH_OPTS="--cpus-per-task=1 --time=5 --output=$T/jobs/%x-%j.out"
export SYNC_EVERY=1s
export TRAIN_CMD="python3 $ROOT/tests/slurm_train.py --data \"\$DATA\" --out \"\$OUT\" --steps 6 --step-seconds 0.3"

# --- 1. the chain.
cd "$T"
IDS=$("$ROOT/scripts/submit.sh" 2>/dev/null) || not_ok "submit.sh runs"
PRE=$(sed -n 1p <<<"$IDS")
TRAIN=$(sed -n 2p <<<"$IDS")
check "submit.sh printed two job ids ($PRE, $TRAIN)" test -n "$PRE" -a -n "$TRAIN"
check "training depends on preprocess (afterok)" \
  grep -q "afterok:$PRE" <<<"$(job_field "$TRAIN" Dependency)"
check "training waits while preprocess runs (reason: $(job_field "$TRAIN" Reason))" \
  [ "$(job_field "$TRAIN" Reason)" = Dependency ]
check "preprocess job (partition amd) completed" [ "$(wait_done "$PRE" 120)" = COMPLETED ]
check "training job (partition $(job_field "$TRAIN" Partition)) completed" \
  [ "$(wait_done "$TRAIN" 180)" = COMPLETED ]
OUTD="$RUNS/$TRAIN"
check "training saw exactly the preprocessed data (USE_MOUNT=$USE_MOUNT)" same_data "$OUTD/seen.txt"
check "all outputs reached persistent storage" \
  test -e "$OUTD/done.txt" -a -e "$OUTD/step-5.txt"
check "synced checkpoint is complete" uniform_ckpt "$OUTD/ckpt.bin"
check "node-local scratch was wiped at job end" test ! -e "$SCRATCH_ROOT/$TRAIN"
check "job log says where the outputs went" grep -q "are in $OUTD" "$T/jobs/train-$TRAIN.out"

# --- 2. a failed preprocess never starts training.
IDS=$(PREPROCESS_CMD='echo broken >&2; exit 3' "$ROOT/scripts/submit.sh" 2>/dev/null)
PRE2=$(sed -n 1p <<<"$IDS")
TRAIN2=$(sed -n 2p <<<"$IDS")
check "failed preprocess ends FAILED" [ "$(wait_done "$PRE2" 60)" = FAILED ]
for _ in $(seq 40); do
  [ "$(job_field "$TRAIN2" Reason)" = DependencyNeverSatisfied ] && break
  sleep 0.5
done
check "training never starts after a failed preprocess" \
  test "$(job_field "$TRAIN2" Reason)" = DependencyNeverSatisfied \
  -a "$(job_field "$TRAIN2" JobState)" = PENDING
scancel "$TRAIN2"

# --- 3. warned with USR1, then killed by the time limit.
export SYNC_EVERY=10m # only the USR1 sync and the final sync can bring files home
export TRAIN_CMD="python3 $ROOT/tests/slurm_train.py --data \"\$DATA\" --out \"\$OUT\" --steps 100000 --step-seconds 0.2"
# A 1-minute limit is inside the template's 300 s warning window, so SLURM would send its own
# USR1 at once; --signal=B:URG@1 replaces it with a signal that is ignored, so that the USR1
# below (the one `scancel` sends) is the only one.
J=$(sbatch --parsable --cpus-per-task=1 --time=1 --signal=B:URG@1 \
  --output="$T/jobs/%x-%j.out" "$ROOT/scripts/train.sh")
J=${J%%;*}
check "long training job starts" wait_file "$SCRATCH_ROOT/$J/out/step-3.txt" 60
check "no warning checkpoint before the warning" test ! -e "$SCRATCH_ROOT/$J/out/ckpt-usr1.txt"
scancel --signal=USR1 --batch "$J"
# The trainer writes its checkpoint just after the immediate USR1 sync; the follow-up syncs
# (every 30 s after a warning) bring it home before the 1-minute limit.
check "USR1 makes the trainer checkpoint and stagefs sync it while the job runs" \
  wait_file "$RUNS/$J/ckpt-usr1.txt" 50
check "job still running after USR1" [ "$(job_field "$J" JobState)" = RUNNING ]
check "job ends at its time limit (TIMEOUT)" [ "$(wait_done "$J" 240)" = TIMEOUT ]
check "checkpoint written on SIGTERM reached persistent storage" test -e "$RUNS/$J/final-term.txt"
check "last synced checkpoint is complete" uniform_ckpt "$RUNS/$J/ckpt.bin"
check "no temporaries left in the run directory" \
  [ -z "$(find "$RUNS/$J" -name '.stagefs-tmp.*')" ]
check "its scratch was wiped" test ! -e "$SCRATCH_ROOT/$J"
check "no mount left behind on the node" test -z "$(grep -F "$SCRATCH_ROOT" /proc/self/mounts)"
grep -E "stagefs run: (SIGUSR1|SIGTERM|final|outputs)" "$T/jobs/train-$J.out" | sed 's/^/    /'

# --- 4. requeued mid-epoch, resumed from persistent storage: the same training as without.
PY=${STAGEFS_PYTHON:-$(command -v python3)}
if ! "$PY" -c 'import numpy, torch, stagefs' 2>/dev/null; then
  echo "ok - skipped: needs torch, numpy and the stagefs Python package for $PY (scripts/env.sh)"
else
  IMGS="$PROCESSED/imgs"
  mkdir -p "$IMGS"
  "$PY" - "$IMGS" <<'EOF2'
import sys
import numpy as np
d = sys.argv[1]
rng = np.random.default_rng(0)
np.save(f"{d}/images.npy", rng.integers(0, 256, (60, 20, 20, 3), dtype=np.uint8))
np.save(f"{d}/labels.npy", rng.integers(0, 4, 60).astype(np.int64))
open(f"{d}/classes.txt", "w").write("a\nb\nc\nd\n")
EOF2
  # 60 samples in batches of 8: 8 steps per epoch, so step 11 is 3 batches into epoch 1.
  ARGS="--steps 24 --batch-size 8 --crop 16 --seed 3 --threads 1 --device cpu --ckpt-every 5"
  # shellcheck disable=SC2086
  "$PY" "$ROOT/examples/train_stagefs.py" "$IMGS" $ARGS --out "$T/ref" >"$T/jobs/reference.out" 2>&1
  check "uninterrupted reference run finished" test -s "$T/ref/weights.sha256"
  export SYNC_EVERY=2s
  export TRAIN_CMD="$PY $ROOT/examples/train_stagefs.py \"\$DATA/imgs\" $ARGS --out \"\$OUT\" --step-sleep 0.4"
  # As in 3: --signal=B:URG@1 replaces the template's 300 s warning (which a short limit would
  # trigger at once), so the USR1 below is the only warning.
  J=$(sbatch --parsable --cpus-per-task=1 --time=10 --signal=B:URG@1 \
    --output="$T/jobs/%x-%j.out" "$ROOT/scripts/train.sh")
  J=${J%%;*}
  steps_done() { cat "$SCRATCH_ROOT/$J"/out/steps-*.txt 2>/dev/null | wc -l; }
  # Importing torch alone can take a minute on a loaded machine.
  for _ in $(seq 3000); do [ "$(steps_done)" -ge 11 ] && break; sleep 0.1; done
  check "requeue job trains (step $(steps_done) of 24 before the warning)" [ "$(steps_done)" -ge 11 ]
  scancel --signal=USR1 --batch "$J"
  for _ in $(seq 240); do [ "$(job_field "$J" Restarts)" -ge 1 ] 2>/dev/null && break; sleep 0.5; done
  check "the warned job was requeued (restarts: $(job_field "$J" Restarts))" \
    [ "$(job_field "$J" Restarts)" -ge 1 ]
  check "requeued job completed" [ "$(wait_done "$J" 300)" = COMPLETED ]
  LOG="$T/jobs/train-$J.out"
  check "the warning checkpoint was mid-epoch and synced home before the requeue" \
    grep -qE "resumed from $RUNS/$J/ckpt-[0-9]+\.pt: step [0-9]+, epoch [0-9]+, mid-epoch" "$LOG"
  check "checkpoints are on persistent storage" test -n "$(ls "$RUNS/$J"/ckpt-*.pt 2>/dev/null)"
  check "final weights equal the uninterrupted run's" cmp -s "$T/ref/weights.sha256" "$RUNS/$J/weights.sha256"
  # Steps run twice (after the last checkpoint before the stop) must agree; then every step's
  # samples equal the reference's.
  sort -u "$RUNS/$J"/steps-*.txt | sort -k1,1n >"$T/steps-requeued.txt"
  check "each step's samples (checksums of 24 steps) equal the uninterrupted run's" \
    cmp -s <(sort -k1,1n "$T/ref"/steps-*.txt) "$T/steps-requeued.txt"
  grep -E "^(train:|resumed|checkpoint|SIGUSR1|stagefs run: SIGUSR1)" "$LOG" | sed 's/^/    /'
fi

summary
