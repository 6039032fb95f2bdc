"""What the Python tests that mount stagefs share: the binary, a CLI runner, a mount as a
context manager, and reads of the stats file — as it is now, freshly rendered, or once a
condition holds. A reader that keeps the stats file open (or reads it piece by piece) is served
one rendering for up to 1 s (docs/mount.md), so a test that wants what just happened asks
for a fresh one instead of sleeping on its own."""

import contextlib
import json
import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("STAGEFS_BIN", os.path.join(ROOT, "target", "debug", "stagefs"))
FRESH_S = 1.1  # past the 1 s a rendering may be served for


def stagefs_cli(*args):
    """Runs `stagefs ARGS...`; fails the test with its output unless it exits 0."""
    p = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"stagefs {args} exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


@contextlib.contextmanager
def mounted(src, mnt, cache, *flags):
    """`stagefs mount SRC MNT --cache CACHE FLAGS...` (MNT created), unmounted on exit."""
    os.makedirs(mnt, exist_ok=True)
    stagefs_cli("mount", src, mnt, "--cache", cache, *flags)
    try:
        yield
    finally:
        stagefs_cli("umount", mnt)


def stats(mnt):
    """The mount's stats file, as served now."""
    with open(os.path.join(mnt, ".stagefs", "stats")) as f:
        return json.load(f)


def fresh_stats(mnt):
    """The stats file rendered after this call: everything done before it is counted."""
    time.sleep(FRESH_S)
    return stats(mnt)


def wait_stats(mnt, ok, timeout=5.0):
    """The stats once `ok(stats)` holds (polled every 0.1 s), or the last ones after
    `timeout` seconds (the caller's assertion then says what is missing)."""
    deadline = time.monotonic() + timeout
    s = stats(mnt)
    while not ok(s) and time.monotonic() < deadline:
        time.sleep(0.1)
        s = stats(mnt)
    return s
