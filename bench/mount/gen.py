#!/usr/bin/env python3
"""Writes the benchmark datasets.

  gen.py backend DEST LARGE_FILES LARGE_MB SMALL_FILES SMALL_CLASSES SMALL_KB
      large/part-NNNN.bin             LARGE_FILES files of LARGE_MB MB (checkpoint/shard-like)
      small/nNNNNNN/img_NNNNNNN.JPEG  SMALL_FILES files in SMALL_CLASSES class folders, sizes
                                      uniform in [0.6, 1.4] x SMALL_KB KB (ImageNet train JPEGs
                                      average ~110 KB)
      Contents are pseudo-random (incompressible), so no layer can cheat by compressing; the
      same arguments give the same bytes.

  gen.py scale DEST FILES CLASSES
      DEST/train/nNNNNNNNN/nNNNNNNNN_NNNNN.JPEG: FILES files (ImageNet: 1,281,167; 1000 classes)
      of 1-4 KB each. The files are holes (ftruncate, no data blocks): 1.28 M of them cost only
      their inodes and directories on the host disk (~0.2 GB instead of ~5 GB of 4 KB blocks),
      and this part of the benchmark measures metadata, the cache index and packing, not
      bandwidth. Reading them returns zeros; byte-exactness is what tests/ check.
      Writes DEST/complete when done, so an interrupted run is redone, not reused.
"""

import multiprocessing as mp
import os
import random
import sys

CHUNK = 8 << 20  # write large files in 8 MiB pieces: bounded memory, few syscalls
MTIME = 1_700_000_000  # fixed mtime for the scale tree: the same tree lists the same everywhere


def write_random(path: str, size: int, rng: random.Random) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(CHUNK, left)
            f.write(rng.randbytes(n))
            left -= n


def backend(dest: str, large_files: int, large_mb: int, small_files: int, classes: int,
            small_kb: int) -> None:
    rng = random.Random(20260202)
    large = os.path.join(dest, "large")
    os.makedirs(large, exist_ok=True)
    for i in range(large_files):
        write_random(os.path.join(large, f"part-{i:04d}.bin"), large_mb * 1_000_000, rng)
        print(f"  large {i + 1}/{large_files}", file=sys.stderr, flush=True)

    small = os.path.join(dest, "small")
    for c in range(classes):
        os.makedirs(os.path.join(small, f"n{c:07d}"), exist_ok=True)
    lo, hi = int(small_kb * 600), int(small_kb * 1400)
    for i in range(small_files):
        c = i % classes  # round-robin keeps classes equal in size; files sort by index per class
        path = os.path.join(small, f"n{c:07d}", f"img_{i:07d}.JPEG")
        with open(path, "wb") as f:
            f.write(rng.randbytes(rng.randint(lo, hi)))
        if (i + 1) % 5000 == 0:
            print(f"  small {i + 1}/{small_files}", file=sys.stderr, flush=True)


def class_name(c: int) -> str:
    return f"n{1440764 + c * 1000:08d}"  # ImageNet-like WordNet ids, sorted like the classes


def scale_class(args: tuple) -> int:
    """One class folder of the scale tree: per file open(O_EXCL) + ftruncate + utime + close."""
    train, c, first, count = args
    d = os.path.join(train, class_name(c))
    os.makedirs(d, exist_ok=True)
    rng = random.Random(c)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for j in range(first, first + count):
        fd = os.open(os.path.join(d, f"{class_name(c)}_{j:05d}.JPEG"), flags, 0o644)
        try:
            os.ftruncate(fd, rng.randint(1024, 4096))
            os.utime(fd, (MTIME, MTIME))
        finally:
            os.close(fd)
    os.utime(d, (MTIME, MTIME))
    return count


def scale(dest: str, files: int, classes: int) -> None:
    train = os.path.join(dest, "train")
    if os.path.exists(os.path.join(dest, "complete")):
        return
    if os.path.exists(train):
        sys.exit(f"gen.py: {train} exists but is incomplete: delete {dest} and run again")
    os.makedirs(train)
    per, extra = divmod(files, classes)
    jobs = [(train, c, 0, per + (c < extra)) for c in range(classes)]
    done = 0
    with mp.get_context("fork").Pool(os.cpu_count() or 2) as pool:
        for n in pool.imap_unordered(scale_class, jobs, chunksize=8):
            done += n
            if done % 100_000 < n:
                print(f"  scale {done}/{files}", file=sys.stderr, flush=True)
    os.utime(train, (MTIME, MTIME))
    with open(os.path.join(dest, "complete"), "w") as f:
        f.write(f"{files} {classes}\n")


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "backend" and len(sys.argv) == 8:
        backend(sys.argv[2], *map(int, sys.argv[3:8]))
    elif len(sys.argv) >= 2 and sys.argv[1] == "scale" and len(sys.argv) == 5:
        scale(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
