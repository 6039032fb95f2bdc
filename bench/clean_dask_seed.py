#!/usr/bin/env python3
"""The seed's preprocessing job, as it ran before stagefs: Dask on one CPU node.

    python3 bench/clean_dask_seed.py SRC_DIR OUT_DIR

read_csv → dropna → filter value > 0 → standardize the numeric sensor columns → to_parquet.
"""

import sys

import dask.dataframe as dd
from dask.distributed import Client, LocalCluster

NUMERIC = ["temp", "humidity", "value"]


def main(src, out):
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster):
        df = dd.read_csv(f"{src}/*.csv")
        df = df.dropna()
        df = df[df.value > 0]
        for c in NUMERIC:
            df[c] = (df[c] - df[c].mean()) / df[c].std()
        df.to_parquet(out, compression="zstd", write_index=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
