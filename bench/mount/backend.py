"""Part 1: the slow backend (run.sh brings it up and calls `bench.py backend ...`).

Per round, in this order (the same every round: A B C, A B C, so drift on the machine hits every
side alike), for each dataset:
  probe          raw bandwidth of the slow block device: 8 threads of O_DIRECT 4 MiB reads
                 (2 GB), the "backend's bandwidth" epoch 1 is compared with (once per round);
  seed (A)       today's workflow, as the user: `rsync -a` to scratch (timed), then for every
                 reader LATER local epochs (caches dropped before each) and one more without
                 dropping caches (a page-cached local copy);
  user (B)       stagefs mounted by the unprivileged user, for every reader: empty cache, caches
                 dropped, then epoch 1 timed from the mount command to its last byte (mount +
                 listing + reads), LATER epochs on the same mount (caches dropped before each),
                 and one without dropping caches;
  direct (D)     the unprivileged mount again, its epochs run as `stagefs run` runs a job's
                 programs: libstagefs_direct.so in LD_PRELOAD, so opens of staged, verified
                 large files get direct descriptors of the cache's copies (docs/direct.md);
  root (C)       the same mounted by root (kernel passthrough for staged files): secondary line.
With --compute, every epoch of every side feeds a training step that takes as long per MB as
a local epoch of that reader reads it (measured first in each round by one local epoch without
it, recorded as mode "calibrate"): a GPU busy half the time, so the job shows how much of the
staging and the reads the training hides (reader.py --compute-s-per-mb).
Every epoch is reader.py run as the side's user; every stagefs epoch records the stats it moved
(hit ratio, metadata requests, stall, passthrough bytes). The report (report.py) takes the ratios.
"""

import mmap
import os
import re
import shutil
import threading
import time

from common import Mount, Results, Who, drop_caches, log, stats_delta

DIRECT_BLOCK = 4 << 20  # probe request: 4 MiB O_DIRECT reads, large enough that latency hides
PROBE_STREAMS = 8  # as many streams as reader threads
PROBE_BYTES = 2_000_000_000  # ~10 s at 200 MB/s: long enough that the rate filter's burst fades
NODROP_SEED = 1000  # shuffle seed of the no-drop epochs (later epochs use their epoch number)


def probe(device: str, streams: int, total: int) -> dict:
    """Raw bandwidth of the slow device: `streams` threads of O_DIRECT reads over `total` bytes."""
    size = os.stat(device).st_size
    total = min(total, size - size % (DIRECT_BLOCK * streams))
    per = total // streams // DIRECT_BLOCK * DIRECT_BLOCK
    done = [0] * streams

    def run(i: int) -> None:
        fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, DIRECT_BLOCK)  # page-aligned, as O_DIRECT needs
        try:
            off, end = i * per, (i + 1) * per
            while off < end:
                k = os.preadv(fd, [buf], off)
                if k <= 0:
                    break
                done[i] += k
                off += k
        finally:
            os.close(fd)

    drop_caches()
    t = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    secs = time.monotonic() - t
    return {"bytes": sum(done), "secs": secs, "mbps": sum(done) / secs / 1e6}


def preload_env(stagefs: str, mnt: str, socket: str) -> dict:
    """The environment `stagefs run` gives its command: the direct-read library (the one the
    binary carries, written beside it by run.sh) in LD_PRELOAD, and the mount with its control
    socket."""
    lib = os.path.join(os.path.dirname(stagefs), "libstagefs_direct.so")
    return {**os.environ, "LD_PRELOAD": lib,
            "STAGEFS_DIRECT_MOUNTS": f"{os.path.realpath(mnt)}={socket}"}


def rate(ep: dict, secs: float) -> dict:
    return {"secs": secs, "bytes": ep["bytes"], "files": ep["files"],
            "mbps": ep["bytes"] / secs / 1e6, "files_s": ep["files"] / secs,
            "list_s": ep["list_s"], "read_s": ep["read_s"]}


