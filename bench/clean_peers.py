#!/usr/bin/env python3
"""The same cleaning job in pandas (in memory) and polars (lazy scan + sink_parquet).

    python3 bench/clean_peers.py pandas|polars SRC_DIR OUT_DIR
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


if __name__ == "__main__":
    {"pandas": run_pandas, "polars": run_polars}[sys.argv[1]](sys.argv[2], sys.argv[3])
