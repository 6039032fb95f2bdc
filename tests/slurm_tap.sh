# Sourced by tests/slurm_e2e.sh and tests/slurm_multinode.sh: their TAP-style checks. T is the
# test's temporary directory (job outputs in $T/jobs); the private cluster's logs are in
# $CLUSTER/log ($T/slurm unless the test says).
PASSED=0
FAILED=0

ok() { echo "ok - $*"; PASSED=$((PASSED + 1)); }

# A failed check, with what explains it: the jobs' outputs and the daemons' last lines.
not_ok() {
  echo "not ok - $*"
  FAILED=$((FAILED + 1))
  echo "--- job outputs:"; tail -n 40 "$T"/jobs/*.out 2>/dev/null
  echo "--- slurmctld:"; tail -n 15 "${CLUSTER:-$T/slurm}/log/slurmctld.log" 2>/dev/null
  echo "--- slurmd:"; tail -n 15 "${CLUSTER:-$T/slurm}"/log/slurmd*.log 2>/dev/null
}

check() { # check DESCRIPTION COMMAND...
  local what=$1
  shift
  if "$@"; then ok "$what"; else not_ok "$what"; fi
}

# Prints "N passed, N failed"; true if none failed.
summary() {
  echo "$PASSED passed, $FAILED failed"
  [ "$FAILED" = 0 ]
}
