#!/usr/bin/env python3
"""Side-by-side benchmark of the cleaning job: stagefs vs polars, DuckDB, the seed's Dask script
and pandas, at 1 GB, 4 GB or 16 GB of CSV.

Runs are alternated (A B C D, A B C D, ...) so that the noise of a shared machine spreads evenly;
each run is timed from the outside (wall clock) and the resident memory of its whole process
tree (the tool plus every child, e.g. Dask's workers) is sampled every 20 ms for the peak. The
1-minute load average is recorded before every run (a quiet machine reads near 0; figures
taken above ~0.5 per core are not comparable). Every tool must write the same number of rows.

    python3 bench/clean_gen.py /tmp/clean-1g --size 1G --files 8      # once per size
    python3 bench/clean_bench.py /tmp/clean-1g --rounds 3
    python3 bench/clean_bench.py --size 4G --rounds 2                 # generates if missing
    python3 bench/clean_bench.py --size 16G --rounds 1 --tools stagefs,polars,duckdb,dask

Needs psutil, pyarrow (and polars, duckdb, dask[distributed], pandas for those tools). Prints a
Markdown table with each tool's median wall time, peak RSS, and stagefs's speed-up over it,
then the issue's goals as met / not met.
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
FILES = {"1G": 8, "4G": 32, "16G": 128}
# The goals of issue 13: stagefs at least this many times faster than each peer.
GOALS = {"polars": 1.5, "duckdb": 1.5, "dask": 5.0}
RSS_GOAL = 1 << 30


def commands(tool, data, out, py, binary):
    return {
        "stagefs": [binary, "convert", data, out, "--to", "parquet", *STEPS, "-q"],
        "dask": [py, str(HERE / "clean_dask_seed.py"), data, out],
        "polars": [py, str(HERE / "clean_peers.py"), "polars", data, out],
        "duckdb": [py, str(HERE / "clean_peers.py"), "duckdb", data, out],
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
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="?", help="directory of CSV files (default: /tmp/clean-SIZE)")
    ap.add_argument("--size", choices=sorted(FILES), default="1G",
                    help="generate /tmp/clean-SIZE with bench/clean_gen.py when DATA is absent")
    ap.add_argument("--out", default="/tmp/clean-bench-out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tools", default="stagefs,polars,duckdb,dask,pandas")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "stagefs"))
    ap.add_argument("--json", help="also write the raw figures here")
    a = ap.parse_args()
    data = Path(a.data or f"/tmp/clean-{a.size.lower()}")
    if not data.exists():
        subprocess.run([a.python, str(HERE / "clean_gen.py"), str(data), "--size", a.size,
                        "--files", str(FILES[a.size])], check=True)
    tools = a.tools.split(",")
    files = sorted(data.glob("*.csv"))
    size = sum(f.stat().st_size for f in files)
    results = {t: [] for t in tools}
    loads = []
    rows = {}
    for r in range(a.rounds):
        for tool in tools:
            out = Path(a.out) / tool
            shutil.rmtree(out, ignore_errors=True)
            load = os.getloadavg()[0]
            loads.append(load)
            wall, peak = run_once(commands(tool, str(data), str(out), a.python, a.bin))
            results[tool].append((wall, peak, load))
            rows[tool] = rows_written(out)
            shutil.rmtree(out, ignore_errors=True)
            print(f"round {r + 1} {tool:8s} {wall:8.2f} s  {size / wall / 1e9:5.2f} GB/s  "
                  f"peak RSS {peak / 2**20:7.0f} MiB  rows {rows[tool]}  load {load:.2f}",
                  file=sys.stderr, flush=True)
    if len(set(rows.values())) != 1:
        print(f"WARNING: tools wrote different row counts: {rows}", file=sys.stderr)
    med = {t: statistics.median(w for w, _, _ in results[t]) for t in tools}
    peak = {t: max(p for _, p, _ in results[t]) for t in tools}
    base = med.get("stagefs")
    print(f"\nInput: {size / 1e9:.2f} GB of CSV in {len(files)} files, {os.cpu_count()} CPUs, "
          f"{a.rounds} alternated rounds (median wall time); 1-min load average before the runs "
          f"{min(loads):.2f}–{max(loads):.2f}.\n")
    print("| tool | wall (s), each run | median | CSV GB/s | peak RSS of process tree "
          "| stagefs speed-up |")
    print("|---|---|---:|---:|---:|---:|")
    for tool in tools:
        each = ", ".join(f"{w:.2f}" for w, _, _ in results[tool])
        ratio = f"{med[tool] / base:.2f}×" if base else "-"
        print(f"| {tool} | {each} | {med[tool]:.2f} | {size / med[tool] / 1e9:.2f} | "
              f"{peak[tool] / 2**20:.0f} MiB | {ratio} |")
    if base:
        print()
        for tool, goal in GOALS.items():
            if tool in med:
                got = med[tool] / base
                print(f"- ≥ {goal}× {tool}: {got:.2f}× — {'met' if got >= goal else 'NOT met'}")
        ok = peak["stagefs"] <= RSS_GOAL
        print(f"- peak RSS ≤ 1 GiB: {peak['stagefs'] / 2**20:.0f} MiB — "
              f"{'met' if ok else 'NOT met'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"bytes": size, "results": results, "rows": rows,
                                            "load": loads}))


if __name__ == "__main__":
    main()
