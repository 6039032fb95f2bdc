"""bench/pipeline/ keeps working: gen.py writes an ImageFolder of real JPEGs and tensors, run.py
measures each contender and writes its table and plot. A smoke run at toy scale (24 files,
batches of 8, a 1 ms step); nothing here is timed or compared — the figures are the
benchmark's business (docs/benchmarks.md), not the tests'.
"""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import fuse_missing  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("STAGEFS_BIN", os.path.join(ROOT, "target", "debug", "stagefs"))
GEN = os.path.join(ROOT, "bench", "pipeline", "gen.py")
RUN = os.path.join(ROOT, "bench", "pipeline", "run.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    pytest.importorskip("torchvision")
    d = tmp_path_factory.mktemp("pipeline") / "data"
    subprocess.run([sys.executable, GEN, str(d), "--n", "24", "--classes", "3", "--tensors", "4"],
                   check=True, capture_output=True, timeout=300)
    return d


def test_gen_writes_class_folders_of_real_jpegs_and_tensors(data):
    import numpy as np
    from PIL import Image

    classes = sorted(os.listdir(data / "train"))
    assert classes == ["class000", "class001", "class002"]
    files = [data / "train" / c / f for c in classes for f in os.listdir(data / "train" / c)]
    assert len(files) == 24
    sizes = set()
    for f in files:
        with Image.open(f) as im:
            assert im.format == "JPEG"
            sizes.add(im.size)
            px = np.asarray(im.convert("RGB"), dtype=np.float32)
        assert px.std() > 20, f"{f} is nearly flat"  # gradients, shapes and noise, not one colour
    assert (500, 375) in sizes
    assert sorted(os.listdir(data / "tensors"))[:2] == ["t00000.npy", "t00000.pt"]
    assert np.load(data / "tensors" / "t00000.npy").shape == (3, 256, 256)
    # Deterministic: a second run over an emptied folder writes the same bytes.
    again = data.parent / "again"
    subprocess.run([sys.executable, GEN, str(again), "--n", "24", "--classes", "3", "--tensors", "0"],
                   check=True, capture_output=True, timeout=300)
    assert (again / "train" / "class001" / "img_000004.jpg").read_bytes() == \
        (data / "train" / "class001" / "img_000004.jpg").read_bytes()


def run(data, cores, *flags):
    out = data.parent / "out"
    p = subprocess.run([sys.executable, RUN, str(data), "--stagefs", BIN, "--cores", cores,
                        "--rounds", "1", "--images", "16", "--batch-size", "8", "--warmup", "1",
                        "--step-ms", "1", "--out", str(out), *flags],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, (out / "pipeline.md").read_text(), out


def test_run_reports_every_contender_and_plots(data):
    if not os.access(BIN, os.X_OK):
        pytest.skip(f"no stagefs binary at {BIN} (cargo build, or set STAGEFS_BIN)")
    stdout, table, out = run(data, "1,all", "--contenders", "seed,loader,dali")
    cores = len(os.sched_getaffinity(0))
    for who in ("seed", "loader"):
        for n in sorted({1, cores}):
            assert f"| {who} | {n} |" in table, table
    assert "| dali | – | skipped: needs a GPU" in table or "| dali | 1 |" in table, table
    assert "`.pt` (torch.load) | local" in table and "`.npy` (np.load) | local" in table
    assert "load average before" in table
    png = (out / "pipeline.png").read_bytes()
    assert png.startswith(b"\x89PNG"), "the plot is a PNG"


def test_run_over_a_mount_under_stagefs_run(data):
    why = fuse_missing()
    if why:
        pytest.skip(f"skipped: needs FUSE: {why}")
    if not os.access(BIN, os.X_OK):
        pytest.skip(f"no stagefs binary at {BIN} (cargo build, or set STAGEFS_BIN)")
    stdout, table, _ = run(data, "1", "--mount", "--contenders", "seed-mount,loader")
    assert "| seed-mount | 1 |" in table and "| loader | 1 |" in table, table
    assert "`.npy` (np.load) | mount" in table, table
