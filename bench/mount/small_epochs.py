"""Epochs over a folder of small files as a DataLoader reads them, timed from inside the job.

    python3 small_epochs.py ROOT DROP MODE EPOCHS [MNT]

ROOT is an ImageFolder tree (class folders of files). Before each epoch (a listing's first
only) the page cache is dropped by asking: the script creates DROP and waits until root's loop removes it (a normal
user cannot drop it). MODE:
- `threads`: the file list in a shuffled order (seed = epoch, the same on every side), read by
  8 threads, each taking the next whole file (open, read 1 MiB at a time, close);
- `pool`: the same list read by 8 worker processes of a `multiprocessing` pool (fork), made
  before the drop as a DataLoader's workers are, each opening, reading and closing the files
  it is given, in chunks of 16 (what a DataLoader's index batches do);
- `walk`: `os.walk` of ROOT with an `os.stat` of every file (torchvision's ImageFolder lists
  the same way; `make_dataset` stats through `is_file`), nothing read;
- `imagefolder`: `torchvision.datasets.ImageFolder(ROOT)` with `RandomResizedCrop(224)` and
  `ToTensor`, read by `DataLoader(batch_size=64, shuffle=True, num_workers=8)` (fork): real
  JPEGs decoded by PIL in 8 worker processes, as the seed's training job does (needs torch and
  torchvision).
Prints one JSON object: per epoch its seconds, CPU seconds of this process and its reaped
children, and, given MNT (the mount), the daemon's CPU seconds and the change in its direct
counters; and the bytes of one epoch.
"""

import json
import multiprocessing as mp
import os
import random
import sys
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")
KEYS = ("direct_opens", "direct_refused", "bytes_direct")
WORKERS = 8


def listing(root):
    files = []
    for d, _, names in os.walk(root):
        files.extend(os.path.join(d, n) for n in names)
    files.sort()
    return files


def read(path):
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                return n
            n += len(b)


def read_many(paths):
    return sum(read(p) for p in paths)


def stats(mnt):
    if not mnt:
        return {}
    with open(os.path.join(mnt, ".stagefs", "stats")) as f:
        return json.load(f)


def daemon_cpu(pid):
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def drop_caches(drop):
    open(drop, "w").close()
    while os.path.exists(drop):
        time.sleep(0.02)


def epoch(root, drop, mode, k, mnt):
    files = listing(root) if mode in ("threads", "pool") else []
    random.Random(k).shuffle(files)
    pool = mp.get_context("fork").Pool(WORKERS) if mode == "pool" else None
    # A listing's later epochs are warm (the kernel's dentries and attributes kept), its first
    # cold: the page cache dropped, as before every reading epoch.
    drop_now = mode != "walk" or k == 0
    if mode == "imagefolder":
        import torch
        import torchvision
        from torchvision import transforms as T

        ds = torchvision.datasets.ImageFolder(
            root, T.Compose([T.RandomResizedCrop(224), T.ToTensor()]))
        dl = torch.utils.data.DataLoader(
            ds, batch_size=64, shuffle=True, num_workers=WORKERS,
            generator=torch.Generator().manual_seed(k))
        image_bytes = sum(os.path.getsize(p) for p, _ in ds.samples)
    if drop_now:
        drop_caches(drop)
    st = stats(mnt)
    pid = st.get("pid")
    d0, c0, t = daemon_cpu(pid), cpu(), time.monotonic()
    total = 0
    if mode == "threads":
        it = iter(files)
        lock = threading.Lock()
        counts = []

        def worker():
            n = 0
            while True:
                with lock:
                    p = next(it, None)
                if p is None:
                    break
                n += read(p)
            counts.append(n)

        threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        total = sum(counts)
    elif mode == "pool":
        chunks = [files[i : i + 16] for i in range(0, len(files), 16)]
        total = sum(pool.imap_unordered(read_many, chunks))
        pool.close()
        pool.join()
    elif mode == "imagefolder":
        n = 0
        for _, labels in dl:
            n += len(labels)
        assert n == len(ds), (n, len(ds))
        del dl
        total = image_bytes
    elif mode == "walk":
        n = 0
        for d, _, names in os.walk(root):
            for name in names:
                os.stat(os.path.join(d, name))
                n += 1
        total = n
    else:
        raise SystemExit(f"unknown mode {mode}")
    secs = time.monotonic() - t
    c1, d1 = cpu(), daemon_cpu(pid)
    out = {"secs": secs, "cpu": c1 - c0, "daemon_cpu": d1 - d0, "amount": total}
    if mnt:
        # A rendering of the stats file is served for up to 1 s: wait for one made after the
        # epoch, or its opens are counted in the next epoch's.
        time.sleep(1.1)
        st1 = stats(mnt)
        out.update({k: st1.get(k, 0) - st.get(k, 0) for k in KEYS})
    return out


def main():
    root, drop, mode, epochs = sys.argv[1:5]
    mnt = sys.argv[5] if len(sys.argv) > 5 else None
    res = [epoch(root, drop, mode, k, mnt) for k in range(int(epochs))]
    print(json.dumps({"epochs": res, "mode": mode}))


if __name__ == "__main__":
    main()