class Backend:
    def __init__(self, a) -> None:
        self.a = a
        self.res = Results(a.out, "backend")
        self.user = Who("user", a.user)
        self.root = Who("root", a.user)
        self.direct = Who("direct", a.user)
        self.readers = a.readers.split(",")
        self.datasets = a.datasets.split(",")
        self.compute = {}  # (dataset, reader) -> the training step's seconds per MB

    def run_pass(self, name: str, fn, *args) -> None:
        if self.a.only and not re.search(self.a.only, name):
            return
        log(f" {name}")
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a failed pass is a result; the run goes on
            log(f"  FAILED: {e}")
            self.res.record(self.res.begin(), mode="FAILED", name=name, error=str(e)[-1500:])
            Mount(self.a.stagefs, self.root, self.a.mnt).force_umount()

    def probe(self) -> None:
        load = self.res.begin()
        r = probe(self.a.device, PROBE_STREAMS, PROBE_BYTES)
        self.res.record(load, mode="probe", streams=PROBE_STREAMS, **r)

    def seed(self, ds: str) -> None:
        """A: rsync to scratch as the user, then local epochs over the copy."""
        dst = self.user.mkdir(os.path.join(self.a.scratch, "user", f"seed-{ds}"))
        try:
            drop_caches()
            load = self.res.begin()
            secs, _ = self.user.timed(["rsync", "-a", os.path.join(self.a.bigdata, ds) + "/",
                                       dst + "/"])
            sizes = [os.lstat(os.path.join(d, f)).st_size
                     for d, _, fs in os.walk(dst) for f in fs]
            self.res.record(load, mode="rsync", dataset=ds, side="seed", secs=secs,
                            bytes=sum(sizes), files=len(sizes), mbps=sum(sizes) / secs / 1e6,
                            files_s=len(sizes) / secs)
            for reader in self.readers:
                if self.a.compute:
                    load = self.res.begin()
                    ep = self.user.epoch(dst, reader, seed=0)
                    per_mb = ep["read_s"] / (ep["bytes"] / 1e6)
                    self.compute[(ds, reader)] = per_mb
                    self.res.record(load, mode="calibrate", dataset=ds, side="seed",
                                    reader=reader, compute_s_per_mb=per_mb,
                                    **rate(ep, ep["epoch_s"]))
                compute = self.compute.get((ds, reader), 0.0)
                for k in range(2, 2 + self.a.later):
                    load = self.res.begin()
                    ep = self.user.epoch(dst, reader, seed=k, compute=compute)
                    self.res.record(load, mode="local", dataset=ds, side="seed", reader=reader,
                                    epoch=k, **rate(ep, ep["epoch_s"]))
                load = self.res.begin()
                ep = self.user.epoch(dst, reader, seed=NODROP_SEED, drop=False, compute=compute)
                self.res.record(load, mode="local-nodrop", dataset=ds, side="seed",
                                reader=reader, **rate(ep, ep["epoch_s"]))
        finally:
            shutil.rmtree(dst, ignore_errors=True)

    def stagefs(self, ds: str, reader: str, who: Who) -> None:
        """B / C: one job on one mount: epoch 1 (cold), LATER epochs, one no-drop epoch."""
        cache = who.mkdir(os.path.join(self.a.scratch, who.name, f"cache-{ds}"))
        m = Mount(self.a.stagefs, who, self.a.mnt)
        src = os.path.join(self.a.bigdata, ds)
        compute = self.compute.get((ds, reader), 0.0)
        if self.a.compute and not compute:
            raise RuntimeError("--compute needs the seed side first in the round (its "
                               "calibration epoch sets the training step's pace)")
        base = {"dataset": ds, "side": who.name, "reader": reader, "compute_s_per_mb": compute}
        try:
            drop_caches()
            load = self.res.begin()
            mount_s = m.mount(src, cache, ["--cache-size", self.a.cache_size])
            if who.name == "direct":
                who.env = preload_env(self.a.stagefs, self.a.mnt, m.stats()["hint_socket"])
            ep = who.epoch(self.a.mnt, reader, seed=1, drop=False, compute=compute)
            before = {}
            st = m.stats()
            mem = m.memory()
            self.res.record(load, mode="epoch1", epoch=1, mount_s=mount_s,
                            stats=stats_delta(before, st), **base,
                            **rate(ep, mount_s + ep["epoch_s"]), **mem)
            for k in range(2, 2 + self.a.later):
                before = st
                load = self.res.begin()
                ep = who.epoch(self.a.mnt, reader, seed=k, compute=compute)
                st = m.stats()
                self.res.record(load, mode="later", epoch=k, stats=stats_delta(before, st),
                                **base, **rate(ep, ep["epoch_s"]))
            before = st
            load = self.res.begin()
            ep = who.epoch(self.a.mnt, reader, seed=NODROP_SEED, drop=False, compute=compute)
            st = m.stats()
            self.res.record(load, mode="nodrop", stats=stats_delta(before, st), **base,
                            **rate(ep, ep["epoch_s"]), **m.memory())
            m.umount()
        finally:
            m.force_umount()
            shutil.rmtree(cache, ignore_errors=True)

    def run(self) -> None:
        sides = self.a.sides.split(",")
        for r in range(1, self.a.rounds + 1):
            self.res.round = r
            log(f"round {r}/{self.a.rounds}")
            self.run_pass("probe", self.probe)
            for ds in self.datasets:
                if "seed" in sides:
                    self.run_pass(f"{ds} seed", self.seed, ds)
                for who in (self.user, self.direct, self.root):
                    if who.name in sides:
                        for reader in self.readers:
                            self.run_pass(f"{ds} {who.name} {reader}", self.stagefs, ds, reader,
                                          who)
