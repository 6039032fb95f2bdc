"""Decode + resize (shorter side to S, antialiased unless noted) + center crop S×S, per core.

    python3 bench/bench_images.py [--n 300] [--size 224] [--rounds 5] [--dir DIR]

Generates photo-like JPEGs once (deterministic): shorter side 300-500 px for most, some 800-1600;
4:2:0 and 4:4:4; a share progressive; quality 75-95. Then times, contenders alternated each round
(A B C ... A B C ...), each reading every file from the (page-cached) disk inside the timed loop:

- stagefs exact and fast (`--fast-decode`), 1 and 2 threads: the release build of the views
  crate's example `bench_images` (the renderer `images.npy` uses, pinned with taskset);
- `stagefs convert --to npy -j 1` / `-j 2` end to end (scan, decode, write images.npy);
- Pillow (open → convert("RGB") → resize BILINEAR → crop), Pillow + draft, simplejpeg + Pillow
  resize, OpenCV INTER_LINEAR (no antialiasing) and INTER_AREA, 1 thread; Pillow with 2 threads;
- NVIDIA DALI's CPU pipeline, if `nvidia.dali` imports.

Prints the median images/s per contender with ratios to Pillow, the load average before and
after (`uptime`; numbers taken while other work runs are not worth quoting), and the accuracy of
each mode against Pillow (max and mean absolute difference in levels, over all pixels).
Needs: numpy, pillow; optional (bench only): opencv-python-headless, simplejpeg, nvidia-dali.
Build first: cargo build --release -p stagefs-views --examples && cargo build --release --bin stagefs
"""

import argparse
import concurrent.futures
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
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
        big = rng.random() < 0.1
        short = int(rng.integers(800, 1601)) if big else int(rng.integers(300, 501))
        long = int(short * rng.choice([4 / 3, 1.5, 1.25]))
        w, h = (long, short) if rng.random() < 0.75 else (short, long)
        img = gen_dataset.photo(rng, w, h).astype(np.float32)
        # Fine texture so the file size resembles a real photo (~110 KB at q90 for 500x375).
        img += rng.normal(0, 18, img.shape)
        kw = {"quality": int(rng.choice([75, 85, 90, 95]))}
        if rng.random() < 0.25:
            kw["subsampling"] = 0  # 4:4:4
        if rng.random() < 0.2:
            kw["progressive"] = True
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(os.path.join(d, f"p{i:04d}.jpg"), **kw)


def sizes(w, h, s):
    return (s, int(s * h / w)) if w <= h else (int(s * w / h), s)


def crop_box(nw, nh, s):
    left, top = int(round((nw - s) / 2.0)), int(round((nh - s) / 2.0))
    return left, top, left + s, top + s


def read(path):
    with open(path, "rb") as f:
        return f.read()


def pillow(path, s, draft=False):
    img = Image.open(io.BytesIO(read(path)))
    if draft:
        img.draft("RGB", (s, s))
    img = img.convert("RGB")
    nw, nh = sizes(*img.size, s)
    img = img.resize((nw, nh), Image.BILINEAR)
    return np.asarray(img.crop(crop_box(nw, nh, s)))


def simplejpeg_pillow(path, s):
    import simplejpeg
    img = Image.fromarray(simplejpeg.decode_jpeg(read(path), colorspace="RGB"))
    nw, nh = sizes(*img.size, s)
    img = img.resize((nw, nh), Image.BILINEAR)
    return np.asarray(img.crop(crop_box(nw, nh, s)))


def opencv(path, s, interp):
    import cv2
    arr = cv2.imdecode(np.frombuffer(read(path), np.uint8), cv2.IMREAD_COLOR)
    arr = cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
    h, w = arr.shape[:2]
    nw, nh = sizes(w, h, s)
    arr = cv2.resize(arr, (nw, nh), interpolation=interp)
    l, t, r, b = crop_box(nw, nh, s)
    return arr[t:b, l:r]


