#!/usr/bin/env python3
"""The benchmark's readers, run as the unprivileged user (no root needed); each prints one JSON
line on stdout.

  reader.py epoch ROOT --reader shuf8|seq [--seed N] [--threads 8] [--compute-s-per-mb X]
      Lists ROOT as torchvision's ImageFolder does (os.walk, sorted; dot folders at the top, such
      as a mount's .stagefs, skipped), then reads every file whole with a 1 MiB buffer:
      - shuf8: the list shuffled (seed N: a DataLoader reshuffles per epoch) and read by
        --threads threads, each taking the next file from the shared list (DataLoader workers
        reading whole samples);
      - seq: one thread, ImageFolder order.
      Prints files, bytes, list_s, read_s, epoch_s (= list_s + read_s).
      --compute-s-per-mb X: a training step consumes what is read, X seconds per MB (a GPU
      busy for that long: the consumer sleeps, the CPU stays free for the reads), through a
      queue of PREFETCH chunks (a DataLoader's prefetched batches): reads run ahead of the
      step by at most that much, and the epoch ends when the step has consumed the last chunk.

  reader.py usable --stagefs BIN --src S --mnt M --cache C --deep REL [--read] [-- FLAGS...]
      Runs `stagefs mount S M --cache C FLAGS`, then stats M/REL (a file deep in the tree: the
      lookups wait only for the directories they need), then, with --read, reads it whole.
      Prints mount_s (the command), usable_s (command + first stat), first_read_s (command +
      stat + read), all from one clock in this process.
"""

import argparse
import itertools
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time

BUF = 1 << 20  # reader buffer: 1 MiB, like a DataLoader reading a whole sample, or cat
PREFETCH = 16  # chunks read ahead of the training step: 8 workers x prefetch_factor 2
NAP = 0.002  # the step sleeps once it is this far behind its clock (fewer, longer sleeps)


class Step:
    """A training step that takes `per_mb` seconds per MB read, fed through a bounded queue.

    It keeps a clock of when it will be free (its compute is a sleep, like a GPU's: the CPU
    stays with the readers) and sleeps once it is NAP behind it, so millions of 1 MiB chunks
    cost few system calls."""

    def __init__(self, per_mb: float) -> None:
        self.per_mb = per_mb
        self.q = queue.Queue(maxsize=PREFETCH)
        self.t = threading.Thread(target=self.run)
        self.t.start()

    def feed(self, n: int) -> None:
        self.q.put(n)

    def run(self) -> None:
        free = time.monotonic()
        while True:
            n = self.q.get()
            if n is None:
                break
            free = max(free, time.monotonic()) + self.per_mb * n / 1e6
            ahead = free - time.monotonic()
            if ahead > NAP:
                time.sleep(ahead)
        ahead = free - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)

    def finish(self) -> None:
        self.q.put(None)
        self.t.join()


def list_files(root: str) -> list:
    out = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        if d == root:
            dirs[:] = [x for x in dirs if not x.startswith(".")]
        out.extend(os.path.join(d, f) for f in sorted(files))
    return out


def read_file(path: str, buf: bytearray, step=None) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n
            n += k
            if step is not None:
                step.feed(k)


def read_seq(files: list, step=None) -> int:
    buf = bytearray(BUF)
    return sum(read_file(p, buf, step) for p in files)


def read_threads(files: list, threads: int, step=None) -> int:
    nxt = itertools.count()  # next() on a count is atomic under the GIL: a shared work queue
    totals = [0] * threads
    failures = []

    def work(i: int) -> None:
        buf = bytearray(BUF)
        try:
            while True:
                k = next(nxt)
                if k >= len(files):
                    return
                totals[i] += read_file(files[k], buf, step)
        except OSError as e:  # reported, not swallowed: a failed read fails the epoch
            failures.append(f"{e}")

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if failures:
        raise OSError(f"{len(failures)} reader thread(s) failed, first: {failures[0]}")
    return sum(totals)


def epoch(a: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    files = list_files(a.root)
    t1 = time.monotonic()
    step = Step(a.compute_s_per_mb) if a.compute_s_per_mb > 0 else None
    try:
        if a.reader == "seq":
            n = read_seq(files, step)
        else:
            random.Random(a.seed).shuffle(files)
            n = read_threads(files, a.threads, step)
    finally:
        if step is not None:
            step.finish()
    t2 = time.monotonic()
    return {"files": len(files), "bytes": n, "list_s": t1 - t0, "read_s": t2 - t1,
            "epoch_s": t2 - t0, "compute_s_per_mb": a.compute_s_per_mb}


def usable(a: argparse.Namespace) -> dict:
    deep = os.path.join(a.mnt, a.deep)
    t0 = time.monotonic()
    r = subprocess.run([a.stagefs, "mount", a.src, a.mnt, "--cache", a.cache, *a.flags],
                       capture_output=True, text=True)
    t1 = time.monotonic()
    if r.returncode != 0:
        sys.exit(f"stagefs mount failed ({r.returncode}): {r.stderr.strip()}")
    os.stat(deep)
    t2 = time.monotonic()
    out = {"mount_s": t1 - t0, "usable_s": t2 - t0}
    if a.read:
        out["first_read_bytes"] = read_file(deep, bytearray(BUF))
        out["first_read_s"] = time.monotonic() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("epoch")
    e.add_argument("root")
    e.add_argument("--reader", choices=("shuf8", "seq"), required=True)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=int, default=8)
    e.add_argument("--compute-s-per-mb", type=float, default=0.0)
    u = sub.add_parser("usable")
    for opt in ("--stagefs", "--src", "--mnt", "--cache", "--deep"):
        u.add_argument(opt, required=True)
    u.add_argument("--read", action="store_true")
    u.add_argument("flags", nargs="*")
    a = p.parse_args()
    print(json.dumps(epoch(a) if a.cmd == "epoch" else usable(a)))


if __name__ == "__main__":
    main()
