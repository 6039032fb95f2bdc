#!/usr/bin/env python3
"""Generates an ImageNet-shaped tree of sparse files for the snapshot benchmark.

DIRS class folders (n00000000 ...) of FILES files each (n00000000_123.JPEG), 80-140 KB each
but sparse (ftruncate, no data blocks), so 1.28 M files cost inodes and directory blocks only.
Writes TREE/.complete last, so an interrupted run is redone, not reused half-made.

Usage: bench/gen_tree.py TREE [DIRS] [FILES]
"""
import os
import sys


def main():
    tree = sys.argv[1]
    dirs = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    files = int(sys.argv[3]) if len(sys.argv) > 3 else 1280
    marker = os.path.join(tree, ".complete")
    if os.path.exists(marker):
        print(f"{tree}: already generated")
        return
    os.makedirs(tree, exist_ok=True)
    for d in range(dirs):
        cls = f"n{d * 1000 + 1440764:08d}"
        path = os.path.join(tree, cls)
        os.makedirs(path, exist_ok=True)
        for f in range(files):
            name = os.path.join(path, f"{cls}_{f * 7 + 10000}.JPEG")
            fd = os.open(name, os.O_WRONLY | os.O_CREAT, 0o644)
            os.ftruncate(fd, 80_000 + (f * 7919 + d * 104729) % 60_000)
            os.close(fd)
        if d % 100 == 99:
            print(f"{tree}: {d + 1}/{dirs} directories", flush=True)
    with open(marker, "w") as m:
        m.write(f"{dirs} {files}\n")


if __name__ == "__main__":
    main()
