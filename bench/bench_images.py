"""Single-core decode + resize (shorter side to S, antialiased unless noted) + center crop S×S.

    python3 bench/bench_images.py [--n 200] [--size 224] [--rounds 5] [--dir /tmp/stagefs-bench-photos]

Generates ImageNet-like JPEGs once (shorter side 300–500 px, 4:3 or 3:4, quality 90, ~110 KB,
deterministic), then times, on one pinned core, alternating contenders each round
(A B C ... A B C ...): stagefs's renderer (release build of the convert crate's example
`bench_images`), Pillow (with and without draft mode), simplejpeg (+ Pillow resize) and OpenCV
(INTER_LINEAR, no antialiasing; INTER_AREA). Prints the median images/s per contender and the
ratios. Needs: pip install opencv-python-headless simplejpeg (bench only).
"""

import argparse
import io
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "py"))
import gen_dataset  # noqa: E402


def make_photos(d, n):
    os.makedirs(d, exist_ok=True)
    if len([f for f in os.listdir(d) if f.endswith(".jpg")]) >= n:
        return
    rng = np.random.default_rng(2024)
    for i in range(n):
        short = int(rng.integers(300, 501))
        long = int(short * rng.choice([4 / 3, 1.5, 1.25]))
        w, h = (long, short) if rng.random() < 0.75 else (short, long)
        img = gen_dataset.photo(rng, w, h).astype(np.float32)
        # Fine texture so the file size resembles a real photo (~110 KB at q90).
        img += rng.normal(0, 18, img.shape)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
            os.path.join(d, f"p{i:04d}.jpg"), quality=90)


def sizes(w, h, s):
    return (s, int(s * h / w)) if w <= h else (int(s * w / h), s)


def crop_box(nw, nh, s):
    left, top = int(round((nw - s) / 2.0)), int(round((nh - s) / 2.0))
    return left, top, left + s, top + s


def pillow(data, s, draft):
    img = Image.open(io.BytesIO(data))
    if draft:
        img.draft("RGB", (s, s))
    img = img.convert("RGB")
    nw, nh = sizes(*img.size, s)
    img = img.resize((nw, nh), Image.BILINEAR)
    return np.asarray(img.crop(crop_box(nw, nh, s)))


def simplejpeg_pillow(data, s):
    import simplejpeg
    arr = simplejpeg.decode_jpeg(data, colorspace="RGB")
    img = Image.fromarray(arr)
    nw, nh = sizes(*img.size, s)
    img = img.resize((nw, nh), Image.BILINEAR)
    return np.asarray(img.crop(crop_box(nw, nh, s)))


def opencv(data, s, interp):
    import cv2
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    arr = cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
    h, w = arr.shape[:2]
    nw, nh = sizes(w, h, s)
    arr = cv2.resize(arr, (nw, nh), interpolation=interp)
    l, t, r, b = crop_box(nw, nh, s)
    return arr[t:b, l:r]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/stagefs-bench-photos")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "examples", "bench_images"))
    args = ap.parse_args()
    make_photos(args.dir, args.n)
    files = sorted(f for f in os.listdir(args.dir) if f.endswith(".jpg"))[: args.n]
    blobs = [open(os.path.join(args.dir, f), "rb").read() for f in files]
    print(f"{len(blobs)} photos, mean {np.mean([len(b) for b in blobs]) / 1e3:.0f} KB, "
          f"S={args.size}, one core (cpu 0)")
    os.sched_setaffinity(0, {0})
    contenders = {
        "stagefs (zune-jpeg + fast_image_resize)": None,
        "Pillow": lambda b: pillow(b, args.size, False),
        "Pillow + draft": lambda b: pillow(b, args.size, True),
    }
    try:
        import simplejpeg  # noqa: F401
        contenders["simplejpeg + Pillow resize"] = lambda b: simplejpeg_pillow(b, args.size)
    except ImportError:
        print("simplejpeg not installed: skipped")
    try:
        import cv2
        cv2.setNumThreads(1)
        contenders["OpenCV INTER_LINEAR (no antialias)"] = lambda b: opencv(b, args.size, cv2.INTER_LINEAR)
        contenders["OpenCV INTER_AREA"] = lambda b: opencv(b, args.size, cv2.INTER_AREA)
    except ImportError:
        print("opencv-python-headless not installed: skipped")
    rates = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            if fn is None:
                out = subprocess.run(["taskset", "-c", "0", args.bin, args.dir, str(args.size), "1"],
                                     check=True, capture_output=True, text=True).stdout
                rates[name].append(float(out.split()[-1]))
                continue
            t = time.perf_counter()
            for b in blobs:
                fn(b)
            rates[name].append(len(blobs) / (time.perf_counter() - t))
    base = statistics.median(rates["Pillow"])
    ours = statistics.median(rates["stagefs (zune-jpeg + fast_image_resize)"])
    print(f"{'contender':40} {'img/s':>8} {'vs Pillow':>10} {'stagefs ×':>10}")
    for name, r in rates.items():
        m = statistics.median(r)
        print(f"{name:40} {m:8.0f} {m / base:9.2f}× {ours / m:9.2f}×")


if __name__ == "__main__":
    main()
