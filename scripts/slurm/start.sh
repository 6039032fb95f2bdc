#!/usr/bin/env bash
# Starts a private SLURM cluster (munged, slurmctld, slurmd) with everything under DIR: keys,
# sockets, state, spool, logs. No systemd, no files outside DIR but for SLURM_NODES' namespaces
# and bridge, which stop.sh removes. Run as root (the daemons run as root; SlurmUser=root).
# Partitions: `amd` (default) and `gpu`, both on every node; `gpu` has no GRES, so no GPU is
# needed to test job scripts that ask for that partition.
#
# One node by default: this machine. With SLURM_NODES=N (N >= 2), N nodes node0..node{N-1} on
# this one machine that share no node-local state, as the nodes of a cluster do: each slurmd
# runs in network, UTS and mount namespaces of its own (its own address on a private bridge to
# the controller, hostname nodeK, and, with SLURM_NODE_SCRATCH, its own directory mounted at
# that path), while the rest of the file system stands for the shared storage.
#
#   scripts/slurm/start.sh DIR            # prints the export line for SLURM_CONF
#   export SLURM_CONF=DIR/slurm.conf      # every client command (sbatch, squeue...) needs it
#   scripts/slurm/stop.sh DIR
#
# Optional environment:
#   SLURM_SCRATCH_ROOT  if set, an Epilog deletes $SLURM_SCRATCH_ROOT/<jobid> when each job
#                       ends, like a cluster's node-local /scratch that is wiped at job end.
#   SLURM_KILLWAIT      seconds between SIGTERM and SIGKILL at a time limit (default 30).
#   SLURM_NODES         number of nodes (default 1); >= 2 needs ip(8) and network namespaces.
#   SLURM_NODE_SCRATCH  with SLURM_NODES >= 2: a directory that each node sees as its own
#                       (DIR/nodes/nodeK/scratch mounted over it in nodeK's mount namespace),
#                       like a node-local /scratch. Jobs' files there are not seen by other nodes
#                       nor from outside the cluster (look in DIR/nodes/nodeK/scratch).
#
# Pitfalls handled here (each one costs an afternoon otherwise):
#   - munged refuses a socket directory that others can write into: the directory is 0755;
#     clients and daemons find the socket through AuthInfo=socket=... in slurm.conf.
#   - the node line must match the hardware or slurmd registers as invalid: it comes from
#     `slurmd -C`.
#   - jobs submitted before slurmd has registered stay pending with reason "Nodes required for
#     job are DOWN": we wait until `sinfo` shows the node idle.
#   - stopping slurmd does not stop jobs: stop.sh cancels them first.
#   - several slurmd on one machine need their own spool, pid and log files (%n in slurm.conf)
#     and an address each: the one port they all listen on is per network namespace.
#   - a pathname Unix socket (munge's) is reached from any network namespace; only abstract
#     ones are per namespace.
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
NODES=${SLURM_NODES:-1}
CTL_ADDR=127.0.0.1
NODE_LINES="$NODE_LINE NodeAddr=127.0.0.1 State=UNKNOWN"
NODE_LIST=$NODE
SLURMD_FILES="SlurmdPidFile=$DIR/run/slurmd.pid
SlurmdLogFile=$DIR/log/slurmd.log
SlurmdSpoolDir=$DIR/spool"
if [ "$NODES" -ge 2 ]; then
  command -v ip >/dev/null || { echo "start.sh: SLURM_NODES=$NODES needs ip(8) (apt-get install iproute2)" >&2; exit 1; }
  # A private /24 and names unlikely to collide with another cluster's (written down for
  # stop.sh, which removes them).
  TAG=$(printf '%04x' $((RANDOM % 65536)))
  NET=10.$((100 + RANDOM % 100)).$((RANDOM % 250))
  BRIDGE=sfbr$TAG
  CTL_ADDR=$NET.254
  echo "BRIDGE=$BRIDGE" >"$DIR/run/netns"
  ip link add "$BRIDGE" type bridge
  ip addr add "$CTL_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  HW=$(sed 's/^NodeName=[^ ]* //' <<<"$NODE_LINE")
  NODE_LINES=
  for k in $(seq 0 $((NODES - 1))); do
    ns=stagefs-$TAG-node$k
    echo "NETNS=$ns" >>"$DIR/run/netns"
    ip netns add "$ns"
    ip link add "sfv$TAG$k" type veth peer name "sfp$TAG$k"
    ip link set "sfp$TAG$k" netns "$ns"
    ip link set "sfv$TAG$k" master "$BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "sfp$TAG$k" name eth0
    ip -n "$ns" addr add "$NET.$((k + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    mkdir -p "$DIR/nodes/node$k/scratch"
    NODE_LINES+="NodeName=node$k NodeHostname=node$k NodeAddr=$NET.$((k + 1)) $HW State=UNKNOWN
"
  done
  NODE_LIST=node[0-$((NODES - 1))]
  SLURMD_FILES="SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmdSpoolDir=$DIR/spool/%n"
fi
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
SlurmctldHost=$HOST($CTL_ADDR)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
AuthInfo=socket=$SOCK
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
$SLURMD_FILES
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
$NODE_LINES
PartitionName=amd Nodes=$NODE_LIST Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$NODE_LIST MaxTime=INFINITE State=UP
EOF2
# slurmd -C prints an UpTime= field on a second line only; the node line is clean.
export SLURM_CONF="$DIR/slurm.conf"

slurmctld -f "$SLURM_CONF" -i
if [ "$NODES" -ge 2 ]; then
  for k in $(seq 0 $((NODES - 1))); do
    mkdir -p "$DIR/spool/node$k"
    chmod 0700 "$DIR/spool/node$k"
    # nsenter, not ip netns exec: that one mounts a /sys of its own, without the cgroup file
    # system slurmd needs. Private mount propagation, so the scratch mount (and the FUSE
    # mounts of this node's jobs) stay inside the node. slurmd daemonizes: its jobs inherit
    # these namespaces.
    bind=
    if [ -n "${SLURM_NODE_SCRATCH:-}" ]; then
      mkdir -p "$SLURM_NODE_SCRATCH"
      bind="mount --bind '$DIR/nodes/node$k/scratch' '$SLURM_NODE_SCRATCH' &&"
    fi
    nsenter --net="/run/netns/stagefs-$TAG-node$k" unshare --uts --mount --propagation private \
      sh -c "hostname node$k && $bind exec slurmd -f '$SLURM_CONF' -N node$k"
  done
else
  slurmd -f "$SLURM_CONF" -N "$NODE"
fi

# A node is listed once per partition: count each once.
idle=0
for _ in $(seq 120); do
  idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | grep -c ' idle' || true)
  [ "$idle" -ge "$NODES" ] && break
  sleep 0.5
done
if [ "$idle" -lt "$NODES" ]; then
  echo "start.sh: $idle of $NODES nodes idle ($(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | tr '\n' ' ')); logs in $DIR/log" >&2
  tail -n 20 "$DIR"/log/slurm*.log >&2 || true
  exit 1
fi
echo "export SLURM_CONF=$SLURM_CONF"
