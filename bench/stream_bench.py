#!/usr/bin/env python3
"""Host-side benchmark of `stagefs stream --device cpu` against the loader a user would otherwise
write: numpy's `np.load(mmap_mode="r")`, each batch copied out of the map and then into a second,
reused buffer — the two host copies of a PyTorch DataLoader over a memory-mapped .npy with
`pin_memory=True` (collate, then pin). stagefs also makes two host copies here (`pread` into the
ring, then the host device's stand-in for the DMA to the GPU). Both read the same file from the
page cache in batches of the same rows, single-threaded for numpy as in one DataLoader worker
(stagefs with its default reader threads); runs alternate A B A B; the ratio is per round.

The GPU figures (pinned copy peak, page cache and disk to device) come from scripts/gpu-check.sh
on a machine with an NVIDIA GPU.

    python3 bench/stream_bench.py [--size-gb 1] [--rounds 3] [--bin target/release/stagefs]
"""

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

ROW_BYTES = 1 << 20  # 1 MiB rows: large sequential reads on both sides
BATCH_ROWS = 32  # 32 MiB batches, stagefs stream's default size


def make_file(path: Path, size_gb: float) -> int:
    rows = int(size_gb * 1e9) // ROW_BYTES
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(rows, ROW_BYTES))
    rng = np.random.default_rng(0)
    for i in range(0, rows, 64):
        arr[i : i + 64] = rng.integers(0, 256, size=arr[i : i + 64].shape, dtype=np.uint8)
    arr.flush()
    del arr
    return rows * ROW_BYTES


def numpy_loader(path: Path) -> float:
    """GB/s of copying every batch of an mmap-ed .npy out of the map and into a "pinned" buffer."""
    start = time.perf_counter()
    mm = np.load(path, mmap_mode="r")
    batch = np.empty((BATCH_ROWS, mm.shape[1]), dtype=mm.dtype)
    pinned = np.empty_like(batch)
    batch.fill(0)
    pinned.fill(0)  # resident, as pinned memory is
    total = 0
    for i in range(0, mm.shape[0], BATCH_ROWS):
        part = mm[i : i + BATCH_ROWS]
        n = len(part)
        np.copyto(batch[:n], part)
        np.copyto(pinned[:n], batch[:n])
        total += part.nbytes
    return total / 1e9 / (time.perf_counter() - start)


def stagefs(binary: str, path: Path) -> dict:
    out = subprocess.run(
        [binary, "stream", str(path), "--device", "cpu", "--batch-rows", str(BATCH_ROWS), "--json"],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    root = Path(__file__).resolve().parents[1]
    ap.add_argument("--bin", default=str(root / "target" / "release" / "stagefs"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        path = Path(d) / "bench.npy"
        size = make_file(path, args.size_gb)
        print(f"file: {size / 1e9:.2f} GB uint8 [{size // ROW_BYTES}, {ROW_BYTES}], batches of {BATCH_ROWS} rows, "
              f"page cache, {os.cpu_count()} cores")
        numpy_loader(path)  # warm the page cache
        ratios = []
        for r in range(args.rounds):
            a = stagefs(args.bin, path)
            b = numpy_loader(path)
            ratios.append(a["gb_per_s"] / b)
            print(f"round {r + 1}: stagefs stream {a['gb_per_s']:.2f} GB/s "
                  f"(device waited {100 * a['device_wait_share']:.0f}%), numpy mmap+collate+pin {b:.2f} GB/s, "
                  f"ratio {ratios[-1]:.2f}x")
        ratios.sort()
        print(f"median ratio stagefs/numpy: {ratios[len(ratios) // 2]:.2f}x")


if __name__ == "__main__":
    main()
