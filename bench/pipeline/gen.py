"""ImageNet-like JPEGs for the pipeline benchmark: an ImageFolder of class folders.

    python bench/pipeline/gen.py OUT [--n 20000] [--classes 10] [--tensors 256] [--seed 0]

Writes OUT/train/classK/img_NNNNNN.jpg: mostly 500x375 (a quarter portrait 375x500, one in ten
another ImageNet-typical size between 333 and 500 on the short side), quality 90 (4:2:0, one in
eight progressive, as a web crawl mixes them). Content is not flat colour, so the decoder does
the work it does on photos: a smooth two-colour gradient, 3-8 shapes (discs, boxes, bars) in
random colours, a low-frequency brightness field and per-pixel Gaussian noise (sigma 14) that
gives the files a photo's entropy: 79 KB on average at q90 (ImageNet's train JPEGs average
~110 KB; the entropy decoding is a smaller share of the decode than the IDCT and colour work,
which scale with pixels, not bytes). Deterministic per (seed, index): the same files on every machine, so two runs
time the same bytes.

Also writes OUT/tensors/: `--tensors` decoded-and-resized samples (uint8 3x256x256, 196 KB)
saved once as `.pt` (torch.save) and once as `.npy` (numpy.save), for the harness's
`torch.load` / `np.load` timings (a pre-processed dataset's usual shapes).

Generation runs on every core this process may use (its affinity) and skips files that exist.
"""

import argparse
import multiprocessing as mp
import os
import sys

import numpy as np
from PIL import Image

SIDES = [(500, 375)] * 9 + [(500, 333), (500, 400), (480, 360), (500, 500)]


def image(seed, i):
    """The RGB array of image `i` and its JPEG options."""
    rng = np.random.default_rng([seed, i])
    w, h = SIDES[int(rng.integers(len(SIDES)))] if rng.random() < 0.1 else SIDES[0]
    if rng.random() < 0.25:
        w, h = h, w
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = (np.cos(angle) * x / w + np.sin(angle) * y / h + 1) / 2  # 0..1 along a random axis
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    img = c0 + t[..., None] * (c1 - c0)
    for _ in range(int(rng.integers(3, 9))):
        col = rng.uniform(0, 255, 3)
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        kind = rng.integers(3)
        if kind == 0:
            r = rng.uniform(10, min(w, h) / 3)
            mask = (x - cx) ** 2 + (y - cy) ** 2 < r * r
        elif kind == 1:
            bw, bh = rng.uniform(20, w / 2), rng.uniform(20, h / 2)
            mask = (abs(x - cx) < bw / 2) & (abs(y - cy) < bh / 2)
        else:
            a, width = rng.uniform(0, np.pi), rng.uniform(3, 15)
            mask = abs(np.cos(a) * (x - cx) + np.sin(a) * (y - cy)) < width
        alpha = rng.uniform(0.5, 1.0)
        img[mask] = (1 - alpha) * img[mask] + alpha * col
    fx, fy, ph = rng.uniform(1, 4), rng.uniform(1, 4), rng.uniform(0, 6)
    img *= (0.85 + 0.15 * np.sin(fx * x / w * 6 + ph) * np.cos(fy * y / h * 6))[..., None]
    img += rng.normal(0, 14, img.shape)
    opts = {"quality": 90, "progressive": bool(rng.random() < 0.125)}
    return np.clip(img, 0, 255).astype(np.uint8), opts


def write_one(job):
    seed, i, path = job
    if os.path.exists(path):
        return
    arr, opts = image(seed, i)
    tmp = path + ".tmp"
    Image.fromarray(arr).save(tmp, "JPEG", **opts)
    os.replace(tmp, path)


def write_tensors(out, seed, count):
    """`count` samples as 3x256x256 uint8, each as .pt and .npy (skipped when present)."""
    d = os.path.join(out, "tensors")
    os.makedirs(d, exist_ok=True)
    have = sum(1 for f in os.listdir(d) if f.endswith(".npy"))
    if have >= count:
        return
    import torch

    for i in range(count):
        arr, _ = image(seed, i)
        small = np.asarray(Image.fromarray(arr).resize((256, 256), Image.BILINEAR)).transpose(2, 0, 1)
        small = np.ascontiguousarray(small)
        np.save(os.path.join(d, f"t{i:05d}.npy"), small)
        torch.save(torch.from_numpy(small), os.path.join(d, f"t{i:05d}.pt"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--n", type=int, default=20000, help="JPEG files (default 20000)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--tensors", type=int, default=256, help=".pt and .npy files each (0: none)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.n < 1 or args.classes < 1:
        sys.exit("--n and --classes must be at least 1")
    jobs = []
    for i in range(args.n):
        d = os.path.join(args.out, "train", f"class{i % args.classes:03d}")
        jobs.append((args.seed, i, os.path.join(d, f"img_{i:06d}.jpg")))
    for c in range(min(args.classes, args.n)):
        os.makedirs(os.path.join(args.out, "train", f"class{c:03d}"), exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    with mp.get_context("fork").Pool(cores) as pool:
        for _ in pool.imap_unordered(write_one, jobs, chunksize=16):
            pass
    if args.tensors:
        write_tensors(args.out, args.seed, args.tensors)
    total = sum(os.path.getsize(j[2]) for j in jobs)
    print(f"{args.n} JPEGs in {args.classes} classes, {total / args.n / 1e3:.0f} KB average, "
          f"{args.tensors} .pt + .npy tensors, under {args.out}")


if __name__ == "__main__":
    main()
