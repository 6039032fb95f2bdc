"""`stagefs stream` on .npy files written by numpy itself: every dtype and shape numpy writes in
format 1.0 streams with matching checksums; what the streamer cannot read is refused clearly."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STAGEFS_BIN", str(ROOT / "target" / "debug" / "stagefs"))


def stream(*args):
    return subprocess.run([BIN, "stream", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_numpy_files_of_many_dtypes_stream_and_verify(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "f16.npy": rng.standard_normal((77, 5)).astype(np.float16),
        "f32.npy": rng.standard_normal((1000, 3)).astype(np.float32),
        "f64.npy": rng.standard_normal(513),
        "i64.npy": rng.integers(-(2**40), 2**40, size=(90, 2, 2)),
        "u8.npy": rng.integers(0, 256, size=(20, 8, 8, 3), dtype=np.uint8),
        "bool.npy": rng.random((41, 6)) > 0.5,
        "i16.npy": rng.integers(-300, 300, size=(3,), dtype=np.int16),
    }
    for name, arr in arrays.items():
        np.save(tmp_path / name, arr)
    files = [tmp_path / n for n in arrays]
    out = stream(*files, "--device", "cpu", "--batch-rows", 7, "--shuffle", "--seed", 3, "--epochs", 2,
                 "--verify", "--json", "--ring", 4, "--readers", 3)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["bytes"] == 2 * sum(a.nbytes for a in arrays.values())
    assert r["batches"] == 2 * sum(-(-a.shape[0] // 7) for a in arrays.values())
    assert r["verify_mismatches"] == []
    assert r["verified_batches"] >= 1


def test_what_the_streamer_cannot_read_is_refused_with_the_reason(tmp_path):
    np.save(tmp_path / "fortran.npy", np.asfortranarray(np.ones((4, 3), dtype=np.float32)))
    np.save(tmp_path / "big_endian.npy", np.ones(5, dtype=">f4"))
    np.save(tmp_path / "objects.npy", np.array(["a", None], dtype=object), allow_pickle=True)
    for name, reason in [("fortran.npy", "Fortran"), ("big_endian.npy", ">f4"), ("objects.npy", "dtype")]:
        out = stream(tmp_path / name, "--device", "cpu")
        assert out.returncode == 1, out.stdout
        assert name in out.stderr and reason in out.stderr, out.stderr


@pytest.mark.parametrize("rows", [0, 1])
def test_tiny_arrays(tmp_path, rows):
    np.save(tmp_path / "t.npy", np.arange(rows, dtype=np.int32))
    out = stream(tmp_path / "t.npy", "--device", "cpu", "--json", "--verify")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["batches"] == rows
