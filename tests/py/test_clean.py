"""`stagefs convert --to parquet`: the cleaning job checked against pandas.

Every test generates its CSV/Parquet input deterministically, runs the real binary, reads the
output back with pyarrow and pandas, and compares it with pandas' own result of the same steps
on the same input (floats within 1e-12 relative; standardized values near 0 also get 1e-12
absolute, since (x - mean) loses relative precision there in pandas too).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STAGEFS_BIN", str(ROOT / "target" / "debug" / "stagefs"))
RTOL = 1e-12
ATOL = 1e-12


def stagefs(*args, check=True):
    proc = subprocess.run([BIN, "convert", *map(str, args)], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"stagefs failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def sensor_frame(rows, seed, quoted=False):
    """Sensor-style table: ~1% NaN in the float columns, negatives in value."""
    rng = np.random.default_rng(seed)
    df = pd.DataFrame(
        {
            "sensor": [f"s-{i:04d}" for i in rng.integers(0, 500, rows)],
            "temp": rng.normal(20.0, 5.0, rows).round(3),
            "humidity": rng.uniform(10, 90, rows),
            "value": rng.normal(0.5, 2.0, rows),
            "label": rng.integers(0, 10, rows),
            "count": rng.integers(-1000, 1000, rows),
        }
    )
    for col in ["temp", "humidity", "value"]:
        df.loc[rng.random(rows) < 0.01, col] = np.nan
    df.loc[rng.random(rows) < 0.005, "sensor"] = np.nan
    if quoted:
        # Commas, quotes and newlines inside a quoted field must not split records.
        notes = np.array(["plain", 'say "hi", ok', "two\nlines", "a,b,c", "x"])
        df["sensor"] = notes[rng.integers(0, len(notes), rows)]
    return df


def write_inputs(tmp, spec):
    """spec: list of (name, rows, seed, kind, quoted). Returns SRC dir."""
    src = tmp / "src"
    src.mkdir()
    for name, rows, seed, kind, quoted in spec:
        df = sensor_frame(rows, seed, quoted)
        if kind == "csv":
            df.to_csv(src / name, index=False)
        else:
            pq.write_table(pa.Table.from_pandas(df, preserve_index=False), src / name,
                           row_group_size=max(1, rows // 3))
    return src


def read_input(path):
    return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)


def pandas_reference(files, steps):
    """The seed's job in pandas over all files at once; returns per-file frames and stats."""
    frames = [read_input(f).assign(__file=i) for i, f in enumerate(files)]
    df = pd.concat(frames, ignore_index=True)
    stats = {}
    for kind, arg in steps:
        if kind == "dropna":
            df = df.dropna(subset=[c for c in df.columns if c != "__file"])
        elif kind == "filter":
            col, op, val = arg
            ops = {">": df[col] > val, ">=": df[col] >= val, "<": df[col] < val,
                   "<=": df[col] <= val, "==": df[col] == val, "!=": df[col] != val}
            df = df[ops[op]]
        elif kind == "standardize":
            cols = (df.drop(columns="__file").select_dtypes("number").columns
                    if arg == "numeric" else arg)
            for c in cols:
                mean, std = df[c].mean(), df[c].std()
                stats[c] = (mean, std)
                df[c] = (df[c] - mean) / std
    out = [g.drop(columns="__file").reset_index(drop=True) for _, g in df.groupby("__file")]
    present = set(df["__file"].unique())
    result = []
    k = 0
    for i in range(len(files)):
        if i in present:
            result.append(out[k])
            k += 1
        else:
            result.append(frames[i].drop(columns="__file").iloc[0:0])
    return result, stats


def step_args(steps):
    args = []
    for kind, arg in steps:
        if kind == "dropna":
            args.append("--dropna")
        elif kind == "filter":
            args += ["--filter", f"{arg[0]} {arg[1]} {arg[2]}"]
        else:
            args += ["--standardize", arg if arg == "numeric" else ",".join(arg)]
    return args


