"""Three epochs (EPOCHS in the environment: that many) over every file under ROOT with 8 threads of 1 MiB reads, the page cache
dropped before each (by asking: creates DROP and waits until root's loop removes it). Prints
JSON: per epoch its seconds, this process's CPU seconds and, given MNT (the mount), the
daemon's CPU seconds and the change in the mount's direct counters."""
import json
import os
import sys
import threading
import time

root, drop = sys.argv[1], sys.argv[2]
mnt = sys.argv[3] if len(sys.argv) > 3 else None
files = sorted(os.path.join(root, f) for f in os.listdir(root))
TICK = os.sysconf("SC_CLK_TCK")
KEYS = ("direct_opens", "direct_refused", "bytes_direct")


def read(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass


def stats() -> dict:
    if not mnt:
        return {}
    with open(os.path.join(mnt, ".stagefs", "stats")) as f:
        return json.load(f)


def daemon_cpu(pid) -> float:
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def epoch() -> dict:
    open(drop, "w").close()
    while os.path.exists(drop):
        time.sleep(0.02)
    st = stats()
    pid = st.get("pid")
    d0, c0, t = daemon_cpu(pid), os.times(), time.monotonic()
    threads = [threading.Thread(target=read, args=(p,)) for p in files]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    secs = time.monotonic() - t
    c1, d1 = os.times(), daemon_cpu(pid)
    if mnt:
        # A rendering of the stats file is served for up to 1 s: wait for one made after the
        # epoch, or its opens are counted in the next epoch's.
        time.sleep(1.1)
    st1 = stats()
    out = {"secs": secs, "cpu": (c1.user - c0.user) + (c1.system - c0.system),
           "daemon_cpu": d1 - d0}
    if st1:
        out.update({k: st1.get(k, 0) - st.get(k, 0) for k in KEYS})
    return out


print(json.dumps({"epochs": [epoch() for _ in range(int(os.environ.get("EPOCHS", "3")))],
                  "bytes": sum(os.path.getsize(p) for p in files)}))
