"""Three `os.walk` + `os.stat` listings of a stagefs mount (the first right after the mount), with
the daemon's CPU per thread.

    stagefs run [--mount-arg=--no-staging] --mount SRC:MNT:CACHE -- python3 walk_threads.py MNT

Prints per listing: seconds, files, the daemon's CPU seconds by thread name (from
/proc/PID/task, over 5 ms) and the stats counters that moved. Tells metadata work (the `fuser-*`
threads) from background work (fetch workers staging) when a listing is slower than local.
"""
import json
import os
import sys
import time

MNT = sys.argv[1]
TICK = os.sysconf("SC_CLK_TCK")


def stats():
    """The mount's stats file, parsed."""
    with open(os.path.join(MNT, ".stagefs", "stats")) as f:
        return json.load(f)


def thread_cpu(pid):
    """{thread id: (name, user + system CPU seconds)} of process `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                line = f.read()
        except OSError:
            continue  # the thread ended between the listing and the read
        name = line[line.index("(") + 1 : line.rindex(")")]
        fields = line.rsplit(")", 1)[1].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def listing():
    """One walk + stat of every file; the number of files."""
    n = 0
    for d, _, names in os.walk(MNT):
        if ".stagefs" in d:
            continue
        for x in names:
            os.stat(os.path.join(d, x))
            n += 1
    return n


pid = stats()["pid"]
time.sleep(3)  # the mount's own start-up work out of the first listing
for k in range(3):
    cpu0, s0, t = thread_cpu(pid), stats(), time.monotonic()
    n = listing()
    dt = time.monotonic() - t
    cpu1, s1 = thread_cpu(pid), stats()
    per_name = {}
    for tid, (name, c) in cpu1.items():
        used = c - cpu0.get(tid, (name, 0))[1]
        if used > 0.005:
            per_name[name] = round(per_name.get(name, 0) + used, 2)
    moved = {
        key: s1[key] - s0.get(key, 0)
        for key in s1
        if isinstance(s1[key], int) and key != "pid" and s1[key] != s0.get(key)
    }
    print(k, f"{dt:.2f}s n={n}", per_name, moved, flush=True)
