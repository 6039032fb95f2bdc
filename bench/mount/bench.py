#!/usr/bin/env python3
"""The passes of the mount benchmark (called by run.sh once the slow backend is up) and its report.

  bench.py run    --bigdata DIR --local DIR --scratch DIR --mnt DIR --stagefs BIN --device FILE
                  --rounds N --out results.jsonl
  bench.py report results.jsonl          # markdown table on stdout

Every pass starts with `sync; echo 3 > /proc/sys/vm/drop_caches` (the nbd layer keeps no cache of
its own: nbdkit runs with cache=none and the loop device with direct I/O), so every pass reads
what it says it reads: the slow backend, the stagefs cache on scratch, or the local copy on
scratch. Rounds repeat every pass (round 2 in reverse order) so drift on this shared VM hits all
modes alike; ratios are taken per round against the same round's baseline, then the median.
"""

import argparse
import json
import mmap
import multiprocessing as mp
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

BUF = 1 << 20  # reader buffer: 1 MiB, like a DataLoader reading a whole sample or cat
DIRECT_BLOCK = 4 << 20  # backend probe: 4 MiB O_DIRECT reads, large enough that latency hides
WORKERS = 4  # multi-process reader: 4 processes, like DataLoader(num_workers=4)
MP_CHUNK = 32  # files per task handed to a worker: a DataLoader batch of 32 samples
SHUFFLE_SEED = 7


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, file=sys.stderr, flush=True)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


TOP_DIRS = 0  # if > 0: epochs read only the first TOP_DIRS top-level folders (see --top-dirs)