def assert_frame_close(got, want, where):
    assert list(got.columns) == list(want.columns), where
    assert len(got) == len(want), f"{where}: {len(got)} rows, pandas has {len(want)}"
    for c in want.columns:
        g, w = got[c], want[c]
        if pd.api.types.is_float_dtype(w):
            assert pd.api.types.is_float_dtype(g), f"{where}: {c} is {g.dtype}, pandas {w.dtype}"
            np.testing.assert_allclose(g.to_numpy(float), w.to_numpy(float), rtol=RTOL,
                                       atol=ATOL, equal_nan=True, err_msg=f"{where}: {c}")
        elif pd.api.types.is_integer_dtype(w):
            assert pd.api.types.is_integer_dtype(g), f"{where}: {c} is {g.dtype}, pandas {w.dtype}"
            np.testing.assert_array_equal(g.to_numpy(), w.to_numpy(), err_msg=f"{where}: {c}")
        else:
            gl = [None if pd.isna(x) else x for x in g]
            wl = [None if pd.isna(x) else x for x in w]
            assert gl == wl, f"{where}: column {c} differs"


def check_against_pandas(src, out, steps, files=None):
    files = files or sorted(p for p in src.iterdir())
    want, stats = pandas_reference(files, steps)
    for i, w in enumerate(want):
        part = out / f"part.{i}.parquet"
        table = pq.read_table(part)
        assert_frame_close(table.to_pandas(), w, f"{part} via pyarrow")
        assert_frame_close(pd.read_parquet(part), w, f"{part} via pandas")
    recorded = json.loads((out / "_stats.json").read_text())
    got = {c["name"]: (c["mean"]["value"], c["std"]["value"]) for c in recorded["columns"]}
    assert set(got) == set(stats)
    for c, (mean, std) in stats.items():
        np.testing.assert_allclose(got[c], (mean, std), rtol=RTOL, err_msg=c)
    return want


SPEC = [
    ("a.csv", 3000, 1, "csv", False),
    ("b.csv", 2500, 2, "csv", True),
    ("c.parquet", 2000, 3, "parquet", False),
    ("d.csv", 1, 4, "csv", False),
]
SEED_STEPS = [("dropna", None), ("filter", ("value", ">", 0.0)), ("standardize", "numeric")]


def test_seed_job_matches_pandas(tmp_path):
    src = write_inputs(tmp_path, SPEC)
    out = tmp_path / "out"
    proc = stagefs(src, out, "--to", "parquet", *step_args(SEED_STEPS))
    assert "rows read" in proc.stderr  # the summary line replaces the bar off a terminal
    want = check_against_pandas(src, out, SEED_STEPS)
    # Integers standardized become float64; text stays text; order of rows kept.
    schema = pq.read_schema(out / "part.0.parquet")
    assert schema.field("count").type == pa.float64()
    assert schema.field("sensor").type == pa.string()
    assert sum(len(w) for w in want) > 3000


def test_columns_selection_and_explicit_standardize(tmp_path):
    src = write_inputs(tmp_path, SPEC[:3])
    out = tmp_path / "out"
    steps = [("standardize", ["temp", "value"]), ("filter", ("value", ">=", -0.5)),
             ("dropna", None)]
    stagefs(src, out, "--to", "parquet", "--columns", "value,temp,label,sensor",
            *step_args(steps), "--compression", "snappy")
    files = sorted(src.iterdir())
    frames = [read_input(f)[["value", "temp", "label", "sensor"]] for f in files]
    tmp_src = tmp_path / "projected"
    tmp_src.mkdir()
    for f, df in zip(files, frames):
        df.to_parquet(tmp_src / (f.stem + ".parquet"), index=False)
    check_against_pandas(tmp_src, out, steps, files=sorted(tmp_src.iterdir()))
    assert pq.read_schema(out / "part.0.parquet").field("label").type == pa.int64()
    assert pq.ParquetFile(out / "part.0.parquet").metadata.row_group(0).column(0).compression \
        == "SNAPPY"


def test_step_order_matters(tmp_path):
    src = write_inputs(tmp_path, SPEC[:2])
    results = []
    for name, steps in [
        ("before", [("dropna", None), ("filter", ("value", ">", 0.0)),
                    ("standardize", ["value", "temp"])]),
        ("after", [("standardize", ["value", "temp"]), ("filter", ("value", ">", 0.0)),
                   ("dropna", None)]),
    ]:
        out = tmp_path / name
        stagefs(src, out, "--to", "parquet", *step_args(steps))
        check_against_pandas(src, out, steps)
        results.append(json.loads((out / "_stats.json").read_text()))
    means = [{c["name"]: c["mean"]["value"] for c in r["columns"]} for r in results]
    assert abs(means[0]["value"] - means[1]["value"]) > 0.1, means


