"""The FUSE-lever experiment (`run.sh levers`): which mount settings help an unprivileged mount,
so the lead keeps what helps. On the slow backend's small-file dataset, as the user:

  warm   one cache filled once (default settings, one full epoch); then per round, for every
         configuration: remount on that cache with the configuration's flags, caches dropped,
         a shuffled 8-thread epoch and an ImageFolder-order epoch. Configurations: the default,
         --fuse-threads 1/2/4/16, --no-staging, --revalidate 1 (what opting out of snapshot
         semantics costs), and (root sets it from outside; an unprivileged daemon cannot) the
         mount's kernel read-ahead raised to 1 MiB in /sys/class/bdi.
  cold   per round and configuration, an empty cache, caches dropped: mount + epoch 1
         (shuffled) with --fetch-threads 8/32/128 (32 is the default).
  list   per round and configuration, an empty cache, caches dropped, --no-staging:
         mount + `find MNT | wc -l` with --scan-threads 8/64/256 (64 is the default).
Every configuration runs right after a run of the default (A B pairs, seconds apart); its
ratio is against that default run, per round, then the median.
"""

import os
import re
import shutil

from common import Mount, Results, Who, drop_caches, log, mount_device, stats_delta

WARM = [  # (name, mount flags, kernel read-ahead KiB or None)
    ("default (--fuse-threads 8)", [], None),
    ("--fuse-threads 1", ["--fuse-threads", "1"], None),
    ("--fuse-threads 2", ["--fuse-threads", "2"], None),
    ("--fuse-threads 4", ["--fuse-threads", "4"], None),
    ("--fuse-threads 16", ["--fuse-threads", "16"], None),
    ("--no-staging", ["--no-staging"], None),
    ("--revalidate 1", ["--revalidate", "1"], None),
    ("--daemon-opens (FUSE's default: open and release asked)", ["--daemon-opens"], None),
    ("--no-push", ["--no-push"], None),
    ("--no-readdirplus", ["--no-readdirplus"], None),
    ("read_ahead_kb=1024 (sysfs, root)", [], 1024),
]
COLD = [
    ("default (--fetch-threads 32)", []),
    ("--fetch-threads 8", ["--fetch-threads", "8"]),
    ("--fetch-threads 128", ["--fetch-threads", "128"]),
]
LIST = [
    ("default (--scan-threads 64)", []),
    ("--no-readdirplus", ["--no-readdirplus"]),
    ("--scan-threads 8", ["--scan-threads", "8"]),
    ("--scan-threads 256", ["--scan-threads", "256"]),
]


def set_readahead(mnt: str, kib: int) -> None:
    dev = mount_device(mnt)
    if dev is None:
        raise RuntimeError(f"nothing mounted at {mnt}")
    with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
        f.write(f"{kib}\n")


class Levers:
    def __init__(self, a) -> None:
        self.a = a
        self.res = Results(a.out, "levers")
        self.user = Who("user", a.user)
        self.m = Mount(a.stagefs, self.user, a.mnt)
        self.src = os.path.join(a.bigdata, "small")
        self.base = os.path.join(a.scratch, "user")
        self.size = ["--cache-size", a.cache_size]

    def guarded(self, name: str, fn, *args) -> None:
        log(f" {name}")
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a failed configuration is a result
            log(f"  FAILED: {e}")
            self.res.record(self.res.begin(), mode="FAILED", name=name, error=str(e)[-1500:])
            self.m.force_umount()

    def warm(self, pair: str, cache: str, name: str, flags: list, readahead) -> None:
        self.m.mount(self.src, cache, self.size + flags)
        try:
            if readahead:
                set_readahead(self.a.mnt, readahead)
            for reader in ("shuf8", "seq"):
                st = self.m.stats()
                load = self.res.begin()
                ep = self.user.epoch(self.a.mnt, reader, seed=self.res.round)
                st2 = self.m.stats()
                self.res.record(load, mode="warm", config=name, pair=pair, reader=reader, **ep,
                                mbps=ep["bytes"] / ep["epoch_s"] / 1e6,
                                stats=stats_delta(st, st2))
            self.m.umount()
        finally:
            self.m.force_umount()

    def cold(self, pair: str, name: str, flags: list) -> None:
        cache = self.user.mkdir(os.path.join(self.base, "levers-cold"))
        try:
            drop_caches()
            load = self.res.begin()
            mount_s = self.m.mount(self.src, cache, self.size + flags)
            ep = self.user.epoch(self.a.mnt, "shuf8", seed=1, drop=False)
            st = self.m.stats()
            self.m.umount()
            secs = mount_s + ep["epoch_s"]
            self.res.record(load, mode="cold", config=name, pair=pair, reader="shuf8", **ep,
                            secs=secs,
                            mbps=ep["bytes"] / secs / 1e6, stats=stats_delta({}, st))
        finally:
            self.m.force_umount()
            shutil.rmtree(cache, ignore_errors=True)

    def listing(self, pair: str, name: str, flags: list) -> None:
        cache = self.user.mkdir(os.path.join(self.base, "levers-list"))
        try:
            drop_caches()
            load = self.res.begin()
            mount_s = self.m.mount(self.src, cache, self.size + ["--no-staging"] + flags)
            secs, r = self.user.timed(["sh", "-c", 'find "$1" | wc -l', "sh", self.a.mnt])
            st = self.m.stats()
            self.m.umount()
            self.res.record(load, mode="list", config=name, pair=pair, mount_s=mount_s,
                            find_s=secs,
                            secs=mount_s + secs, lines=int(r.stdout), stats=stats_delta({}, st))
        finally:
            self.m.force_umount()
            shutil.rmtree(cache, ignore_errors=True)

    def run(self) -> None:
        parts = self.a.levers.split(",")
        cache = self.user.mkdir(os.path.join(self.base, "levers-warm"))
        try:
            if "warm" in parts:
                log(" filling the warm cache (default settings, one epoch)")
                self.m.mount(self.src, cache, self.size)
                try:
                    self.user.epoch(self.a.mnt, "shuf8", seed=0, drop=False)
                    self.m.umount()
                finally:
                    self.m.force_umount()
            for r in range(1, self.a.rounds + 1):
                self.res.round = r
                log(f"round {r}/{self.a.rounds}")
                for part, configs, fn in (("warm", WARM, self.warm), ("cold", COLD, self.cold),
                                          ("list", LIST, self.listing)):
                    if part not in parts:
                        continue
                    default, others = configs[0], configs[1:]
                    for cfg in others:
                        if self.a.only and not re.search(self.a.only, cfg[0]):
                            continue
                        # A B pairs: the default right before each configuration, so every
                        # ratio compares runs seconds apart.
                        for run in (default, cfg):
                            args = (cache, *run) if part == "warm" else run
                            self.guarded(f"{part} {run[0]} (pair: {cfg[0]})", fn, cfg[0], *args)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
