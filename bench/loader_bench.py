#!/usr/bin/env python3
"""stagefs.Loader(device="cpu") against PyTorch's DataLoader over the same images.npy.

    .venv/bin/python bench/loader_bench.py --size-gb 4 --rounds 3      # the lead's quiet machine
    .venv/bin/python bench/loader_bench.py --size-gb 0.05 --rounds 1   # a check that it runs

Generates DIR/images.npy (uint8 [N, 224, 224, 3], SIZE_GB gigabytes) and labels.npy once, reads
it into the page cache, then alternates epochs of
  A  stagefs.Loader([images, labels], 256, shuffle=True, device="cpu")   (torch tensors)
  B  DataLoader(Dataset over np.load(mmap_mode="r"), batch_size=256, shuffle=True,
     num_workers=4, pin_memory=True)
as A B A B ..., each epoch in a fresh child process so CPU time is counted exactly: the child's
own threads plus its DataLoader worker processes (reaped at the epoch's end), from just before
the first batch to after the last — interpreter start and imports excluded. The consumer only
touches each batch (one byte per row), so the figures are the loaders' own cost. Prints
batches/s and CPU seconds per epoch, each round's load average (`uptime`), and the B/A ratios.
Goal (issue 11): A at >= 1.5x B's batches/s with <= 0.5x its CPU seconds.
Build the package in release mode first for real figures:
    (cd gpu/python && ../../.venv/bin/maturin develop --release)
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROW_SHAPE = (224, 224, 3)


def generate(d, size_gb):
    import numpy as np

    os.makedirs(d, exist_ok=True)
    rows = max(256, int(size_gb * 1e9) // (224 * 224 * 3))
    path = os.path.join(d, "images.npy")
    want = (rows, *ROW_SHAPE)
    try:
        if np.load(path, mmap_mode="r").shape == want:
            return path, os.path.join(d, "labels.npy")
    except (OSError, ValueError):
        pass
    rng = np.random.default_rng(0)
    images = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=want)
    for start in range(0, rows, 1024):
        n = min(1024, rows - start)
        images[start:start + n] = rng.integers(0, 256, size=(n, *ROW_SHAPE), dtype=np.uint8)
    images.flush()
    del images
    np.save(os.path.join(d, "labels.npy"), rng.integers(0, 1000, size=rows).astype(np.int64))
    return path, os.path.join(d, "labels.npy")


def cpu_seconds():
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def one_epoch(kind, images, labels, batch_size, workers, epoch):
    """Runs in the child: one epoch of `kind`; prints a JSON line."""
    import numpy as np
    import torch

    if kind == "stagefs":
        import stagefs

        loader = stagefs.Loader([images, labels], batch_size, shuffle=True, seed=0, device="cpu")
        loader.set_epoch(epoch)
    else:
        class NpyDataset(torch.utils.data.Dataset):
            def __init__(self):
                self.x = np.load(images, mmap_mode="r")
                self.y = np.load(labels, mmap_mode="r")

            def __len__(self):
                return len(self.y)

            def __getitem__(self, i):
                return torch.from_numpy(np.array(self.x[i])), int(self.y[i])

        torch.manual_seed(epoch)
        loader = torch.utils.data.DataLoader(NpyDataset(), batch_size=batch_size, shuffle=True,
                                             num_workers=workers, pin_memory=True)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    batches = rows = 0
    touched = 0
    it = iter(loader)
    for x, y in it:
        touched += int(x[:, 0, 0, 0].sum())  # touch the batch, as a consumer would
        batches += 1
        rows += len(y)
    del it  # DataLoader workers are joined (and so reaped, their CPU time counted) here
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    print(json.dumps({"kind": kind, "batches": batches, "rows": rows, "wall_s": wall, "cpu_s": cpu,
                      "touched": touched}))


def run_child(kind, args, images, labels, epoch):
    cmd = [sys.executable, __file__, "--child", kind, "--images", images, "--labels", labels,
           "--batch-size", str(args.batch_size), "--workers", str(args.workers), "--epoch", str(epoch)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        sys.exit(f"{kind} failed:\n{p.stdout}\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "loader-bench"))
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--images", help=argparse.SUPPRESS)
    p.add_argument("--labels", help=argparse.SUPPRESS)
    p.add_argument("--epoch", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return one_epoch(args.child, args.images, args.labels, args.batch_size, args.workers, args.epoch)

    images, labels = generate(os.path.abspath(args.dir), args.size_gb)
    size = os.path.getsize(images)
    with open(images, "rb") as f:  # into the page cache: both loaders read from memory
        while f.read(64 << 20):
            pass
    print(f"{images}: {size / 1e9:.2f} GB; batch {args.batch_size}, DataLoader workers {args.workers}, "
          f"{os.cpu_count()} CPUs")
    results = {"stagefs": [], "dataloader": []}
    rounds = []
    for r in range(args.rounds):
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        for kind in ("stagefs", "dataloader"):
            res = run_child(kind, args, images, labels, r)
            res["load"] = load
            results[kind].append(res)
            print(f"round {r}  {kind:10s}  {res['batches'] / res['wall_s']:8.2f} batches/s  "
                  f"{res['wall_s']:7.2f} s wall  {res['cpu_s']:7.2f} CPU s   [{load.split('load average:')[-1].strip()}]",
                  flush=True)
        rounds.append(r)
    a, b = results["stagefs"], results["dataloader"]
    bps = lambda rs: [x["batches"] / x["wall_s"] for x in rs]  # noqa: E731
    cpu = lambda rs: [x["cpu_s"] for x in rs]  # noqa: E731
    print()
    print(f"{'':12s} {'batches/s (median)':>20s} {'CPU s/epoch (median)':>22s}")
    print(f"{'A stagefs':12s} {statistics.median(bps(a)):20.2f} {statistics.median(cpu(a)):22.2f}")
    print(f"{'B DataLoader':12s} {statistics.median(bps(b)):20.2f} {statistics.median(cpu(b)):22.2f}")
    ratios_bps = [x / y for x, y in zip(bps(a), bps(b))]
    ratios_cpu = [x / y for x, y in zip(cpu(a), cpu(b))]
    print(f"A/B per round: batches/s {', '.join(f'{x:.2f}x' for x in ratios_bps)};"
          f" CPU s {', '.join(f'{x:.2f}x' for x in ratios_cpu)}")
    print(f"median A/B: {statistics.median(ratios_bps):.2f}x batches/s (goal >= 1.5x), "
          f"{statistics.median(ratios_cpu):.2f}x CPU s (goal <= 0.5x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_bytes": size, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
