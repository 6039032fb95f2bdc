#!/usr/bin/env bash
# Starts a private single-node SLURM cluster (munged, slurmctld, slurmd) with everything under
# DIR: keys, sockets, state, spool, logs. No systemd, no files outside DIR. Run as root (the
# daemons run as root; SlurmUser=root). Partitions: `amd` (default) and `gpu`, both on this
# node; `gpu` has no GRES, so no GPU is needed to test job scripts that ask for that partition.
#
#   scripts/slurm/start.sh DIR            # prints the export line for SLURM_CONF
#   export SLURM_CONF=DIR/slurm.conf      # every client command (sbatch, squeue...) needs it
#   scripts/slurm/stop.sh DIR
#
# Optional environment:
#   SLURM_SCRATCH_ROOT  if set, an Epilog deletes $SLURM_SCRATCH_ROOT/<jobid> when each job
#                       ends, like a cluster's node-local /scratch that is wiped at job end.
#   SLURM_KILLWAIT      seconds between SIGTERM and SIGKILL at a time limit (default 30).
#
# Pitfalls handled here (each one costs an afternoon otherwise):
#   - munged refuses a socket directory that others can write into: the directory is 0755;
#     clients and daemons find the socket through AuthInfo=socket=... in slurm.conf.
#   - the node line must match the hardware or slurmd registers as invalid: it comes from
#     `slurmd -C`.
#   - jobs submitted before slurmd has registered stay pending with reason "Nodes required for
#     job are DOWN": we wait until `sinfo` shows the node idle.
#   - stopping slurmd does not stop jobs: stop.sh cancels them first.
set -euo pipefail
DIR=${1:?usage: start.sh DIR}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
SBIN=/usr/sbin
for b in munged mungekey slurmctld slurmd; do
  command -v "$b" >/dev/null || [ -x "$SBIN/$b" ] || {
    echo "start.sh: $b not found; install: apt-get install slurmctld slurmd slurm-client munge" >&2
    exit 1
  }
done
export PATH="$SBIN:$PATH"

mkdir -p "$DIR"/{munge,state,spool,log,run}
chmod 0755 "$DIR" "$DIR/munge"
chmod 0700 "$DIR/state" "$DIR/spool"

# --- munge: a fresh key for this private cluster.
if [ ! -s "$DIR/munge/munge.key" ]; then
  mungekey --create --keyfile="$DIR/munge/munge.key" 2>/dev/null ||
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
fi
chmod 0600 "$DIR/munge/munge.key"
SOCK="$DIR/munge/munge.socket.2"
munged --force \
  --socket="$SOCK" \
  --key-file="$DIR/munge/munge.key" \
  --pid-file="$DIR/munge/munged.pid" \
  --log-file="$DIR/log/munged.log" \
  --seed-file="$DIR/munge/munged.seed"
for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.1; done
munge --socket="$SOCK" -n | unmunge --socket="$SOCK" >/dev/null || {
  echo "start.sh: munge does not work; see $DIR/log/munged.log" >&2
  exit 1
}

# --- slurm.conf: this node as reported by slurmd -C, two partitions, no accounting.
NODE_LINE=$(slurmd -C | head -n1)
NODE=$(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' <<<"$NODE_LINE")
HOST=$(hostname -s)
# Free ports picked at random in a range unlikely to be in use, so that two clusters (or a
# system one) do not collide.
PORT=$((20000 + RANDOM % 20000))
EPILOG_LINE=""
if [ -n "${SLURM_SCRATCH_ROOT:-}" ]; then
  cat >"$DIR/epilog.sh" <<EOS
#!/bin/sh
# Node-local scratch is wiped when the job ends: only what was synced survives.
[ -n "\$SLURM_JOB_ID" ] && rm -rf "$SLURM_SCRATCH_ROOT/\$SLURM_JOB_ID"
exit 0
EOS
  chmod 0755 "$DIR/epilog.sh"
  EPILOG_LINE="Epilog=$DIR/epilog.sh"
fi
cat >"$DIR/slurm.conf" <<EOF2
ClusterName=stagefs-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
AuthInfo=socket=$SOCK
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
KillWait=${SLURM_KILLWAIT:-30}
MinJobAge=600
SlurmdTimeout=300
InactiveLimit=0
$EPILOG_LINE
$NODE_LINE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=amd Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$NODE MaxTime=INFINITE State=UP
EOF2
# slurmd -C prints an UpTime= field on a second line only; the node line is clean.
export SLURM_CONF="$DIR/slurm.conf"

slurmctld -f "$SLURM_CONF" -i
slurmd -f "$SLURM_CONF" -N "$NODE"

for _ in $(seq 120); do
  state=$(sinfo -h -n "$NODE" -o '%T' 2>/dev/null | head -n1 || true)
  case "$state" in idle*) break ;; esac
  sleep 0.5
done
case "${state:-}" in
  idle*) ;;
  *)
    echo "start.sh: node $NODE not idle (state: ${state:-none}); logs in $DIR/log" >&2
    tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
    exit 1
    ;;
esac
echo "export SLURM_CONF=$SLURM_CONF"
