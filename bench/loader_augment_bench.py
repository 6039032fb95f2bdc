"""Training input with augmentation, on CPU, through the same mount: stagefs.Loader over the view
with RandomResizedCrop + flip + normalize (done by its Rust reader threads) against the seed's
pipeline, torchvision's ImageFolder + RandomResizedCrop + RandomHorizontalFlip + ToTensor +
Normalize in DataLoader(num_workers=2, pin_memory=True, persistent_workers=True).

    python bench/loader_augment_bench.py [--n 2000] [--crop 224] [--view-size 256] [--rounds 3]

Generates photo-like JPEGs once (bench_images.make_photos, 300-500 px mostly) into --dir as an
ImageFolder of 4 classes. Each round and contender (alternated: A B A B ...) gets a fresh mount
(`stagefs mount SRC MNT --cache FRESH --image-size VIEW`) and a fresh process that runs two
epochs: epoch 1 renders the views (the Loader) or reads the JPEGs into the cache (DataLoader),
epoch 2 reads what the mount kept. Per epoch: images/s and CPU seconds of the training process,
its worker processes and the mount process (from /proc, user + system). Prints the medians, the
ratios (goal: epoch 2 >= 5x the DataLoader's images/s at <= 0.3x its CPU seconds) and the load
average before and after (figures taken while other work runs are not worth quoting).

Needs: numpy, pillow, torch, torchvision, the stagefs package (release build for figures:
`maturin develop --release -m gpu/python/Cargo.toml`) and the binary (`cargo build --release`).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLASSES = 4
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """User + system CPU seconds of a live process (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def children(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(p))
            except (OSError, ValueError, IndexError):
                pass
    return out


def cpu_snapshot(mount_pid):
    """CPU seconds per process: this one, its children (DataLoader workers) and the mount."""
    pids = [os.getpid(), mount_pid] + children(os.getpid())
    return {p: cpu_seconds(p) for p in pids}


def cpu_delta(before, after):
    return sum(after[p] - before.get(p, 0.0) for p in after)


def child(args):
    """Two epochs of one contender; prints one JSON line per epoch."""
    import torch

    if args.child == "stagefs":
        import stagefs

        view = os.path.join(args.mnt, ".npy", "train")
        loader = stagefs.Loader(
            [f"{view}/images.npy", f"{view}/labels.npy"], args.batch_size, shuffle=True, seed=0,
            transform=stagefs.RandomResizedCrop(args.crop, flip=True),
            normalize=(stagefs.IMAGENET_MEAN, stagefs.IMAGENET_STD), layout="NCHW",
            readers=args.readers, ring=args.readers + 2)
    else:
        import torchvision
        from torchvision import transforms as T

        ds = torchvision.datasets.ImageFolder(os.path.join(args.mnt, "train"), T.Compose([
            T.RandomResizedCrop(args.crop), T.RandomHorizontalFlip(), T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]))
        loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=2,
                                             pin_memory=True, persistent_workers=True)
    for epoch in (1, 2):
        before, start, n = cpu_snapshot(args.mount_pid), time.perf_counter(), 0
        for images, labels in loader:
            n += images.shape[0]
            assert images.shape[1:] == (3, args.crop, args.crop), images.shape
        seconds = time.perf_counter() - start
        cpu = cpu_delta(before, cpu_snapshot(args.mount_pid))
        print(json.dumps({"epoch": epoch, "images": n, "seconds": seconds, "cpu": cpu}), flush=True)


def make_folder(src, n):
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(ROOT, "tests", "py"))
    import bench_images

    for c in range(CLASSES):
        bench_images.make_photos(os.path.join(src, "train", f"class{c}"), n // CLASSES)


def mount_pid(mnt):
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"mount" in argv and os.fsencode(mnt) in argv:
                return int(p)
    raise SystemExit(f"no mount process found for {mnt}")


def uptime():
    return open("/proc/loadavg").read().split()[:3]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000, help="images")
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--view-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "stagefs-augment-bench"))
    p.add_argument("--stagefs", default=os.path.join(ROOT, "target", "release", "stagefs"))
    p.add_argument("--child", choices=["stagefs", "dataloader"], help=argparse.SUPPRESS)
    p.add_argument("--mnt", help=argparse.SUPPRESS)
    p.add_argument("--mount-pid", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    src = os.path.join(args.dir, "src")
    make_folder(src, args.n)
    load_before = uptime()
    results = {"stagefs": [], "dataloader": []}
    for r in range(args.rounds):
        for who in results:
            work = tempfile.mkdtemp(prefix="round-", dir=args.dir)
            mnt, cache = os.path.join(work, "mnt"), os.path.join(work, "cache")
            os.mkdir(mnt)
            subprocess.run([args.stagefs, "mount", src, mnt, "--cache", cache, "--image-size", str(args.view_size)],
                           check=True, capture_output=True)
            try:
                out = subprocess.run([sys.executable, __file__, "--child", who, "--mnt", mnt,
                                      "--mount-pid", str(mount_pid(mnt)), "--crop", str(args.crop),
                                      "--batch-size", str(args.batch_size), "--readers", str(args.readers)],
                                     check=True, capture_output=True, text=True).stdout
            finally:
                subprocess.run([args.stagefs, "umount", mnt], capture_output=True)
                shutil.rmtree(work, ignore_errors=True)
            epochs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            results[who].append(epochs)
            print(f"round {r + 1} {who:10s} " + "  ".join(
                f"epoch {e['epoch']}: {e['images'] / e['seconds']:7.1f} img/s, {e['cpu']:6.2f} CPU s"
                for e in epochs), flush=True)
    print(f"\nload average before {load_before}, after {uptime()}; {args.n} images, view {args.view_size}, "
          f"crop {args.crop}, batch {args.batch_size}, medians of {args.rounds} rounds")
    print("| loader | epoch | images/s | CPU s per epoch |\n|---|---:|---:|---:|")
    med = {}
    for who, runs in results.items():
        for i in (0, 1):
            rate = statistics.median(run[i]["images"] / run[i]["seconds"] for run in runs)
            cpu = statistics.median(run[i]["cpu"] for run in runs)
            med[who, i] = (rate, cpu)
            print(f"| {who} | {i + 1} | {rate:.1f} | {cpu:.2f} |")
    for i in (0, 1):
        (ra, ca), (rb, cb) = med["stagefs", i], med["dataloader", i]
        print(f"epoch {i + 1}: stagefs/DataLoader images/s {ra / rb:.2f}x, CPU s {ca / max(cb, 1e-9):.2f}x")


if __name__ == "__main__":
    main()
