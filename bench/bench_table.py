"""Parquet column → .npy array throughput, one thread: stagefs's table view vs pyarrow.

    python3 bench/bench_table.py [--rows 10000000] [--rounds 5] [--dir /tmp/stagefs-bench-table]

Writes a Parquet file once (float64 and int64 columns, snappy, 1 Mi-row row groups,
deterministic), then alternates per round: pyarrow `pq.read_table(f, columns=[c],
use_threads=False).column(c).to_numpy()` and the release example `bench_table` (footer parse +
full `<c>.npy` rendered through View::read_at in 8 MiB reads). Prints median GB/s of array data.
"""

import argparse
import os
import statistics
import subprocess
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/stagefs-bench-table")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "examples", "bench_table"))
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"t{args.rows}.parquet")
    if not os.path.exists(path):
        rng = np.random.default_rng(5)
        t = pa.table({"x": rng.normal(size=args.rows), "k": rng.integers(0, 1 << 40, args.rows)})
        pq.write_table(t, path, row_group_size=1 << 20, compression="snappy")
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    os.sched_setaffinity(0, {0})
    print(f"{path}: {os.path.getsize(path) / 1e6:.0f} MB, {args.rows} rows; one core (cpu 0)")
    for col in ["x", "k"]:
        ours, theirs = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            arr = pq.read_table(path, columns=[col], use_threads=False).column(col).to_numpy()
            theirs.append(arr.nbytes / (time.perf_counter() - t) / 1e9)
            out = subprocess.run(["taskset", "-c", "0", args.bin, path, col, "1"],
                                 check=True, capture_output=True, text=True).stdout
            ours.append(float(out.split()[-1]))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"column {col} ({arr.dtype}): stagefs {a:.2f} GB/s, pyarrow {b:.2f} GB/s, ratio {a / b:.2f}×")


if __name__ == "__main__":
    main()
