"""What the benchmark's parts share: running as the unprivileged user, dropping caches, load
averages, the stagefs mount (as the user or as root), its stats, the daemon's memory, epochs run
by reader.py, and the results file (one JSON line per pass).

The benchmark itself runs as root (drop_caches, loop devices); every mount, epoch, `find` and
`stagefs index` of the headline runs as the unprivileged account (`setpriv --reuid --regid` to
BENCH_USER, default `stagefs-test`), because a FUSE mount without allow_other is reachable only by
the user who mounted it, and because that is how HPC users mount.
"""

import json
import os
import pwd
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
READER = os.path.join(HERE, "reader.py")
THREADS = 8  # reader threads: a DataLoader with num_workers=8


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, file=sys.stderr, flush=True)


def drop_caches() -> None:
    """Empties the page, dentry and inode caches (root). nbdkit runs with cache=none and the loop
    devices with direct I/O, so nothing below keeps a second copy."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def loadavg() -> str:
    """The 1-minute load average (the first field of `uptime`'s load average)."""
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


class Who:
    """Who runs a command: the unprivileged bench user (`user`) or root (`root`)."""

    def __init__(self, name: str, user: str) -> None:
        self.name = name
        self.env = None  # the environment of its epochs (the `direct` side's preload library)
        if name in ("user", "direct"):
            pw = pwd.getpwnam(user)
            self.uid, self.gid = pw.pw_uid, pw.pw_gid
            self.prefix = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
                           "--clear-groups", "--"]
        else:
            self.uid = self.gid = 0
            self.prefix = []
        cgroup = os.environ.get("BENCH_CGROUP")
        if cgroup:  # run.sh's throttled scratch: every command joins the cgroup first
            self.prefix = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cgroup,
                           *self.prefix]

    def run(self, cmd: list, check: bool = True, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("cwd", "/")  # the user may not be allowed into root's working directory
        r = subprocess.run(self.prefix + cmd, capture_output=True, text=True, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} (as {self.name}) failed ({r.returncode}): "
                               f"{r.stderr.strip()[-2000:]}")
        return r

    def timed(self, cmd: list, **kw) -> tuple:
        t = time.monotonic()
        r = self.run(cmd, **kw)
        return time.monotonic() - t, r

    def mkdir(self, path: str) -> str:
        """An empty directory owned by this user, 0700 (a cache, an rsync target)."""
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, mode=0o700)
        os.chown(path, self.uid, self.gid)
        return path

    def epoch(self, root: str, reader: str, seed: int, drop: bool = True,
              compute: float = 0.0) -> dict:
        """One epoch over `root` by reader.py, as this user (after dropping caches if `drop`):
        its files, bytes, list_s and read_s as measured inside the reader (no interpreter
        start-up), and epoch_s = list_s + read_s; with `compute` (seconds per MB), a training
        step consumes the reads (reader.py's --compute-s-per-mb)."""
        if drop:
            drop_caches()
        r = self.run([sys.executable, READER, "epoch", root, "--reader", reader,
                      "--seed", str(seed), "--threads", str(THREADS),
                      "--compute-s-per-mb", str(compute)], env=self.env)
        return json.loads(r.stdout)


class Mount:
    """A stagefs mount by `who` at `mnt`."""

    def __init__(self, stagefs: str, who: Who, mnt: str) -> None:
        self.stagefs, self.who, self.mnt = stagefs, who, mnt
        self.pid = None

    def mount(self, src: str, cache: str, flags: list) -> float:
        """Seconds the `stagefs mount` command took (it returns once the mount is usable)."""
        secs, _ = self.who.timed([self.stagefs, "mount", src, self.mnt, "--cache", cache,
                                  *flags])
        self.pid = None
        return secs

    def usable(self, src: str, cache: str, flags: list, deep: str, read: bool) -> dict:
        """reader.py's `usable` probe: mount command, first stat of `deep`, and optionally the
        first read of it, all timed inside one process of this user."""
        cmd = [sys.executable, READER, "usable", "--stagefs", self.stagefs, "--src", src,
               "--mnt", self.mnt, "--cache", cache, "--deep", deep]
        if read:
            cmd.append("--read")
        r = self.who.run(cmd + ["--", *flags])
        self.pid = None
        return json.loads(r.stdout)

    def umount(self) -> float:
        secs, _ = self.who.timed([self.stagefs, "umount", self.mnt])
        return secs

    def force_umount(self) -> None:
        """After a failure: lazy unmount, whoever mounted."""
        for cmd in ([self.stagefs, "umount", "--lazy", self.mnt], ["fusermount3", "-uz", self.mnt],
                    ["umount", "-l", self.mnt]):
            if not is_mountpoint(self.mnt):
                return
            subprocess.run(cmd, capture_output=True)

    def stats(self) -> dict:
        r = self.who.run(["cat", os.path.join(self.mnt, ".stagefs", "stats")])
        st = json.loads(r.stdout)
        self.pid = st.get("pid")
        return st

    def memory(self) -> dict:
        """The daemon's VmRSS and VmHWM in bytes (read by root from /proc)."""
        if self.pid is None:
            self.stats()
        out = {}
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    key, _, val = line.partition(":")
                    if key in ("VmRSS", "VmHWM"):
                        out[key] = int(val.split()[0]) * 1024
        except (OSError, ValueError, TypeError):
            pass
        return out


def mount_device(path: str):
    """The "major:minor" of the mount at `path`, from /proc/self/mountinfo (not stat: root may not
    stat a FUSE mount of another user without allow_other), or None if nothing is mounted there."""
    path = os.path.realpath(path)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4].replace("\\040", " ") == path:
                found = fields[2]  # the last mount on a path is the visible one
    return found


def is_mountpoint(path: str) -> bool:
    return mount_device(path) is not None


# The stats that make a pass's row, as differences between the stats after and before it.
DELTA_KEYS = ("bytes_from_cache", "bytes_from_source", "bytes_passthrough", "passthrough_opens",
              "metadata_requests", "stall_s", "reader_wait_s", "reads", "error_count",
              "corrupt_blocks", "cache_full_events")


def stats_delta(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in DELTA_KEYS
         if isinstance(after.get(k), (int, float))}
    served = d.get("bytes_from_cache", 0) + d.get("bytes_from_source", 0)
    d["hit_ratio"] = d["bytes_from_cache"] / served if served else None
    for k in ("snapshot", "snapshot_entries", "cache_used", "files_staged", "bytes_staged"):
        if k in after:
            d[k] = after[k]
    d["errors"] = after.get("errors", [])[-3:]
    return d


class Results:
    """The results file: one JSON line per pass, with the round, the 1-minute load average at
    the start and end of the pass, and the time it was written."""

    def __init__(self, path: str, part: str) -> None:
        self.f = open(path, "a")
        self.part = part
        self.round = 0

    def begin(self) -> str:
        return loadavg()

    def record(self, load_start: str, **rec) -> dict:
        rec.update(part=self.part, round=self.round, load_start=load_start, load_end=loadavg(),
                   time=time.strftime("%H:%M:%S"))
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        show = {k: v for k, v in rec.items()
                if k not in ("part", "round", "time", "stats", "errors") and v is not None}
        log(f"  r{self.round} " + " ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in show.items()))
        return rec

    def note(self, **rec) -> None:
        """A line that is not a timed pass (sizes, what the build lacks)."""
        rec.update(part=self.part, round=self.round, mode="note")
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
