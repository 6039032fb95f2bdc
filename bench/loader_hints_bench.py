#!/usr/bin/env python3
"""stagefs.Loader with and without read-order hints (issue 20, item 4), on fresh mounts.

    .venv/bin/python bench/loader_hints_bench.py --images 20000 --raw-mb 2048 --rounds 3
    .venv/bin/python bench/loader_hints_bench.py --src /bigdata/ds --rounds 3   # slow backend
    .venv/bin/python bench/loader_hints_bench.py --images 60 --raw-mb 8 --rounds 1  # runs?

SRC holds an image folder `images/<class>/*.jpg` and a raw `rows.npy` (generated under WORK
when --src is not given). Each measurement mounts SRC on a fresh, empty cache (so the view is
rendered and the raw file fetched from SRC: cold) and runs one shuffled Loader epoch over
  view  MNT/.npy/images/images.npy (+ labels.npy)  → images/s
  raw   MNT/rows.npy                               → MB/s
with hints=True (A) and hints=False (B), alternated A B A B ... per round. Each line gives the
load average (other work on the machine skews the figures: run it on a quiet one) and the
mount's stats: hints accepted, bytes hinted, view units rendered, bytes pushed, reader stall.
Goals (issue 20): the view epoch limited by decode speed (both cores rendering); the raw epoch
cold at >= 0.8x the backend's bandwidth with hints. The page cache of SRC is not dropped (that
needs root): use a backend slower than this machine's memory (bench/mount/run.sh's) for cold
figures. Build in release mode for real figures (`cargo build --release`, `maturin develop
--release`) and pass --bin target/release/stagefs.
"""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(src, images, raw_mb, size):
    from PIL import Image

    rng = np.random.default_rng(1)
    for i in range(images):
        d = os.path.join(src, "images", f"c{i % 4}")
        os.makedirs(d, exist_ok=True)
        p = os.path.join(d, f"{i:07d}.jpg")
        if not os.path.exists(p):
            # Smooth gradients plus noise: decodes like a photo, not like flat colour.
            h, w = size + 17 * (i % 5), size + 11 * (i % 7)
            y, x = np.mgrid[0:h, 0:w]
            img = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) * 127 // (w + h))], -1)
            img = (img + rng.integers(0, 40, img.shape)).clip(0, 255).astype(np.uint8)
            Image.fromarray(img).save(p, quality=90)
    raw = os.path.join(src, "rows.npy")
    rows = max(64, (raw_mb << 20) // 65536)
    if not os.path.exists(raw) or np.load(raw, mmap_mode="r").shape[0] != rows:
        a = np.lib.format.open_memmap(raw, mode="w+", dtype=np.uint8, shape=(rows, 65536))
        for i in range(0, rows, 256):
            a[i:i + 256] = rng.integers(0, 256, (min(256, rows - i), 65536), dtype=np.uint8)
        a.flush()
        del a


def cli(bin_, *args):
    p = subprocess.run([bin_, *map(str, args)], capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        sys.exit(f"stagefs {' '.join(map(str, args))}: {p.stderr.strip()}")


def stats(mnt):
    with open(os.path.join(mnt, ".stagefs", "stats")) as f:
        return json.load(f)


def epoch(paths, hints, batch):
    """One shuffled epoch: seconds, rows, bytes. The Loader (and its open files) ends with it."""
    import stagefs

    ld = stagefs.Loader(paths, batch, shuffle=True, seed=3, tensors="numpy", hints=hints)
    t0 = time.perf_counter()
    rows = nbytes = 0
    for b in ld:
        rows += b[0].shape[0]
        nbytes += sum(t.nbytes for t in b)
    return time.perf_counter() - t0, rows, nbytes


def run(bin_, src, work, what, hints, batch, image_size, mount_args):
    mnt, cache = os.path.join(work, "mnt"), os.path.join(work, f"cache-{time.time_ns()}")
    os.makedirs(mnt, exist_ok=True)
    cli(bin_, "mount", src, mnt, "--cache", cache, "--image-size", image_size, *mount_args)
    try:
        if what == "view":
            d = os.path.join(mnt, ".npy", "images")
            paths = [os.path.join(d, "images.npy"), os.path.join(d, "labels.npy")]
        else:
            paths = [os.path.join(mnt, "rows.npy")]
        secs, rows, nbytes = epoch(paths, hints, batch)
        gc.collect()
        # The daemon applies hints in the background: let the last ones land in the stats.
        time.sleep(0.5)
        s = stats(mnt)
    finally:
        cli(bin_, "umount", mnt)
        shutil.rmtree(cache, ignore_errors=True)
    return secs, rows, nbytes, s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", help="existing SRC (images/<class>/*.jpg and rows.npy)")
    ap.add_argument("--work", help="where to generate SRC and mount (default: a temp dir)")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--raw-mb", type=int, default=512)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", choices=["view", "raw"], help="one of the two measurements")
    ap.add_argument("--generate", metavar="DIR", help="only generate the dataset into DIR")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before every mount (root): cold reads of SRC")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "debug", "stagefs"))
    # Root gets passthrough, which serves verified large files itself (and, as of this writing,
    # fails their opens with EIO): the hints are about the daemon-served path a user gets.
    ap.add_argument("--mount-args", default="--no-passthrough" if os.geteuid() == 0 else "",
                    help="extra `stagefs mount` arguments (default as root: --no-passthrough)")
    a = ap.parse_args()
    if a.generate:
        generate(a.generate, a.images, a.raw_mb, a.image_size)
        return
    work = a.work or tempfile.mkdtemp(prefix="stagefs-hints-bench-")
    src = a.src or os.path.join(work, "src")
    if not a.src:
        generate(src, a.images, a.raw_mb, a.image_size)
    whats = [a.only] if a.only else ["view", "raw"]
    print(f"# src={src} rounds={a.rounds} batch={a.batch} image_size={a.image_size}")
    results = {}
    for r in range(a.rounds):
        for what in whats:
            for hints in (True, False):
                if a.drop_caches:
                    subprocess.run(["sync"], check=True)
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("3\n")
                load = os.getloadavg()
                secs, rows, nbytes, s = run(a.bin, src, work, what, hints, a.batch, a.image_size,
                                               a.mount_args.split())
                rate = f"{rows / secs:9.1f} images/s" if what == "view" else f"{nbytes / secs / 1e6:9.1f} MB/s"
                results.setdefault((what, hints), []).append(rows / secs if what == "view" else nbytes / secs / 1e6)
                print(f"round {r} {what:4} hints={'on ' if hints else 'off'} {secs:7.2f} s {rate}  "
                      f"load {load[0]:.2f} {load[1]:.2f}  hints_accepted={s.get('hints_accepted')} "
                      f"hint_bytes={s.get('hint_bytes')} rejected={s.get('hints_rejected')} "
                      f"views_rendered={s['views_rendered']} bytes_pushed={s['bytes_pushed']} "
                      f"stall_s={s['stall_s']:.2f} from_source={s['bytes_from_source']}", flush=True)
    for what in whats:
        on, off = results[(what, True)], results[(what, False)]
        unit = "images/s" if what == "view" else "MB/s"
        print(f"{what}: hints on median {sorted(on)[len(on) // 2]:.1f} {unit}, off "
              f"{sorted(off)[len(off) // 2]:.1f} {unit}, on/off {sorted(on)[len(on) // 2] / sorted(off)[len(off) // 2]:.2f}x")
    if not a.work and not a.src:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
