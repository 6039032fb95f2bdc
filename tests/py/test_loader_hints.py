"""Read-order hints through a real mount: a shuffled `stagefs.Loader` epoch over a raw `.npy`
and over an `images.npy` view gives exactly the same batches with and without hints, and the
mount's stats show the hints accepted and the bytes hinted. A missing socket is no error."""

import os
import sys
import time

import numpy as np
import pytest

import stagefs

sys.path.insert(0, os.path.dirname(__file__))
from mounting import mounted, stats  # noqa: E402


# Image rows of 48×48×3 = 6912 bytes: over the Loader's SMALL_ROW, read row by row (hinted).
SIZE = 48
# Rows over the Loader's SMALL_ROW (read row by row, so hinted) in a file over 4 MiB (large:
# its blocks are pushed, not whole files).
ROWS, ROW = 1500, 5000
# Enough images that an epoch of batches of 5 outlasts the hint thread's start.
IMAGES = 300


@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    base = tmp_path_factory.mktemp("loader-hints")
    src = base / "src"
    from PIL import Image

    rng = np.random.default_rng(3)
    for i in range(IMAGES):
        d = src / "imgs" / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (40 + i % 30, 50, 3), dtype=np.uint8)).save(d / f"{i:04d}.jpg")
    raw = np.random.default_rng(5).integers(0, 256, size=(ROWS, ROW), dtype=np.uint8)
    np.save(src / "rows.npy", raw)
    mnt, cache = base / "mnt", base / "cache"
    # --no-passthrough: as root, passthrough opens of a verified large file fail with EIO on
    # main too (not the hints' doing; reported). A normal user's mount has no passthrough.
    with mounted(src, mnt, cache, "--image-size", SIZE, "--no-passthrough"):
        yield mnt, cache, raw


def stats_after(mnt, before):
    """The stats once the daemon has applied the hints sent: it applies them in the background,
    so wait (up to 10 s) until the count moved and then held still for 0.3 s."""
    deadline = time.monotonic() + 10
    last, still = None, 0
    while time.monotonic() < deadline:
        s = stats(mnt)
        n = s["hints_accepted"]
        still = still + 1 if n == last else 0
        if n > before["hints_accepted"] and still >= 3:
            break
        last = n
        time.sleep(0.1)
    return s


def epoch(path, hints, batch=64):
    # Through the mount (direct=False): a copy staged meanwhile would be read through a direct
    # descriptor, which takes kernel read-ahead advice instead of hints.
    ld = stagefs.Loader([str(path)], batch, shuffle=True, seed=11, tensors="numpy", ring=3,
                        hints=hints, direct=False)
    return [b[0].copy() for b in ld], ld


def test_shuffled_epoch_of_a_raw_npy_is_the_same_with_hints_and_hints_are_taken(mount):
    mnt, _, raw = mount
    s0 = stats(mnt)
    assert s0["hint_socket"], "the stats name the hint socket"
    # Cold first, with hints: the daemon fetches the hinted blocks.
    hinted, ld = epoch(mnt / "rows.npy", hints=True)
    s1 = stats_after(mnt, s0)
    plain, _ = epoch(mnt / "rows.npy", hints=False)
    assert s1["hints_accepted"] > s0["hints_accepted"], s1
    assert s1["hint_bytes"] - s0["hint_bytes"] >= ROWS * ROW // 2, s1
    assert s1["hints_rejected"] == 0, s1["errors"]
    s2 = stats(mnt)
    assert s2["hints_accepted"] == s1["hints_accepted"], "hints=False sends nothing"
    assert len(hinted) == len(plain) == -(-ROWS // 64)
    for a, b in zip(hinted, plain):
        np.testing.assert_array_equal(a, b)
    # Exactly the rows of the permutation, in its order.
    np.testing.assert_array_equal(np.concatenate(hinted), raw[np.asarray(ld.order(0))])


def test_shuffled_epoch_of_a_view_is_the_same_with_hints_and_renders_ahead(mount):
    mnt, _, _ = mount
    view = mnt / ".npy" / "imgs" / "images.npy"
    s0 = stats(mnt)
    hinted, _ = epoch(view, hints=True, batch=5)
    s1 = stats_after(mnt, s0)
    plain, _ = epoch(view, hints=False, batch=5)
    assert s1["hints_accepted"] > s0["hints_accepted"], s1
    assert s1["hint_bytes"] > s0["hint_bytes"]
    assert s1["views_rendered"] > s0["views_rendered"]
    # Rendered rows pushed into the page cache (nothing else pushes during a view epoch).
    assert s1["bytes_pushed"] > s0["bytes_pushed"], (s0["bytes_pushed"], s1["bytes_pushed"])
    assert s1["hints_rejected"] == 0, s1["errors"]
    assert len(hinted) == len(plain) > 1
    for a, b in zip(hinted, plain):
        np.testing.assert_array_equal(a, b)
    images = np.load(view)
    assert sorted(map(bytes, np.concatenate(hinted))) == sorted(map(bytes, images))


def test_a_missing_socket_means_no_hints_and_no_error(mount):
    mnt, cache, raw = mount
    sock = cache / "hints.sock"
    assert sock.exists()
    os.rename(sock, cache / "hints.sock.away")
    try:
        s0 = stats(mnt)
        got, _ = epoch(mnt / "rows.npy", hints=True)
        assert stats(mnt)["hints_accepted"] == s0["hints_accepted"]
        assert sorted(map(bytes, np.concatenate(got))) == sorted(map(bytes, raw))
    finally:
        os.rename(cache / "hints.sock.away", sock)
