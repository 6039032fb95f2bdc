#!/usr/bin/env python3
"""Generates the sensor-style CSV input of the cleaning benchmark, deterministically.

Columns: sensor (text id), temp, humidity, value (floats; value ~30% negative), label (int class),
site (free text, quoted). About 1% NaN (empty fields) in the float columns and in sensor.
Writes FILES files of about SIZE/FILES bytes each into DIR (part-000.csv, ...).

    python3 bench/clean_gen.py DIR --size 1G --files 8
"""

import argparse
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

SITES = np.array(["north field", "river bank, east", "lab 3", "roof", "greenhouse \"B\""])


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


def block(rng, rows):
    nan = lambda: rng.random(rows) < 0.01  # noqa: E731
    def with_nan(x):
        return pa.array(x, mask=nan())
    sensor = pa.array(np.char.add("s-", rng.integers(0, 5000, rows).astype("U4")), mask=nan())
    return pa.table({
        "sensor": sensor,
        "temp": with_nan(rng.normal(18.0, 6.0, rows)),
        "humidity": with_nan(rng.uniform(5.0, 95.0, rows)),
        "value": with_nan(rng.normal(0.5, 1.0, rows)),
        "label": pa.array(rng.integers(0, 10, rows)),
        "site": pa.array(SITES[rng.integers(0, len(SITES), rows)]),
    })


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()
    out = Path(a.dir)
    out.mkdir(parents=True, exist_ok=True)
    per_file = parse_size(a.size) // a.files
    rng = np.random.default_rng(a.seed)
    for i in range(a.files):
        path = out / f"part-{i:03d}.csv"
        with pa.OSFile(str(path), "wb") as sink:
            writer = None
            while sink.tell() < per_file:
                t = block(rng, 200_000)
                if writer is None:
                    writer = pacsv.CSVWriter(sink, t.schema)
                writer.write_table(t)
            writer.close()
        print(f"{path} {os.path.getsize(path) / 1e6:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
