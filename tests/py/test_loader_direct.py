"""stagefs.Loader reads a staged .npy on a mount through a direct descriptor of the cache's
verified copy (docs/direct.md), small files too (a copy of their own): batches equal numpy's
reading of the source, the daemon counts the direct opens, direct=False asks nothing. (A file
that falls back, with its reason in stats(), is tests/direct.rs's Loader test.)"""

import os
import sys
import time

import numpy as np
import pytest

import stagefs

sys.path.insert(0, os.path.dirname(__file__))
import mounting  # noqa: E402
from mounting import fresh_stats, wait_stats  # noqa: E402


@pytest.fixture()
def mounted(tmp_path):
    src, mnt, cache = tmp_path / "src", tmp_path / "mnt", tmp_path / "cache"
    src.mkdir()
    mnt.mkdir()
    rng = np.random.default_rng(5)  # x: 5 MB, above the 4 MiB of a small file
    np.save(src / "x.npy", rng.integers(0, 255, size=(500, 100, 100), dtype=np.uint8))
    np.save(src / "y.npy", np.arange(500, dtype=np.int64))
    with mounting.mounted(src, mnt, cache):
        yield src, mnt


def test_loader_reads_staged_npy_files_direct_small_ones_too(mounted):
    src, mnt = mounted
    paths = [str(mnt / "x.npy"), str(mnt / "y.npy")]
    deadline = time.time() + 60
    while True:
        for p in paths:  # stages them; a refused direct open verifies it
            with open(p, "rb") as f:
                f.read()
        ld = stagefs.Loader(paths, 32, shuffle=True, seed=1, tensors="numpy", ring=3)
        if ld.stats()["direct_files"] == 2:
            break
        assert time.time() < deadline, ld.stats()
        time.sleep(0.1)
    s = ld.stats()
    assert s["direct_fallbacks"] == {}, s
    x, y = np.load(src / "x.npy"), np.load(src / "y.npy")
    rows = 0
    for bx, by in ld:
        np.testing.assert_array_equal(bx, x[by])
        rows += len(by)
    assert rows == 500
    # The stats file a reader without its own open sees is a rendering up to 1 s old (the
    # Loader itself read one to find the mount's socket, before its direct open).
    s = wait_stats(mnt, lambda s: s["direct_opens"] >= 2)
    assert s["direct_opens"] >= 2, s
    del ld
    before = fresh_stats(mnt)["direct_opens"]
    off = stagefs.Loader(paths, 32, tensors="numpy", ring=3, direct=False)
    assert off.stats()["direct_files"] == 0 and off.stats()["direct_fallbacks"] == {}
    assert sum(len(b) for _, b in off) == 500
    assert fresh_stats(mnt)["direct_opens"] == before


def test_stagefs_direct_0_in_the_environment_turns_the_loaders_direct_reads_off(mounted, monkeypatch):
    # `stagefs run --no-direct` sets it for its command: the Loader must not go direct either.
    src, mnt = mounted
    paths = [str(mnt / "x.npy"), str(mnt / "y.npy")]
    with open(mnt / "x.npy", "rb") as f:
        f.read()
    monkeypatch.setenv("STAGEFS_DIRECT", "0")
    ld = stagefs.Loader(paths, 32, tensors="numpy", ring=3)
    assert ld.stats()["direct_files"] == 0 and ld.stats()["direct_fallbacks"] == {}
    assert sum(len(b) for _, b in ld) == 500
