"""One epoch of bench/mount/large_reader.py over DIRECTORY in MODE, with the CPU of the stagefs
daemon serving it when MOUNT is given (the mount's stats file names its pid), and the mount's
direct-read counters. Run by bench/mount/direct.sh, inside `stagefs run` for the mount sides.
Mode `rows`: one shuffled epoch of `stagefs.Loader` over DIRECTORY/rows.npy (64 KiB rows,
batches of 64, seed 0: the same order on both sides; needs numpy and stagefs, e.g. the repo's
.venv python). Prints: wall seconds, reader CPU seconds, daemon CPU seconds, direct opens,
bytes_direct.

    python3 direct_epoch.py DIRECTORY MODE [MOUNT]
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def daemon(mount):
    """The daemon's CPU seconds so far and the mount's stats, or (0, {}) without a mount."""
    if not mount:
        return 0.0, {}
    with open(os.path.join(mount, ".stagefs", "stats")) as f:
        stats = json.load(f)
    with open(f"/proc/{stats['pid']}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), stats


def loader_epoch(path):
    """Wall and CPU seconds of one shuffled Loader epoch over `path`: the Loader is made (on a
    mount, its direct open verifies a remount's copy through the page cache), then the page
    cache is dropped (asked of direct.sh's root loop through the file $STAGEFS_BENCH_DROP, when
    set), then the epoch is timed: a warm epoch of a job, caches dropped."""
    import time

    import stagefs

    loader = stagefs.Loader([path], 64, shuffle=True, seed=0, tensors="numpy")
    drop = os.environ.get("STAGEFS_BENCH_DROP")
    if drop:
        open(drop, "w").close()
        while os.path.exists(drop):
            time.sleep(0.02)
    t0, c0 = time.perf_counter(), os.times()
    rows = 0
    for (batch,) in loader:
        rows += len(batch)
    c1 = os.times()
    assert rows == loader.rows, (rows, loader.rows)
    return [f"{time.perf_counter() - t0:.3f}", f"{c1.user - c0.user + c1.system - c0.system:.3f}"]


def main():
    directory, mode = sys.argv[1], sys.argv[2]
    mount = sys.argv[3] if len(sys.argv) > 3 else None
    c0, s0 = daemon(mount)
    if mode == "rows":
        out = loader_epoch(os.path.join(directory, "rows.npy"))
    else:
        out = subprocess.run(
            [sys.executable, os.path.join(HERE, "large_reader.py"), directory, mode],
            check=True, capture_output=True, text=True).stdout.split()
    c1, s1 = daemon(mount)
    if mount:
        # A rendering of the stats file is served for up to 1 s: read one made after the epoch
        # (the daemon's CPU is taken above, before this wait).
        import time

        time.sleep(1.1)
        s1 = daemon(mount)[1]
    opens = s1.get("direct_opens", 0) - s0.get("direct_opens", 0)
    direct = s1.get("bytes_direct", 0) - s0.get("bytes_direct", 0)
    print(f"{out[0]} {out[1]} {c1 - c0:.3f} {opens} {direct}")


if __name__ == "__main__":
    main()
