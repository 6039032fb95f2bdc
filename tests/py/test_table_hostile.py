"""Hostile tables through `stagefs convert --to npy`: one bad table or name must not abort the
run; the rest is converted and read back with NumPy. Named after the bugs they pin."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STAGEFS_BIN", str(ROOT / "target" / "debug" / "stagefs"))


def test_column_name_over_255_bytes_does_not_abort_convert(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    long = "é" * 150  # 300 bytes of UTF-8: too long for a file name
    pq.write_table(pa.table({long: np.arange(5, dtype=np.float64), "y": np.arange(5)}),
                   src / "t.parquet")
    pq.write_table(pa.table({"z": np.array([True, False, True])}), src / "u.parquet")
    proc = subprocess.run([BIN, "convert", src, out, "--to", "npy", "-q"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    schema = json.loads((out / "t.parquet" / "schema.json").read_text())
    entry = next(c for c in schema["columns"] if c["name"] == long)
    assert len(entry["file"].encode()) <= 255 - 16 and entry["file"].endswith("_0.npy")
    np.testing.assert_array_equal(np.load(out / "t.parquet" / entry["file"]), np.arange(5.0))
    np.testing.assert_array_equal(np.load(out / "t.parquet" / "y.npy"), np.arange(5))
    np.testing.assert_array_equal(np.load(out / "u.parquet" / "z.npy"), [True, False, True])


def test_views_equal_pyarrow_for_float_int_bool_with_nulls(tmp_path):
    # The zero-copy block path (no nulls) and the filled path (nulls) against pyarrow.
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    rng = np.random.default_rng(1)
    n = 300_000
    x = rng.normal(size=n)
    k = rng.integers(-(1 << 40), 1 << 40, n)
    b = rng.random(n) < 0.4
    mask = rng.random(n) < 0.05
    t = pa.table({"x": x, "k": k, "b": b,
                  "xn": pa.array(x, mask=mask), "bn": pa.array(b, mask=mask)})
    pq.write_table(t, src / "t.parquet", row_group_size=70_000)
    proc = subprocess.run([BIN, "convert", src, out, "--to", "npy", "-q"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    d = out / "t.parquet"
    np.testing.assert_array_equal(np.load(d / "x.npy"), x)
    np.testing.assert_array_equal(np.load(d / "k.npy"), k)
    np.testing.assert_array_equal(np.load(d / "b.npy"), b)
    np.testing.assert_array_equal(np.load(d / "xn.npy"), np.where(mask, np.nan, x))
    # A boolean column with nulls widens to float64 (NaN for null), as docs/views.md says.
    np.testing.assert_array_equal(np.load(d / "bn.npy"), np.where(mask, np.nan, b))