def dali_runner(d, s, n):
    """A DALI CPU pipeline (file reader → decoder → resize shorter → crop), or None."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        return None

    @pipeline_def(batch_size=32, num_threads=1, device_id=None)
    def pipe():
        jpegs, _ = fn.readers.file(file_root=d, random_shuffle=False, name="r")
        img = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        img = fn.resize(img, resize_shorter=s, antialias=True)
        return fn.crop(img, crop=(s, s))

    p = pipe()
    p.build()

    def run():
        for _ in range((n + 31) // 32):
            p.run()
    return run


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def accuracy(name, arrays, refs):
    d = [np.abs(a.astype(int) - r.astype(int)) for a, r in zip(arrays, refs)]
    mx = max(int(x.max()) for x in d)
    mean = float(np.mean([x.mean() for x in d]))
    worst = float(np.max([x.mean() for x in d]))
    share = float(np.mean([(x > 2).mean() for x in d]))
    print(f"  {name:38} max {mx:3d}  mean {mean:.3f}  worst image mean {worst:.3f}  pixels >2 levels {share:.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="default /tmp/stagefs-bench-photos-N")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "examples", "bench_images"))
    ap.add_argument("--stagefs", default=os.path.join(ROOT, "target", "release", "stagefs"))
    args = ap.parse_args()
    args.dir = args.dir or f"/tmp/stagefs-bench-photos-{args.n}"
    make_photos(args.dir, args.n)
    files = sorted(os.path.join(args.dir, f) for f in os.listdir(args.dir) if f.endswith(".jpg"))[: args.n]
    s = args.size
    print(f"{len(files)} photos, mean {np.mean([os.path.getsize(f) for f in files]) / 1e3:.0f} KB, S={s}")
    print("load before:", uptime())
    ncpu = os.cpu_count() or 1
    two = {0, 1} if ncpu >= 2 else {0}
    out_dir = tempfile.mkdtemp(prefix="stagefs-bench-out-")

    def ours(mode, threads):
        cmd = ["taskset", "-c", ",".join(map(str, sorted(two if threads == 2 else {0}))),
               args.bin, args.dir, str(s), "1", f"threads={threads}"] + (["fast"] if mode == "fast" else [])

        def run():
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            return float(out.split()[-1])
        return run

    def convert(mode, threads):
        def run():
            shutil.rmtree(os.path.join(out_dir, "c"), ignore_errors=True)
            cmd = ["taskset", "-c", ",".join(map(str, sorted(two if threads == 2 else {0}))), args.stagefs,
                   "convert", args.dir, os.path.join(out_dir, "c"), "--to", "npy", "-q", "-j", str(threads),
                   "--image-size", str(s)] + (["--fast-decode"] if mode == "fast" else [])
            t = time.perf_counter()
            subprocess.run(cmd, check=True)
            return len(files) / (time.perf_counter() - t)
        return run

    def python(fn, threads=1):
        def run():
            os.sched_setaffinity(0, two if threads == 2 else {0})
            t = time.perf_counter()
            if threads == 1:
                for f in files:
                    fn(f)
            else:
                with concurrent.futures.ThreadPoolExecutor(threads) as ex:
                    list(ex.map(fn, files))
            return len(files) / (time.perf_counter() - t)
        return run

    contenders = {}
    if os.path.exists(args.bin):
        for mode in ("exact", "fast"):
            for t in (1, 2):
                contenders[f"stagefs {mode}, {t} thread{'s' if t > 1 else ''}"] = ours(mode, t)
    else:
        print(f"{args.bin} missing: build it (see the docstring)")
    if os.path.exists(args.stagefs):
        for mode in ("exact", "fast"):
            for t in (1, 2):
                contenders[f"stagefs convert -j {t} ({mode})"] = convert(mode, t)
    contenders["Pillow"] = python(lambda f: pillow(f, s))
    contenders["Pillow, 2 threads"] = python(lambda f: pillow(f, s), 2)
    contenders["Pillow + draft"] = python(lambda f: pillow(f, s, True))
    try:
        import simplejpeg  # noqa: F401
        contenders["simplejpeg + Pillow resize"] = python(lambda f: simplejpeg_pillow(f, s))
    except ImportError:
        print("simplejpeg not installed: skipped")
    try:
        import cv2
        cv2.setNumThreads(1)
        contenders["OpenCV INTER_LINEAR (no antialias)"] = python(lambda f: opencv(f, s, cv2.INTER_LINEAR))
        contenders["OpenCV INTER_AREA"] = python(lambda f: opencv(f, s, cv2.INTER_AREA))
    except ImportError:
        print("opencv-python-headless not installed: skipped")
    dali = dali_runner(args.dir, s, len(files))
    if dali:
        def dali_rate():
            os.sched_setaffinity(0, {0})
            t = time.perf_counter()
            dali()
            return len(files) / (time.perf_counter() - t)
        contenders["DALI CPU pipeline, 1 thread"] = dali_rate
    else:
        print("nvidia-dali not installed: skipped")

    rates = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, run in contenders.items():
            rates[name].append(run())
    os.sched_setaffinity(0, set(range(ncpu)))
    print("load after: ", uptime())
    base = statistics.median(rates["Pillow"])
    print(f"\n{'contender (with file I/O)':44} {'img/s':>8} {'vs Pillow':>10}")
    for name, r in rates.items():
        m = statistics.median(r)
        print(f"{name:44} {m:8.0f} {m / base:9.2f}×")

    print("\naccuracy against Pillow (levels, all pixels of all photos):")
    refs = [pillow(f, s) for f in files]
    if os.path.exists(args.stagefs):
        for mode in ("exact", "fast"):
            o = os.path.join(out_dir, mode)
            subprocess.run([args.stagefs, "convert", args.dir, o, "--to", "npy", "-q", "--image-size", str(s)]
                           + (["--fast-decode"] if mode == "fast" else []), check=True)
            arr = np.load(os.path.join(o, "images.npy"))
            names = open(os.path.join(o, "files.txt")).read().splitlines()
            order = {os.path.basename(f): i for i, f in enumerate(files)}
            accuracy(f"stagefs {mode}", [arr[i] for i in range(len(names))], [refs[order[n]] for n in names])
    accuracy("Pillow + draft", [pillow(f, s, True) for f in files], refs)
    try:
        import cv2
        accuracy("OpenCV INTER_AREA", [opencv(f, s, cv2.INTER_AREA) for f in files], refs)
    except ImportError:
        pass
    shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
