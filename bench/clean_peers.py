#!/usr/bin/env python3
"""The benchmark's cleaning job in the peer tools, each as its users would write it.

    python3 bench/clean_peers.py pandas|polars|duckdb SRC_DIR OUT_DIR

Job: read all SRC_DIR/*.csv → dropna (every column) → keep value > 0 → standardize temp,
humidity, value ((x - mean) / std, ddof=1, statistics over the kept rows) → Parquet (zstd).
- pandas: in memory (read_csv per file, concat).
- polars: lazy scan_csv … sink_parquet (the streaming engine).
- duckdb: two-pass SQL, as the statistics need all kept rows first: one query for the
  statistics, then COPY … TO parquet with them as constants (insertion order preserved).
"""

import glob
import os
import sys

NUMERIC = ["temp", "humidity", "value"]


def run_pandas(src, out):
    import pandas as pd

    df = pd.concat([pd.read_csv(f) for f in sorted(glob.glob(f"{src}/*.csv"))],
                   ignore_index=True)
    df = df.dropna()
    df = df[df.value > 0]
    for c in NUMERIC:
        df[c] = (df[c] - df[c].mean()) / df[c].std()
    os.makedirs(out, exist_ok=True)
    df.to_parquet(f"{out}/part.0.parquet", compression="zstd", index=False)


def run_polars(src, out):
    import polars as pl

    lf = pl.scan_csv(f"{src}/*.csv")
    lf = lf.drop_nulls().filter(pl.col("value") > 0)
    lf = lf.with_columns([(pl.col(c) - pl.col(c).mean()) / pl.col(c).std() for c in NUMERIC])
    os.makedirs(out, exist_ok=True)
    lf.sink_parquet(f"{out}/part.0.parquet", compression="zstd")


def run_duckdb(src, out):
    import duckdb

    con = duckdb.connect()
    cols = [c for c, *_ in con.execute(
        f"DESCRIBE SELECT * FROM read_csv('{src}/*.csv')").fetchall()]
    kept = (f"SELECT * FROM read_csv('{src}/*.csv') WHERE "
            + " AND ".join(f'"{c}" IS NOT NULL' for c in cols)
            + " AND NOT isnan(value) AND value > 0")
    stats = con.execute("SELECT " + ", ".join(
        f"avg({c}), stddev_samp({c})" for c in NUMERIC) + f" FROM ({kept})").fetchone()
    moments = {c: (stats[2 * i], stats[2 * i + 1]) for i, c in enumerate(NUMERIC)}
    select = ", ".join(
        f"({c} - {moments[c][0]!r}) / {moments[c][1]!r} AS {c}" if c in moments else f'"{c}"'
        for c in cols)
    os.makedirs(out, exist_ok=True)
    con.execute(f"COPY (SELECT {select} FROM ({kept})) TO '{out}/part.0.parquet' "
                "(FORMAT parquet, COMPRESSION zstd)")


if __name__ == "__main__":
    {"pandas": run_pandas, "polars": run_polars, "duckdb": run_duckdb}[sys.argv[1]](
        sys.argv[2], sys.argv[3])
