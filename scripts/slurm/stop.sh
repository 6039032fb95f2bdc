#!/usr/bin/env bash
# Stops the private cluster started by start.sh DIR: cancels every job first (stopping slurmd
# does not stop running jobs), then stops slurmd, slurmctld and munged by their pid files, and
# removes the nodes' network namespaces and bridge (SLURM_NODES >= 2).
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
  # Gone with its daemon, so a second stop.sh never signals a process that took the pid since.
  rm -f "$f"
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
  kill -9 "$pid" 2>/dev/null
}
for f in "$DIR"/run/slurmd.pid "$DIR"/run/slurmd-*.pid; do stop_pid "$f"; done
stop_pid "$DIR/run/slurmctld.pid"
stop_pid "$DIR/munge/munged.pid"
if [ -f "$DIR/run/netns" ]; then
  while IFS='=' read -r what name; do
    case $what in
      NETNS) ip netns delete "$name" 2>/dev/null ;;
      BRIDGE) ip link delete "$name" 2>/dev/null ;;
    esac
  done <"$DIR/run/netns"
  rm -f "$DIR/run/netns"
fi
exit 0
