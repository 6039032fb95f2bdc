"""One epoch over the large files of a directory (issue 20), as bench/mount/large.sh runs it.

Modes: `seq` reads each file in order in 1 MiB chunks; `shuf` reads each file in random
1-4 MiB pieces (a permutation that covers it once, seeded per file); `mmap` maps each file and
touches one byte per 64 KiB row in random order (np.load(mmap_mode="r") with shuffled rows).
One thread per file (8 files: 8 readers). Prints: wall seconds, this process's CPU seconds.
"""

import mmap
import os
import random
import sys
import threading
import time

CHUNK = 1 << 20
ROW = 64 << 10


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


def main():
    directory, mode = sys.argv[1], sys.argv[2]
    fn = {"seq": seq, "shuf": shuf, "mmap": mm}[mode]
    files = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".bin"))
    t0, c0 = time.perf_counter(), os.times()
    threads = [threading.Thread(target=fn, args=(p,)) for p in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c1 = os.times()
    print(f"{time.perf_counter() - t0:.3f} {c1.user - c0.user + c1.system - c0.system:.3f}")


if __name__ == "__main__":
    main()
