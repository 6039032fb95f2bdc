# Sourced by bench/mount/direct.sh and bench/mount/held_out.sh: running as the benchmark user,
# dropping the page cache (also on a reader's request), and the RAM-backed scratch models.
# The caller sets `uid` (the user's id) before calling these; `CG` is empty, or the blkio
# cgroup every `as_user` command joins.
CG=

# Runs CMD... as the user (uid), HOME=/tmp; inside the cgroup CG when set, so every read and
# write of the throttled scratch by it and its children (the daemon `stagefs run` starts
# included) is held to the cgroup's rate.
as_user() {
  if [[ -n $CG ]]; then
    sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$CG" \
      setpriv --reuid="$uid" --regid="$uid" --clear-groups env HOME=/tmp "$@"
  else
    setpriv --reuid="$uid" --regid="$uid" --clear-groups env HOME=/tmp "$@"
  fi
}

drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# Drops the page cache whenever REQUEST exists, then removes it: a reader (a normal user, who
# cannot drop it) creates the file and waits for it to go. Run in the background.
dropper() {
  while :; do
    if [[ -e $1 ]]; then drop; rm -f "$1"; fi
    sleep 0.05
  done
}

# ram_scratch DIR TMPFS MB: ext4 of MB MiB on a loop device over a file in a tmpfs mounted at
# TMPFS, mounted at DIR (RAM-backed, and its page cache `drop` empties, as a node's NVMe under
# a dataset larger than RAM).
ram_scratch() {
  local dir=$1 tmp=$2 mb=$3
  mkdir -p "$dir" "$tmp"
  mountpoint -q "$tmp" || mount -t tmpfs -o size=$((mb + 256))m tmpfs "$tmp"
  if ! mountpoint -q "$dir"; then
    truncate -s "${mb}M" "$tmp/scratch.img"
    mkfs.ext4 -q -F "$tmp/scratch.img"
    mount -o loop "$tmp/scratch.img" "$dir"
  fi
}

# throttle DIR NAME MBS: sets CG to the blkio cgroup NAME, which holds reads and writes of
# DIR's device to MBS MB/s: the seed's node-local NVMe (bandwidth only, no added latency).
throttle() {
  local dev
  CG=/sys/fs/cgroup/blkio/$2
  mkdir -p "$CG"
  dev=$(findmnt -n -o MAJ:MIN --target "$1" | tr -d ' ')
  echo "$dev $(($3 * 1000000))" >"$CG/blkio.throttle.read_bps_device"
  echo "$dev $(($3 * 1000000))" >"$CG/blkio.throttle.write_bps_device"
  echo "scratch $1 on $(findmnt -n -o SOURCE --target "$1") ($dev): reads and writes held to $3 MB/s"
}

# own_scratch U UID: hands U to the benchmark user (0700), starts the dropper on U/drop (the
# epoch scripts ask for a drop before each epoch by creating it) and, on exit, stops it,
# clears a mount left at U/mnt and unmounts the RAM scratch of NVME_MBS runs.
own_scratch() {
  local u=$1 uid=$2
  chown "$uid:$uid" "$u" && chmod 700 "$u"
  dropper "$u/drop" &
  OWN_SCRATCH_DROPPER=$!
  OWN_SCRATCH=$u
  trap own_scratch_finish EXIT
}
own_scratch_finish() {
  kill "$OWN_SCRATCH_DROPPER" 2>/dev/null
  fusermount3 -uz "$OWN_SCRATCH/mnt" 2>/dev/null || true
  if [[ -n ${NVME_MBS:-} ]]; then umount -l "$OWN_SCRATCH" "$SCRATCH/ramfs" 2>/dev/null || true; fi
}
