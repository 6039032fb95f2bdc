"""Part 2: scale (`bench.py scale ...`): a generated ImageNet-layout tree of N tiny files on a
local source, everything as the unprivileged user. Per round (A = the source, B = the mount,
alternated within the round):

  find-source   caches dropped, `find SOURCE | wc -l` (cold), then again (warm)
  fresh         empty cache, caches dropped: `usable` (mount command; first stat of the deepest
                file), `find MNT | wc -l` cold (the listing runs behind it), then warm; the
                daemon's VmRSS/VmHWM; metadata_requests
  read          one shuffled 8-thread epoch through the fresh mount (fills the cache); memory
                again; files in the cache directory vs N; `stagefs umount` time
  remount       caches dropped, warm cache: mount command, first stat, first read (goal < 2 s),
                then `find MNT | wc -l`; memory after loading the cache index
  warm          a shuffled epoch on that remount (caches dropped), then umount
  source-read   caches dropped, the same epoch straight off the source (the warm epoch's
                baseline)
  index         caches dropped, `stagefs index SOURCE -o FILE` (vs find-source cold)
  index-mount   empty cache, `--index FILE`: usable, `find MNT | wc -l`, metadata_requests
                (goal: 0)
If this build has no `stagefs index`, the index file is the snapshot the fresh mount kept in its
cache (the same format) and the index pass is reported as missing.
"""

import os
import re
import shutil

from common import Mount, Results, Who, drop_caches, log, stats_delta


def scratch_usage(path: str) -> tuple:
    """(regular files, bytes allocated) under the cache directory `path`."""
    n = blocks = 0
    for d, _, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            n += 1
            blocks += st.st_blocks
    return n, blocks * 512


def find_snapshot(cache: str):
    """The snapshot a mount kept in its cache directory (a file named `snapshot`)."""
    for d, _, files in os.walk(cache):
        if "snapshot" in files:
            return os.path.join(d, "snapshot")
    return None


