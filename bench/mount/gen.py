#!/usr/bin/env python3
"""Writes the benchmark datasets, deterministically (same seed → same bytes).

large/part-NNNN.bin   LARGE_FILES files of LARGE_MB MB each (checkpoint/shard-like)
small/nNNNNN/img_NNNNNN.JPEG  SMALL_FILES files in SMALL_CLASSES class folders, sizes uniform in
                      [0.6, 1.4] × SMALL_KB KB (ImageNet train JPEGs average ~110 KB)

Contents are pseudo-random (incompressible), so no layer can cheat by compressing.
Usage: gen.py DEST LARGE_FILES LARGE_MB SMALL_FILES SMALL_CLASSES SMALL_KB
"""

import os
import random
import sys

CHUNK = 8 << 20  # write large files in 8 MiB pieces: bounded memory, few syscalls


def write_random(path: str, size: int, rng: random.Random) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(CHUNK, left)
            f.write(rng.randbytes(n))
            left -= n


def main() -> None:
    dest, large_files, large_mb, small_files, classes, small_kb = sys.argv[1:7]
    large_files, large_mb = int(large_files), int(large_mb)
    small_files, classes, small_kb = int(small_files), int(classes), int(small_kb)
    rng = random.Random(20260202)

    large = os.path.join(dest, "large")
    os.makedirs(large, exist_ok=True)
    for i in range(large_files):
        write_random(os.path.join(large, f"part-{i:04d}.bin"), large_mb * 1_000_000, rng)
        print(f"  large {i + 1}/{large_files}", file=sys.stderr, flush=True)

    small = os.path.join(dest, "small")
    for c in range(classes):
        os.makedirs(os.path.join(small, f"n{c:06d}"), exist_ok=True)
    lo, hi = int(small_kb * 600), int(small_kb * 1400)
    for i in range(small_files):
        c = i % classes  # round-robin keeps classes equal in size; files sort by index per class
        path = os.path.join(small, f"n{c:06d}", f"img_{i:07d}.JPEG")
        with open(path, "wb") as f:
            f.write(rng.randbytes(rng.randint(lo, hi)))
        if (i + 1) % 5000 == 0:
            print(f"  small {i + 1}/{small_files}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
