#!/usr/bin/env bash
# CPU an idle daemon uses: a normal user's mount of a one-file tree, nothing read, its CPU
# seconds (utime + stime of every thread) over SECONDS_IDLE seconds, as a share of one core.
#   bench/mount/idle_cpu.sh            (as root: it runs the mount as BENCH_USER)
# Knobs: STAGEFS=target/release/stagefs, BENCH_USER=stagefs-test, SECONDS_IDLE=20.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
STAGEFS=${STAGEFS:-$REPO/target/release/stagefs}
BENCH_USER=${BENCH_USER:-stagefs-test}
SECONDS_IDLE=${SECONDS_IDLE:-20}
uid=$(id -u "$BENCH_USER")
# shellcheck source=bench/mount/scratch.sh
source "$HERE/scratch.sh"
W=$(mktemp -d /var/tmp/stagefs-idle.XXXXXX)
chmod 755 "$W"
trap 'as_user "$STAGEFS" umount "$W/mnt" >/dev/null 2>&1 || true; rm -rf "$W"' EXIT
mkdir -p "$W/src" "$W/mnt"
head -c 10M /dev/urandom >"$W/src/a"
chown -R "$uid:$uid" "$W"
as_user "$STAGEFS" mount "$W/src" "$W/mnt" --cache "$W/cache"
sleep 2  # past start-up (snapshot, staging the one file)
pid=$(as_user python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["pid"])' "$W/mnt/.stagefs/stats")
ticks() { awk '{ print $14 + $15 }' "/proc/$pid/stat"; }
a=$(ticks)
sleep "$SECONDS_IDLE"
b=$(ticks)
python3 -c "t = $(getconf CLK_TCK); print(f'idle daemon: {($b - $a) / t:.2f} CPU-s in $SECONDS_IDLE s = {($b - $a) / t / $SECONDS_IDLE * 100:.1f} % of a core; load {open(\"/proc/loadavg\").read().split()[0]}')"