def list_files(root: str) -> list:
    """All regular files under root in ImageFolder order (sorted dirs, sorted names)."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        dirs[:] = [x for x in dirs if not x.startswith(".")]  # skip .stagefs control dir
        if d == root and TOP_DIRS:
            del dirs[TOP_DIRS:]
        out.extend(os.path.join(d, f) for f in sorted(files))
    return out


def read_file(path: str, buf: bytearray) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n
            n += k


def first_byte(root: str) -> float:
    """Seconds to find the first file (ImageFolder order; readdir types, no stat, like
    os.walk) and read 1 byte of it."""
    t = time.monotonic()
    d = root
    while True:
        with os.scandir(d) as it:
            entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
        files = [e for e in entries if e.is_file(follow_symlinks=False)]
        if files:
            with open(files[0].path, "rb", buffering=0) as f:
                if len(f.read(1)) != 1:
                    raise RuntimeError(f"empty first file under {root}")
            return time.monotonic() - t
        dirs = [e for e in entries if e.is_dir(follow_symlinks=False)]
        if not dirs:
            raise RuntimeError(f"no file under {root}")
        d = dirs[0].path


def read_seq(root: str) -> dict:
    t = time.monotonic()
    files = list_files(root)
    buf = bytearray(BUF)
    n = sum(read_file(p, buf) for p in files)
    return {"bytes": n, "files": len(files), "read_s": time.monotonic() - t}


def _worker(paths: list) -> int:
    buf = bytearray(BUF)
    return sum(read_file(p, buf) for p in paths)


def read_mp(root: str) -> dict:
    t = time.monotonic()
    files = list_files(root)
    random.Random(SHUFFLE_SEED).shuffle(files)
    chunks = [files[i : i + MP_CHUNK] for i in range(0, len(files), MP_CHUNK)]
    with mp.get_context("fork").Pool(WORKERS) as pool:
        n = sum(pool.imap_unordered(_worker, chunks))
    return {"bytes": n, "files": len(files), "read_s": time.monotonic() - t}


READERS = {"seq": read_seq, "mp4": read_mp}


def backend_probe(device: str, streams: int, total: int) -> dict:
    """Raw bandwidth of the slow block device: `streams` threads of O_DIRECT 4 MiB reads."""
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
    return {"bytes": sum(done), "read_s": time.monotonic() - t}


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = open(a.out, "a")
        self.round = 0

    def record(self, **rec) -> None:
        rec["round"] = self.round
        if rec.get("dataset") == "small" and TOP_DIRS:
            rec["top_dirs"] = TOP_DIRS
        if "bytes" in rec and "read_s" in rec:
            secs = rec.get("total_s", rec["read_s"])
            rec["mbps"] = rec["bytes"] / secs / 1e6
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()
        extra = f" ttfb {rec['ttfb_s']:.3f}s" if "ttfb_s" in rec else ""
        if "stats" in rec:
            st = rec["stats"]
            extra += (
                f" hit {st.get('hit_ratio', 0):.2f}"
                f" from_source {st.get('bytes_from_source', 0)}"
                f" passthrough_opens {st.get('passthrough_opens', '?')}"
                f" cache_full {st.get('cache_full_events', '?')}"
                f" fds {st.get('bench_daemon_fds', '?')} warnings {len(rec['warnings'])}"
            )
        log(
            f"  r{self.round} {rec.get('dataset', '-')}/{rec.get('reader', '-')}/{rec['mode']}: "
            f"{rec.get('mbps', 0):.1f} MB/s{extra}"
        )

    # --- stagefs helpers -------------------------------------------------------------------
    def mount(self, src: str, cache: str, flags: list) -> float:
        t = time.monotonic()
        cmd = [self.a.stagefs, "mount", src, self.a.mnt, "--cache", cache, "--cache-size", "4G",
               *flags]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return time.monotonic() - t

    def umount(self) -> float:
        t = time.monotonic()
        r = subprocess.run([self.a.stagefs, "umount", self.a.mnt], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"stagefs umount failed: {r.stderr.strip()}")
        return time.monotonic() - t

    def stats(self) -> dict:
        """The mount's stats JSON, plus the daemon's open descriptors (a leak shows here)."""
        with open(os.path.join(self.a.mnt, ".stagefs", "stats")) as f:
            st = json.load(f)
        try:
            st["bench_daemon_fds"] = len(os.listdir(f"/proc/{st['pid']}/fd"))
        except (KeyError, OSError):
            pass
        return st

    @staticmethod
    def warnings(cache: str) -> list:
        """WARN/ERROR lines of the daemon's log (first 5), so a silent fallback is visible."""
        try:
            with open(os.path.join(cache, "stagefs.log"), errors="replace") as f:
                bad = [ln.strip() for ln in f if "WARN" in ln or "ERROR" in ln]
        except OSError:
            return []
        return bad[:5] + ([f"... {len(bad) - 5} more"] if len(bad) > 5 else [])

    def fresh_cache(self, name: str) -> str:
        path = os.path.join(self.a.scratch, name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    # --- passes ------------------------------------------------------------------------------
    def plain(self, ds: str, reader: str, mode: str, root: str) -> None:
        """direct (slow backend) or local (copy on scratch): ttfb, then one epoch."""
        drop_caches()
        t = time.monotonic()
        ttfb = first_byte(root)
        r = READERS[reader](root)
        self.record(dataset=ds, reader=reader, mode=mode, ttfb_s=ttfb,
                    total_s=time.monotonic() - t, **r)

    def seed(self, ds: str) -> None:
        """Today's workflow: rsync the dataset to scratch, then read it (page cache as it is)."""
        dst = os.path.join(self.a.scratch, "rsync-" + ds)
        shutil.rmtree(dst, ignore_errors=True)
        drop_caches()
        t = time.monotonic()
        subprocess.run(["rsync", "-a", os.path.join(self.a.bigdata, ds) + "/", dst + "/"],
                       check=True)
        rsync_s = time.monotonic() - t
        r = read_seq(dst)
        total = time.monotonic() - t
        self.record(dataset=ds, reader="seq", mode="seed rsync+read", ttfb_s=rsync_s,
                    rsync_s=rsync_s, total_s=total, **r)
        shutil.rmtree(dst, ignore_errors=True)

    def cold(self, ds: str, reader: str, staging: bool, keep_for_warm: bool) -> None:
        try:
            self._cold(ds, reader, staging, keep_for_warm)
        except Exception as e:  # noqa: BLE001 - a failed pass is a result, the run goes on
            log(f"  FAILED: {e}")
            self.record(dataset=ds, reader=reader, mode="FAILED", error=str(e),
                        staging=staging)
            subprocess.run([self.a.stagefs, "umount", "--lazy", self.a.mnt], capture_output=True)
            subprocess.run(["fusermount3", "-uz", self.a.mnt], capture_output=True)

    def _cold(self, ds: str, reader: str, staging: bool, keep_for_warm: bool) -> None:
        """Epoch 1: empty cache; time runs from the mount command to the end of the epoch."""
        mode = "stagefs cold" + ("" if staging else " --no-staging")
        cache = self.fresh_cache(f"cache-{ds}-{reader}-{'stage' if staging else 'nostage'}")
        drop_caches()
        t = time.monotonic()
        flags = [] if staging else ["--no-staging"]
        if self.a.workaround and ds == "small":
            flags.append("--no-passthrough")
            mode += " (--no-passthrough)"
        mount_s = self.mount(os.path.join(self.a.bigdata, ds), cache, flags)
        ttfb = mount_s + first_byte(self.a.mnt)
        r = READERS[reader](self.a.mnt)
        total = time.monotonic() - t
        st = self.stats()
        self.umount()
        self.record(dataset=ds, reader=reader, mode=mode, ttfb_s=ttfb, mount_s=mount_s,
                    total_s=total, stats=st, warnings=self.warnings(cache), **r)
        if keep_for_warm:
            self.warm(ds, cache)
        shutil.rmtree(cache, ignore_errors=True)

    def warm(self, ds: str, cache: str) -> None:
        """Epoch 2 from a warm cache (remounted, page cache dropped), every reader."""
        readers = ["seq", "mp4"] if ds == "small" else ["seq"]
        for passthrough in (True, False):
            mode = "stagefs warm" + ("" if passthrough else " --no-passthrough")
            flags = ["--no-staging"] + ([] if passthrough else ["--no-passthrough"])
            if self.a.workaround and ds == "small" and passthrough:
                flags += ["--fuse-threads", "1"]
                mode += " (--fuse-threads 1)"
            self.mount(os.path.join(self.a.bigdata, ds), cache, flags)
            try:
                for reader in readers:
                    drop_caches()
                    r = READERS[reader](self.a.mnt)
                    self.record(dataset=ds, reader=reader, mode=mode, stats=self.stats(),
                                warnings=self.warnings(cache), **r)
            finally:
                self.umount()

    def probe(self) -> None:
        for streams, total in ((4, self.a.probe_bytes), (1, self.a.probe_bytes // 4)):
            r = backend_probe(self.a.device, streams, total)
            self.record(mode=f"backend raw {streams}-stream", **r)

    def run(self) -> None:
        sizes = {}
        for ds in ("large", "small"):
            sizes[ds] = len(list_files(os.path.join(self.a.bigdata, ds)))
        log(f"datasets: {sizes}")
        blocks = [("probe", self.probe)]
        for ds in ("large", "small"):
            readers = ["seq", "mp4"] if ds == "small" else ["seq"]
            local = os.path.join(self.a.local, ds)
            direct = os.path.join(self.a.bigdata, ds)
            for rd in readers:
                blocks.append((f"{ds} local {rd}",
                               lambda ds=ds, rd=rd, p=local: self.plain(ds, rd, "local copy", p)))
                blocks.append((f"{ds} direct {rd}",
                               lambda ds=ds, rd=rd, p=direct: self.plain(ds, rd, "direct", p)))
            blocks.append((f"{ds} seed", lambda ds=ds: self.seed(ds)))
            for rd in readers:
                blocks.append((f"{ds} cold nostage {rd}",
                               lambda ds=ds, rd=rd: self.cold(ds, rd, False, False)))
                blocks.append((f"{ds} cold stage {rd} (+warm)",
                               lambda ds=ds, rd=rd: self.cold(ds, rd, True, rd == "seq")))
        if self.a.only:
            blocks = [b for b in blocks if re.search(self.a.only, b[0])]
        for self.round in range(1, self.a.rounds + 1):
            order = blocks if self.round % 2 else list(reversed(blocks))
            log(f"round {self.round}/{self.a.rounds}")
            for name, fn in order:
                if self.round > 1 and self.a.once and re.search(self.a.once, name):
                    continue
                log(f" {name}")
                fn()


# --- report ---------------------------------------------------------------------------------
TARGETS = {
    # (dataset, mode) -> (baseline, factor) ; baseline "backend" = 4-stream raw device bandwidth
    ("large", "stagefs cold --no-staging"): ("backend", 0.9),
    ("large", "stagefs cold"): ("backend", 0.9),
    ("small", "stagefs cold --no-staging"): ("backend", 0.9),
    ("small", "stagefs cold"): ("backend", 0.9),
    ("large", "stagefs warm"): ("local", 0.95),
    ("large", "stagefs warm --no-passthrough"): ("local", 0.6),
    ("small", "stagefs warm"): ("local", 0.8),
    ("small", "stagefs warm --no-passthrough"): ("local", 0.8),
}
MODE_ORDER = ["local copy", "direct", "seed rsync+read", "stagefs cold --no-staging",
              "stagefs cold --no-staging (--no-passthrough)", "stagefs cold",
              "stagefs cold (--no-passthrough)", "stagefs warm", "stagefs warm (--fuse-threads 1)",
              "stagefs warm --no-passthrough"]


def report(paths: list) -> str:
    """Several results files may be given (e.g. a run of the slow baselines and a run of the
    rest); each file's rounds stay separate, and ratios use the baselines of the same round."""
    recs = []
    for i, path in enumerate(paths):
        for line in open(path):
            r = json.loads(line)
            r["round"] = f"{i + 1}.{r['round']}" if len(paths) > 1 else r["round"]
            recs.append(r)
    rounds = sorted({r["round"] for r in recs})
    backend = {r["round"]: r["mbps"] for r in recs if r["mode"] == "backend raw 4-stream"}
    single = {r["round"]: r["mbps"] for r in recs if r["mode"] == "backend raw 1-stream"}
    lines = []
    def med(xs: list) -> float:
        return statistics.median(xs) if xs else float("nan")

    lines.append(
        f"Backend (raw slow device, O_DIRECT 4 MiB): 4 streams "
        f"{' / '.join(f'{backend[k]:.0f}' for k in rounds if k in backend)} MB/s, "
        f"1 stream {' / '.join(f'{single[k]:.0f}' for k in rounds if k in single)} MB/s "
        f"(rounds {', '.join(map(str, rounds))}).\n")
    lines.append("| dataset | reader | mode | MB/s per round | × backend | × local | target | met |")
    lines.append("|---|---|---|---|---|---|---|---|")
    keyed = {}
    for r in recs:
        if "dataset" in r:
            keyed.setdefault((r["dataset"], r["reader"], r["mode"]), {})[r["round"]] = r
    ttfbs = []
    for ds in ("large", "small"):
        for reader in ("seq", "mp4"):
            for mode in MODE_ORDER:
                per = keyed.get((ds, reader, mode))
                if not per:
                    continue
                local = keyed.get((ds, reader, "local copy"), {})
                xb = [per[k]["mbps"] / backend[k] for k in per if k in backend]
                xl = [per[k]["mbps"] / local[k]["mbps"] for k in per if k in local]
                target, met = "", ""
                tkey = (ds, mode.split(" (")[0])
                if tkey in TARGETS:
                    base, factor = TARGETS[tkey]
                    ratio = med(xb if base == "backend" else xl)
                    target = f"≥ {factor}× {base}"
                    met = "yes" if ratio >= factor else "**no**" if ratio == ratio else "?"
                vals = " / ".join(f"{per[k]['mbps']:.0f}" for k in sorted(per))
                lines.append(
                    f"| {ds} | {reader} | {mode} | {vals} | {med(xb):.2f} | "
                    f"{med(xl):.2f} | {target} | {met} |")
                if mode.startswith("stagefs cold"):
                    ttfbs.extend(per[k]["ttfb_s"] for k in per)
    lines.append("")
    if ttfbs:
        worst = max(ttfbs)
        lines.append(
            f"Time to first byte (mount command start → first byte of the first file, cold cache, "
            f"all cold passes): median {med(ttfbs):.3f} s, worst {worst:.3f} s — target < 1 s: "
            f"{'met' if worst < 1 else '**not met**'}.")
    seeds = [r for r in recs if r["mode"] == "seed rsync+read"]
    for ds in ("large", "small"):
        s = [r for r in seeds if r["dataset"] == ds]
        if s:
            secs = " / ".join(f"{r['rsync_s']:.1f}" for r in s)
            lines.append(
                f"Seed workflow, {ds}: rsync takes {secs} s before the first byte can be read "
                f"(stagefs: see time to first byte).")
    for r in recs:
        if r["mode"] == "FAILED":
            lines.append(f"FAILED (round {r['round']}): {r['dataset']}/{r['reader']} stagefs cold"
                         f"{'' if r['staging'] else ' --no-staging'}: {r['error'][:300]}")
    files = {}
    for r in recs:
        if "files" in r:
            files.setdefault(r["dataset"], set()).add((r["files"], r["bytes"]))
    for ds, sizes in sorted(files.items()):
        txt = "; ".join(f"{n} files, {b / 1e9:.2f} GB" for n, b in sorted(sizes))
        lines.append(f"Dataset {ds} as read: {txt}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    for opt in ("--bigdata", "--local", "--scratch", "--mnt", "--stagefs", "--device", "--out"):
        r.add_argument(opt, required=True)
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--only", help="run only the passes whose name matches this regex")
    r.add_argument("--once", help="run the passes whose name matches this regex in round 1 only")
    r.add_argument("--top-dirs", type=int, default=0,
                   help="read only the first N top-level folders in every epoch (0: all)")
    r.add_argument("--workaround", type=int, default=1,
                   help="1: avoid the open/release lock-order deadlock of fs/src/fuse.rs on small "
                   "files (cold: --no-passthrough; warm with passthrough: --fuse-threads 1)")
    r.add_argument("--probe-bytes", type=int, default=2_000_000_000)
    rep = sub.add_parser("report")
    rep.add_argument("results", nargs="+")
    a = p.parse_args()
    if a.cmd == "run":
        global TOP_DIRS
        TOP_DIRS = a.top_dirs
        Bench(a).run()
    else:
        sys.stdout.write(report(a.results))


if __name__ == "__main__":
    main()
