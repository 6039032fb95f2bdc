#!/usr/bin/env bash
# Stops the private cluster started by start.sh DIR: cancels every job first (stopping slurmd
# does not stop running jobs), then stops slurmd, slurmctld and munged by their pid files.
set -uo pipefail
DIR=${1:?usage: stop.sh DIR}
DIR=$(cd "$DIR" && pwd) || exit 0
export SLURM_CONF="$DIR/slurm.conf"
export PATH="/usr/sbin:$PATH"
if [ -f "$SLURM_CONF" ]; then
  scancel --full --quiet --signal=KILL --state=RUNNING 2>/dev/null
  scancel --quiet 2>/dev/null
  for _ in $(seq 40); do
    [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
    sleep 0.25
  done
fi
stop_pid() {
  local f=$1
  [ -f "$f" ] || return 0
  local pid
  pid=$(cat "$f")
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
  kill -9 "$pid" 2>/dev/null
}
stop_pid "$DIR/run/slurmd.pid"
stop_pid "$DIR/run/slurmctld.pid"
stop_pid "$DIR/munge/munged.pid"
exit 0