def test_sharded_array_equals_single_node(tmp_path):
    spec = [(f"f{i}.csv", 800 + 300 * i, 10 + i, "csv", i == 2) for i in range(5)]
    spec.append(("g.parquet", 1500, 30, "parquet", False))
    src = write_inputs(tmp_path, spec)
    single, array = tmp_path / "single", tmp_path / "array"
    args = ["--to", "parquet", *step_args(SEED_STEPS)]
    stagefs(src, single, *args)
    # Transform before stats exist is refused, naming the missing step.
    early = stagefs(src, array, *args, "--shard", "0/3", check=False)
    assert early.returncode != 0 and "--merge-stats" in early.stderr
    for i in range(3):
        stagefs(src, array, *args, "--stats-only", "--shard", f"{i}/3")
        assert (array / f"_stats.shard-{i}.json").exists()
    stagefs(src, array, *args, "--merge-stats")
    for i in range(3):
        stagefs(src, array, *args, "--shard", f"{i}/3")
    a = json.loads((single / "_stats.json").read_text())
    b = json.loads((array / "_stats.json").read_text())
    for ca, cb in zip(a["columns"], b["columns"]):
        assert ca["name"] == cb["name"]
        np.testing.assert_allclose(cb["mean"]["value"], ca["mean"]["value"], rtol=RTOL)
        np.testing.assert_allclose(cb["std"]["value"], ca["std"]["value"], rtol=RTOL)
    for i in range(len(spec)):
        ta = pd.read_parquet(single / f"part.{i}.parquet")
        tb = pd.read_parquet(array / f"part.{i}.parquet")
        assert_frame_close(tb, ta, f"part.{i}")
    check_against_pandas(src, array, SEED_STEPS)


def test_merge_refuses_missing_shard_and_other_plan(tmp_path):
    src = write_inputs(tmp_path, SPEC[:3])
    out = tmp_path / "out"
    args = ["--to", "parquet", *step_args(SEED_STEPS)]
    stagefs(src, out, *args, "--stats-only", "--shard", "0/2")
    missing = stagefs(src, out, *args, "--merge-stats", check=False)
    assert missing.returncode != 0 and "_stats.shard-1.json is missing" in missing.stderr
    stagefs(src, out, *args, "--stats-only", "--shard", "1/2")
    other = stagefs(src, out, "--to", "parquet", "--standardize", "numeric", "--merge-stats",
                    check=False)
    assert other.returncode != 0 and "plan" in other.stderr


def test_many_units_and_quoted_newlines(tmp_path):
    # ~4 MB with a small budget: several units per file, cut between quoted multi-line fields.
    src = write_inputs(tmp_path, [("big.csv", 40000, 7, "csv", True),
                                  ("big2.parquet", 30000, 8, "parquet", False)])
    out = tmp_path / "out"
    stagefs(src, out, "--to", "parquet", *step_args(SEED_STEPS), "--memory-budget", "64M",
            "-j", "2")
    check_against_pandas(src, out, SEED_STEPS)
    # Many small units are gathered into reader-sized row groups: one here (< 128 Ki rows).
    assert pq.ParquetFile(out / "part.0.parquet").metadata.num_row_groups == 1


def test_no_standardize_is_one_pass_and_uncompressed(tmp_path):
    src = write_inputs(tmp_path, SPEC[:2])
    out = tmp_path / "out"
    steps = [("filter", ("temp", "<", 22.5)), ("filter", ("count", "!=", 0)), ("dropna", None)]
    proc = stagefs(src, out, "--to", "parquet", *step_args(steps), "--compression", "none")
    assert "1 pass)" in proc.stderr
    check_against_pandas(src, out, steps)


def test_nan_filter_semantics(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "n.csv").write_text("x,y\n1.5,1\n,2\nnan,3\n-2,4\n0,5\n")
    for expr, keep in [("x > 0", [1]), ("x != 0", [1, 2, 3, 4]), ("x == 0", [5]),
                       ("x <= 0", [4, 5])]:
        out = tmp_path / f"o{len(keep)}{expr[2]}"
        stagefs(src, out, "--to", "parquet", "--filter", expr)
        got = pd.read_parquet(out / "part.0.parquet")["y"].tolist()
        assert got == keep, (expr, got)


