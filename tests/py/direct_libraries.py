"""Run under `stagefs run --mount SRC:MNT:CACHE` by test_direct_libraries.py: each library a
training job uses opens a staged large file of MNT, and the mount's daemon must count a direct
open for it (the preload library handed it the cache's copy), with bytes equal to SRC's.

    python3 direct_libraries.py MNT SRC CHECK...   prints one JSON object: CHECK -> result

A result is "direct" (counted, and exact), or what went wrong. CHECKs: offsets_fork_exec,
numpy, numpy_mmap, tarfile, pil, pyarrow, torch_load, torch_workers_fork, torch_workers_spawn.
"""

import json
import os
import sys
import time

from mounting import fresh_stats  # noqa: E402  (beside this script, on its sys.path)


def wait_staged(mnt, names, timeout=60):
    """Reads each file through the mount until its open is direct (staged and verified)."""
    deadline = time.time() + timeout
    for name in names:
        path = os.path.join(mnt, name)
        while True:
            with open(path, "rb") as f:
                f.read()
                if not os.readlink(f"/proc/self/fd/{f.fileno()}").startswith(mnt):
                    break
            if time.time() > deadline:
                raise TimeoutError(f"{name} never opened direct")
            time.sleep(0.1)


def check_numpy(mnt, src):
    import numpy as np

    a = np.load(os.path.join(mnt, "x.npy"))
    return np.array_equal(a, np.load(os.path.join(src, "x.npy")))


def check_numpy_mmap(mnt, src):
    import numpy as np

    a = np.load(os.path.join(mnt, "x.npy"), mmap_mode="r")
    with open("/proc/self/maps") as f:
        maps = f.read()
    # The mapping is of the cache's copy, not of the mount's file.
    mapped_mount = os.path.join(mnt, "x.npy") in maps
    ok = np.array_equal(a, np.load(os.path.join(src, "x.npy")))
    return ok and not mapped_mount


def check_tarfile(mnt, src):
    import tarfile

    with tarfile.open(os.path.join(mnt, "d.tar")) as t:
        got = t.extractfile("member.bin").read()
    with open(os.path.join(src, "member.bin.orig"), "rb") as f:
        return got == f.read()


def check_pil(mnt, src):
    import numpy as np
    from PIL import Image

    with Image.open(os.path.join(mnt, "img.png")) as im:
        got = np.asarray(im)
    with Image.open(os.path.join(src, "img.png")) as im:
        return np.array_equal(got, np.asarray(im))


def check_pyarrow(mnt, src):
    import pyarrow.parquet as pq

    return pq.read_table(os.path.join(mnt, "t.parquet")).equals(
        pq.read_table(os.path.join(src, "t.parquet")))


def check_torch_load(mnt, src):
    import torch

    return torch.equal(torch.load(os.path.join(mnt, "t.pt")), torch.load(os.path.join(src, "t.pt")))


EXEC_CHILD = """
import os, sys
fd, path, src = int(sys.argv[1]), sys.argv[2], sys.argv[3]
want = open(src, "rb").read()
ok = os.pread(fd, 1 << 20, 12345) == want[12345:12345 + (1 << 20)]
with open(path, "rb") as f:  # the exec'd program's own open goes direct too
    ok = ok and f.read() == want
    ok = ok and not os.readlink(f"/proc/self/fd/{f.fileno()}").startswith(os.path.dirname(path))
print("ok" if ok else "bad")
"""


def check_offsets_fork_exec(mnt, src):
    """One direct descriptor read at random offsets, by a forked child that inherited it, and
    by a program this one execs (which also opens the file itself)."""
    import random
    import subprocess

    path, spath = os.path.join(mnt, "x.npy"), os.path.join(src, "x.npy")
    with open(spath, "rb") as f:
        want = f.read()
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(mnt):
            return False  # not direct
        rng = random.Random(3)
        for _ in range(200):
            off, n = rng.randrange(len(want)), rng.randrange(1, 1 << 20)
            if os.pread(fd, n, off) != want[off:off + n]:
                return False
        pid = os.fork()
        if pid == 0:
            good = all(os.pread(fd, 4096, o) == want[o:o + 4096]
                       for o in range(0, len(want), len(want) // 50))
            os._exit(0 if good else 1)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            return False
        out = subprocess.run([sys.executable, "-c", EXEC_CHILD, str(fd), path, spath],
                             pass_fds=[fd], capture_output=True, text=True)
        return out.stdout.strip() == "ok"
    finally:
        os.close(fd)


class Files:
    """A torch Dataset: item i is the bytes of files[i], read with open()."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], "rb") as f:
            return f.read()


def workers(mnt, src, how):
    import torch.utils.data as tud

    names = ["x.npy", "t.pt", "d.tar", "t.parquet"]
    ds = Files([os.path.join(mnt, n) for n in names])
    dl = tud.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=how)
    got = list(dl)
    want = []
    for n in names:
        with open(os.path.join(src, n), "rb") as f:
            want.append(f.read())
    return got == want


CHECKS = {
    "offsets_fork_exec": check_offsets_fork_exec,
    "numpy": check_numpy,
    "numpy_mmap": check_numpy_mmap,
    "tarfile": check_tarfile,
    "pil": check_pil,
    "pyarrow": check_pyarrow,
    "torch_load": check_torch_load,
    "torch_workers_fork": lambda m, s: workers(m, s, "fork"),
    "torch_workers_spawn": lambda m, s: workers(m, s, "spawn"),
}

if __name__ == "__main__":
    mnt, src, checks = sys.argv[1], sys.argv[2], sys.argv[3:]
    wait_staged(mnt, sorted(n for n in os.listdir(src) if os.path.getsize(os.path.join(src, n)) > 4 << 20))
    out = {}
    for name in checks:
        before = fresh_stats(mnt)["direct_opens"]
        try:
            exact = CHECKS[name](mnt, src)
        except Exception as e:  # noqa: BLE001 - reported per check
            out[name] = f"failed: {e!r}"
            continue
        opened = fresh_stats(mnt)["direct_opens"] - before
        out[name] = "direct" if exact and opened > 0 else f"exact={exact} direct_opens={opened}"
    print(json.dumps(out))
