"""One epoch over the large files of a directory (issue 20), as bench/mount/large.sh runs it.

Modes: `seq` reads each file in order in 1 MiB chunks (a thread per file; `seq1`: one thread,
the files one after the other); `shuf` reads each file in random
1-4 MiB pieces (a permutation that covers it once, seeded per file); `mmap` maps each file and
touches one byte per 64 KiB row in random order (np.load(mmap_mode="r") with shuffled rows).
One thread per file (8 files: 8 readers). `small` is the small-file counterpart of the CPU
figure: every file under DIRECTORY/small, shuffled, read whole by 8 threads with a 1 MiB buffer
(a DataLoader's 8 workers, as bench/mount/reader.py's shuf8). Prints: wall seconds, this
process's CPU seconds.
"""

import mmap
import os
import random
import sys
import threading
import time

CHUNK = 1 << 20
ROW = 64 << 10
SMALL_THREADS = 8


def seq(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, CHUNK):
            pass
    finally:
        os.close(fd)


def shuf(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        rng = random.Random(os.path.basename(path))
        pieces, off = [], 0
        while off < size:
            n = rng.randint(1, 4) * CHUNK
            pieces.append((off, n))
            off += n
        rng.shuffle(pieces)
        for off, n in pieces:
            os.pread(fd, n, off)
    finally:
        os.close(fd)


def mm(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        rows = list(range(0, size, ROW))
        random.Random(os.path.basename(path)).shuffle(rows)
        total = 0
        for r in rows:
            total += m[r]
        m.close()
    finally:
        os.close(fd)


def small(files):
    """Reads whole files, each thread taking the next one from the shared list."""
    buf = bytearray(CHUNK)
    while files:
        try:
            path = files.pop()  # atomic under the GIL: the list is the work queue
        except IndexError:
            return
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def main():
    directory, mode = sys.argv[1], sys.argv[2]
    large = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".bin"))
    if mode == "small":
        root = os.path.join(directory, "small")
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
        random.Random(0).shuffle(files)
        jobs = [(small, (files,))] * SMALL_THREADS
    elif mode == "seq1":  # one reader, the files one after the other (ImageFolder order)
        jobs = [(lambda fs: [seq(p) for p in fs], (large,))]
    else:
        fn = {"seq": seq, "shuf": shuf, "mmap": mm}[mode]
        jobs = [(fn, (p,)) for p in large]
    t0, c0 = time.perf_counter(), os.times()
    threads = [threading.Thread(target=fn, args=args) for fn, args in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c1 = os.times()
    print(f"{time.perf_counter() - t0:.3f} {c1.user - c0.user + c1.system - c0.system:.3f}")


if __name__ == "__main__":
    main()
