"""Parquet column → .npy array throughput: stagefs's table view vs pyarrow, for float64, int64 and
bool columns, one thread and all threads.

    cargo build --release -p stagefs-views --example bench_table
    python3 bench/bench_table.py [--rows 10000000] [--rounds 5] [--dir /tmp/stagefs-bench-table]

Writes a Parquet file once (float64, int64 and bool columns, snappy, 1 Mi-row row groups,
deterministic), then alternates per round: pyarrow
`pq.read_table(f, columns=[c], use_threads=T).column(c).to_numpy()` and the release example
`bench_table` (footer parse + the full `<c>.npy` rendered through View::read_at: 8 MiB reads in
order with one thread, or chunk-parallel as `convert --to npy` does with all threads). One
thread: both pinned to cpu 0. Both sides are timed warm, as the second of two reads in a row:
pyarrow in this process, stagefs in its own (as in the mount's long-lived daemon); stagefs's
first read of a fresh process (what `convert --to npy` pays) is printed beside it. Prints the
median GB/s of array data, the ratio (≥ 1.0 is the goal), and the 1-minute load average
(wall-clock figures from a loaded machine are not comparable).
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
        t = pa.table({"x": rng.normal(size=args.rows), "k": rng.integers(0, 1 << 40, args.rows),
                      "b": rng.random(args.rows) < 0.3})
        pq.write_table(t, path, row_group_size=1 << 20, compression="snappy")
    print(f"{path}: {os.path.getsize(path) / 1e6:.0f} MB, {args.rows} rows, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start\n")
    print("| column | threads | stagefs GB/s | pyarrow GB/s | ratio | stagefs, first read of a process |")
    print("|---|---|---:|---:|---:|---:|")
    all_cpus = os.sched_getaffinity(0)
    for threads in ["1", "all"]:
        one = threads == "1"
        for col in ["x", "k", "b"]:
            ours, cold, theirs = [], [], []
            for _ in range(args.rounds):
                os.sched_setaffinity(0, {min(all_cpus)} if one else all_cpus)
                for _ in range(2):  # time the second of two reads in a row
                    t = time.perf_counter()
                    arr = pq.read_table(path, columns=[col], use_threads=not one).column(col).to_numpy()
                    secs = time.perf_counter() - t
                theirs.append(arr.nbytes / secs / 1e9)
                os.sched_setaffinity(0, all_cpus)
                cmd = [args.bin, path, col, "2", "1" if one else "0"]
                if one:
                    cmd = ["taskset", "-c", str(min(all_cpus))] + cmd
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                first, second = (float(x) for x in out.split()[-2:])
                ours.append(second)
                cold.append(first)
            a, b = statistics.median(ours), statistics.median(theirs)
            c = statistics.median(cold)
            print(f"| {col} ({arr.dtype}) | {threads} | {a:.2f} | {b:.2f} | {a / b:.2f}× | {c:.2f} |",
                  flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
