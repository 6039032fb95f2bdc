#!/usr/bin/env python3
"""Side-by-side benchmark of the cleaning job: stagefs vs the seed's Dask script, pandas, polars.

Runs are alternated (A B C D, A B C D, ...) to spread the noise of a shared VM evenly; each run
is timed from the outside (wall clock) and the resident memory of its whole process tree
(the tool plus every child, e.g. Dask's workers) is sampled every 20 ms for the peak.

    python3 bench/clean_gen.py /tmp/clean-1g --size 1G --files 8
    python3 bench/clean_bench.py /tmp/clean-1g --out /tmp/clean-out --rounds 2

Needs psutil (and dask[distributed], polars for those tools). Prints a Markdown table.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STEPS = ["--dropna", "--filter", "value > 0", "--standardize", "temp,humidity,value"]


def commands(tool, data, out, py, binary):
    return {
        "stagefs": [binary, "convert", data, out, "--to", "parquet", *STEPS, "-q"],
        "dask": [py, str(HERE / "clean_dask_seed.py"), data, out],
        "polars": [py, str(HERE / "clean_peers.py"), "polars", data, out],
        "pandas": [py, str(HERE / "clean_peers.py"), "pandas", data, out],
    }[tool]


def tree_rss(proc):
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_once(cmd):
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ps = psutil.Process(p.pid)
    peak = 0
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, tree_rss(ps))
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    _, err = p.communicate()
    wall = time.perf_counter() - start
    stop.set()
    t.join()
    if p.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed ({p.returncode}):\n{err.decode()[-3000:]}")
    return wall, peak


def rows_written(out):
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in Path(out).rglob("*.parquet"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--out", default="/tmp/clean-bench-out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tools", default="stagefs,polars,dask,pandas")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "stagefs"))
    ap.add_argument("--json", help="also write the raw figures here")
    a = ap.parse_args()
    tools = a.tools.split(",")
    size = sum(f.stat().st_size for f in Path(a.data).glob("*.csv"))
    results = {t: [] for t in tools}
    rows = {}
    for r in range(a.rounds):
        for tool in tools:
            out = Path(a.out) / tool
            shutil.rmtree(out, ignore_errors=True)
            wall, peak = run_once(commands(tool, a.data, str(out), a.python, a.bin))
            results[tool].append((wall, peak))
            rows[tool] = rows_written(out)
            print(f"round {r + 1} {tool:8s} {wall:7.2f} s  {size / wall / 1e9:5.2f} GB/s  "
                  f"peak RSS {peak / 2**20:7.0f} MiB  rows {rows[tool]}", file=sys.stderr,
                  flush=True)
    if len(set(rows.values())) != 1:
        print(f"WARNING: tools wrote different row counts: {rows}", file=sys.stderr)
    base = statistics.median(w for w, _ in results["stagefs"]) if "stagefs" in results else None
    print(f"\nInput: {size / 1e9:.2f} GB of CSV in {len(list(Path(a.data).glob('*.csv')))} files,"
          f" {os.cpu_count()} CPUs, {a.rounds} alternated rounds (median wall time).\n")
    print("| tool | wall (s) | CSV GB/s | peak RSS of process tree | stagefs speed-up |")
    print("|---|---:|---:|---:|---:|")
    for tool in tools:
        wall = statistics.median(w for w, _ in results[tool])
        peak = max(p for _, p in results[tool])
        ratio = f"{wall / base:.2f}x" if base else "-"
        print(f"| {tool} | {wall:.2f} | {size / wall / 1e9:.2f} | {peak / 2**20:.0f} MiB | {ratio} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"bytes": size, "results": results, "rows": rows}))


if __name__ == "__main__":
    main()