def test_usage_errors_before_any_work(tmp_path):
    src = write_inputs(tmp_path, SPEC[:2])
    out = tmp_path / "out"
    cases = [
        (["--filter", "nope > 1"], "no column 'nope'"),
        (["--filter", "sensor > 1"], "not numeric"),
        (["--standardize", "temp,sensor"], "not numeric"),
        (["--filter", "value >> 1"], "--filter"),
        (["--columns", "temp,zzz"], "no column 'zzz'"),
        (["--compression", "lz9"], "zstd, snappy or none"),
        (["--shard", "3/3"], "--shard"),
    ]
    for extra, message in cases:
        proc = stagefs(src, out, "--to", "parquet", *extra, check=False)
        assert proc.returncode == 2, (extra, proc.returncode, proc.stderr)
        assert message in proc.stderr, (extra, proc.stderr)
        assert not list(out.glob("part.*")) if out.exists() else True


def test_malformed_csv_names_file_and_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = 21000  # the type error lies past the 20000 rows used to infer column types
    lines = ["a,b,c"] + [f"{i},{i * 0.5},t{i}" for i in range(1, rows)]
    lines[17] = "17,8.5"  # too few fields, on physical line 18
    lines[20500] = "20500,oops,t25"  # not a number in a float column, line 20501
    (src / "bad.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    proc = stagefs(src, out, "--to", "parquet", "--dropna", check=False)
    assert proc.returncode == 1
    assert "bad.csv: line 18: expected 3 fields, found 2" in proc.stderr, proc.stderr
    assert "--bad-rows skip" in proc.stderr
    assert not (out / "part.0.parquet").exists()
    assert not list(out.glob(".*tmp"))
    proc = stagefs(src, out, "--to", "parquet", "--dropna", "--bad-rows", "skip")
    assert "2 malformed rows skipped" in proc.stderr, proc.stderr
    assert "bad.csv: line 20501: column 'b': 'oops' is not Float64" in proc.stderr, proc.stderr
    got = pd.read_parquet(out / "part.0.parquet")
    want = pd.read_csv(src / "bad.csv", on_bad_lines="skip")
    # pandas pads short rows with NaN (then dropped by dropna); stagefs drops them as malformed.
    want["b"] = pd.to_numeric(want["b"], errors="coerce")
    want = want.dropna().reset_index(drop=True)
    assert got["a"].tolist() == want["a"].tolist()
    assert len(got) == rows - 3
    np.testing.assert_array_equal(got["b"].to_numpy(), want["b"].to_numpy())


def test_globs_and_mixed_inputs(tmp_path):
    src = write_inputs(tmp_path, SPEC[:3])
    out = tmp_path / "out"
    # A quoted glob (expanded by stagefs) plus an explicit Parquet file.
    stagefs(f"{src}/*.csv", src / "c.parquet", out, "--to", "parquet", *step_args(SEED_STEPS))
    check_against_pandas(src, out, SEED_STEPS)


def big_inputs(tmp, rows=300_000):
    """~20 MB of CSV (quoted multi-line fields) plus a Parquet file with several row groups."""
    return write_inputs(tmp, [("big.csv", rows, 21, "csv", True),
                              ("big2.parquet", rows // 2, 22, "parquet", False)])


def test_spilled_pass_matches_pandas(tmp_path):
    # A 64 MiB budget keeps ~19 MiB of pass-1 rows in memory: the rest spill to scratch as
    # Arrow IPC and pass 2 reads them back instead of parsing the CSV again.
    src = big_inputs(tmp_path, rows=700_000)
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch))
    proc = subprocess.run([BIN, "convert", src, out, "--to", "parquet", *step_args(SEED_STEPS),
                           "--memory-budget", "64M", "-j", "2"], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "spilled to scratch" in proc.stderr, proc.stderr
    check_against_pandas(src, out, SEED_STEPS)
    assert list(scratch.iterdir()) == [], "the spill directory is removed after the run"


def test_parallel_parquet_input_matches_pandas(tmp_path):
    # Parquet row groups decode in parallel (and big ones in slices); order must be kept.
    src = tmp_path / "src"
    src.mkdir()
    df = sensor_frame(200_000, 31)
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), src / "p.parquet",
                   row_group_size=7_000)
    out = tmp_path / "out"
    stagefs(src, out, "--to", "parquet", *step_args(SEED_STEPS), "-j", "2",
            "--memory-budget", "64M")
    check_against_pandas(src, out, SEED_STEPS)


def test_row_groups_sized_for_readers(tmp_path):
    src = big_inputs(tmp_path)
    out = tmp_path / "out"
    stagefs(src, out, "--to", "parquet", "--dropna", "--memory-budget", "64M")
    for part in sorted(out.glob("part.*.parquet")):
        md = pq.ParquetFile(part).metadata
        sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        assert all(128 * 1024 <= n <= 1 << 20 for n in sizes[:-1]), (part, sizes)
        assert sum(sizes) == md.num_rows


def test_duplicate_csv_columns_renamed_as_pandas(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "d.csv").write_text("a,a,b,a.1,,x\n1,2,3,4,5,6\n7,,9,10,11,12\n")
    out = tmp_path / "out"
    stagefs(src, out, "--to", "parquet")
    got = pq.read_table(out / "part.0.parquet")  # pyarrow refuses duplicate names
    want = pd.read_csv(src / "d.csv")
    assert got.column_names == list(want.columns) == ["a", "a.2", "b", "a.1", "Unnamed: 4", "x"]
    assert_frame_close(got.to_pandas(), want, "duplicate names")
    # Filters and standardize name the renamed columns.
    out2 = tmp_path / "out2"
    stagefs(src, out2, "--to", "parquet", "--filter", "a.2 > 0", "--standardize", "a,b")
    assert pq.read_table(out2 / "part.0.parquet").num_rows == 1


def test_filter_on_column_names_with_operators_and_spaces(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(3)
    df = pd.DataFrame({"a>b": rng.normal(size=500), "temp (C)": rng.normal(size=500),
                       'say "x"': rng.integers(0, 5, 500)})
    df.to_csv(src / "o.csv", index=False)
    out = tmp_path / "out"
    stagefs(src, out, "--to", "parquet", "--filter", '"a>b" > 0', "--filter",
            "`temp (C)` <= 0.5", "--filter", '"say ""x""" != 2')
    got = pd.read_parquet(out / "part.0.parquet")
    want = df[(df["a>b"] > 0) & (df["temp (C)"] <= 0.5) & (df['say "x"'] != 2)]
    assert_frame_close(got, want.reset_index(drop=True), "quoted filter columns")
    bad = stagefs(src, tmp_path / "bad", "--to", "parquet", "--filter", "a>b > 0", check=False)
    assert bad.returncode == 2
    assert "if the column's name is 'a>b', quote it" in bad.stderr, bad.stderr
    missing = stagefs(src, tmp_path / "bad", "--to", "parquet", "--filter", '"a > b" > 0',
                      check=False)
    assert missing.returncode == 2 and "no column 'a > b'" in missing.stderr, missing.stderr


def test_two_concurrent_runs_into_one_out_never_clobber(tmp_path):
    src = big_inputs(tmp_path, rows=120_000)
    out = tmp_path / "out"
    cmd = [BIN, "convert", src, out, "--to", "parquet", *step_args(SEED_STEPS), "-j", "1"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err
    check_against_pandas(src, out, SEED_STEPS)
    leftovers = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers


def peak_rss_mib(cmd):
    """Runs cmd in a fresh Python, returns (returncode, stderr, peak RSS of cmd in MiB)."""
    probe = ("import resource, subprocess, sys, json\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
             "print(json.dumps([p.returncode, p.stderr, r]))\n")
    out = subprocess.run([sys.executable, "-c", probe, *map(str, cmd)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def test_stray_quote_on_line_2_fails_with_bounded_memory(tmp_path):
    # The audit's case: a quote opened on line 2 of a large CSV turned the rest of the file
    # into one record and the chunk grew to 1.9 GB under --memory-budget 64M.
    src = tmp_path / "src"
    src.mkdir()
    block = "".join(f"{i},{i * 0.25},t{i}\n" for i in range(100_000)).encode()
    with open(src / "q.csv", "wb") as f:
        f.write(b"a,b,c\n1,\"oops,x\n")
        while f.tell() < 96 << 20:
            f.write(block)
    code, err, rss = peak_rss_mib([BIN, "convert", src, tmp_path / "out", "--to", "parquet",
                                   "--dropna", "--memory-budget", "64M"])
    assert code == 1, err
    assert "q.csv: line 2: a record starts here that does not end within 8.0 MiB" in err, err
    assert rss < 100, f"peak RSS {rss:.0f} MiB for a 64 MiB budget"