class Scale:
    def __init__(self, a) -> None:
        self.a = a
        self.res = Results(a.out, "scale")
        self.user = Who("user", a.user)
        self.m = Mount(a.stagefs, self.user, a.mnt)
        self.src = a.source
        self.base = os.path.join(a.scratch, "user")
        os.makedirs(self.base, exist_ok=True)
        os.chown(self.base, self.user.uid, self.user.gid)
        os.chmod(self.base, 0o700)
        self.cache = os.path.join(self.base, "scale-cache")
        self.index = os.path.join(self.base, "scale.stagefs-index")
        self.flags = ["--cache-size", a.cache_size]
        self.has_index_cmd = self.user.run([a.stagefs, "index", "--help"],
                                           check=False).returncode == 0

    def find(self, root: str) -> tuple:
        """`find ROOT | wc -l` as the user: (seconds, lines)."""
        secs, r = self.user.timed(["sh", "-c", 'find "$1" | wc -l', "sh", root])
        return secs, int(r.stdout.strip())

    def pass_(self, name: str, fn) -> None:
        if self.a.only and not re.search(self.a.only, name):
            return
        log(f" {name}")
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failed pass is a result; the run goes on
            log(f"  FAILED: {e}")
            self.res.record(self.res.begin(), mode="FAILED", name=name, error=str(e)[-1500:])
            self.m.force_umount()

    def rec(self, load: str, mode: str, **kw) -> dict:
        return self.res.record(load, mode=mode, n_files=self.a.n_files, **kw)

    def find_source(self) -> None:
        drop_caches()
        load = self.res.begin()
        cold, n = self.find(self.src)
        warm, n2 = self.find(self.src)
        self.rec(load, "find-source", cold_s=cold, warm_s=warm, lines=n, lines_warm=n2)

    def fresh(self) -> None:
        """Fresh mount, full read, umount: mount-usable, find, memory, scratch files."""
        self.user.mkdir(self.cache)
        drop_caches()
        load = self.res.begin()
        u = self.m.usable(self.src, self.cache, self.flags, self.a.deep, read=False)
        cold, n = self.find(self.a.mnt)
        warm, n2 = self.find(self.a.mnt)
        st = self.m.stats()
        self.rec(load, "fresh", **u, find_cold_s=cold, find_warm_s=warm, lines=n,
                 lines_warm=n2, stats=stats_delta({}, st), **self.m.memory())

        drop_caches()
        load = self.res.begin()
        ep = self.user.epoch(self.a.mnt, "shuf8", seed=1, drop=False)
        st2 = self.m.stats()
        mem = self.m.memory()
        umount_s = self.m.umount()
        scratch, allocated = scratch_usage(self.cache)
        self.rec(load, "read", **ep, stats=stats_delta(st, st2), **mem, umount_s=umount_s,
                 scratch_files=scratch, scratch_bytes=allocated,
                 cache_used=st2.get("cache_used"))
        if not self.has_index_cmd:
            snap = find_snapshot(self.cache)
            if snap:
                shutil.copyfile(snap, self.index)
                os.chown(self.index, self.user.uid, self.user.gid)

    def remount(self) -> None:
        """Warm remount: first read, find, memory; then a warm epoch; umount."""
        drop_caches()
        load = self.res.begin()
        u = self.m.usable(self.src, self.cache, self.flags, self.a.deep, read=True)
        st = self.m.stats()
        mem = self.m.memory()
        cold, n = self.find(self.a.mnt)
        st1 = self.m.stats()
        self.rec(load, "remount", **u, find_cold_s=cold, lines=n,
                 stats=stats_delta({}, st1), first_read_stats=stats_delta({}, st), **mem)

        load = self.res.begin()
        ep = self.user.epoch(self.a.mnt, "shuf8", seed=2)
        st2 = self.m.stats()
        mem = self.m.memory()
        umount_s = self.m.umount()
        self.rec(load, "warm", **ep, stats=stats_delta(st1, st2), **mem, umount_s=umount_s)

    def source_read(self) -> None:
        load = self.res.begin()
        ep = self.user.epoch(self.src, "shuf8", seed=2)
        self.rec(load, "source-read", **ep)

    def index_pass(self) -> None:
        if not self.has_index_cmd:
            self.res.note(missing="stagefs index",
                          detail="this build has no `stagefs index`: --index uses the snapshot "
                          "kept by the fresh mount's cache (same file format)")
            return
        drop_caches()
        load = self.res.begin()
        secs, _ = self.user.timed([self.a.stagefs, "index", self.src, "-o", self.index])
        self.rec(load, "index", secs=secs, index_bytes=os.path.getsize(self.index))

    def index_mount(self) -> None:
        if not os.path.exists(self.index):
            raise RuntimeError(f"no index file {self.index} (the fresh pass did not run?)")
        cache = self.user.mkdir(self.cache + "-index")
        try:
            drop_caches()
            load = self.res.begin()
            u = self.m.usable(self.src, cache, self.flags + ["--index", self.index], self.a.deep,
                              read=True)
            st0 = self.m.stats()
            cold, n = self.find(self.a.mnt)
            st = self.m.stats()
            mem = self.m.memory()
            self.m.umount()
            self.rec(load, "index-mount", **u, find_cold_s=cold, lines=n,
                     usable_stats=stats_delta({}, st0), stats=stats_delta({}, st), **mem,
                     from_stagefs_index=self.has_index_cmd)
        finally:
            self.m.force_umount()
            shutil.rmtree(cache, ignore_errors=True)

    def run(self) -> None:
        self.res.note(n_files=self.a.n_files, source=self.src, deep=self.a.deep,
                      has_index_cmd=self.has_index_cmd)
        for r in range(1, self.a.rounds + 1):
            self.res.round = r
            log(f"round {r}/{self.a.rounds}")
            self.pass_("find-source", self.find_source)
            self.pass_("fresh+read", self.fresh)
            self.pass_("remount+warm", self.remount)
            self.pass_("source-read", self.source_read)
            self.pass_("index", self.index_pass)
            self.pass_("index-mount", self.index_mount)
            shutil.rmtree(self.cache, ignore_errors=True)
        if os.path.exists(self.index):
            os.remove(self.index)
