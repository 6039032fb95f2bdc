"""The seed's training input end to end, against stagefs, at 1, 2 and all cores.

    python bench/pipeline/gen.py /var/tmp/tensor-pipeline/data --n 2000     # once
    python bench/pipeline/run.py /var/tmp/tensor-pipeline/data [--mount] [--cores 1,2,all]
        [--rounds 2] [--images 1280] [--batch-size 64] [--step-ms 50] [--out DIR]

Contenders, alternated in one run (for each core count: A B C D, A B C D, ...), each a fresh
process pinned with `taskset -c` to the first N cores this run may use (its DataLoader workers,
reader threads and, under `stagefs run`, the mount daemon all inherit the mask: the job has N
cores, not N workers on a bigger machine), each batch followed by a training step of fixed
duration (`--step-ms`; a CPU sleep, or with `torch.cuda.is_available()` a real CUDA step: the
batch copied to the GPU, a convolution over it and `torch.cuda._sleep` calibrated to the rest of
the step, synchronized as a loss.item() would):

- **seed**: torchvision ImageFolder + RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor +
  Normalize, DataLoader(num_workers=N, pin_memory=True, persistent_workers=True), over the local
  copy (`rsync -a DATA SCRATCH`, timed once: the seed's staging step);
- **seed-mount** (`--mount`): the same unmodified program over a stagefs mount of DATA, started
  under `stagefs run --mount DATA:MNT:CACHE` (direct reads preloaded); the cache is kept across
  measurements and warmed once before the first, as a job's later epochs find it;
- **loader**: `stagefs.Loader` over the image view (`--mount`: the mount's `.npy/train`, else a
  view written once by `stagefs convert --to npy` from the local copy) with its deterministic
  RandomResizedCrop(224, flip) + normalize, NCHW float32, `readers=N`;
- **dali**: NVIDIA DALI (file reader, mixed-device decoder, random resized crop, crop-mirror-
  normalize) over the local copy, with a device and `nvidia.dali`; else `skipped: needs a GPU`.

Each measurement drops its first `--warmup` batches (worker start, first reads) and times the
next `--images`. Reported per contender and core count (medians over rounds): images/s, the
fraction of the step loop spent waiting for the next batch, and CPU-seconds per 1000 images
(user + system of the training process, its workers and the mount daemon, from /proc).

Then `torch.load` of `.pt` and `np.load` of `.npy` files (DATA/tensors, see gen.py): every file
once per round, from the local copy and (`--mount`) through the mount under `stagefs run`.

Writes OUT/pipeline.md (tables, the load average before and after, the machine) and
OUT/pipeline.png (images/s and data wait vs cores). The binary for `--mount` and the view:
`--stagefs`, else `$STAGEFS_BIN`, else `$CARGO_TARGET_DIR` or target/ `release/stagefs`.
Needs: numpy, pillow, torch, torchvision, matplotlib, the stagefs package (release build for
figures: `maturin develop --release -m gpu/python/Cargo.toml`).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TICK = os.sysconf("SC_CLK_TCK")
CROP = 224
VIEW_SIZE = 256  # the view is rendered larger than the crop, so RandomResizedCrop has room
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CONTENDERS = ("seed", "seed-mount", "loader", "dali")


# ---------------------------------------------------------------- measuring, in the child


def proc_cpu(pid):
    """User + system CPU seconds of a live process, all its threads (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def children(pid):
    """Direct children of `pid` (DataLoader workers, the pin-memory thread is a thread)."""
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            out = [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def mount_pids(mnt):
    """The `stagefs mount ... MNT` daemon(s) serving `mnt`, if any."""
    if not mnt:
        return []
    pids, want = [], os.fsencode(os.path.abspath(mnt))
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"mount" in argv and want in argv:
                pids.append(int(p))
    return pids


def cpu_snapshot(extra):
    pids = [os.getpid(), *children(os.getpid()), *extra]
    return {p: proc_cpu(p) for p in pids}


def cpu_since(before, extra):
    after = cpu_snapshot(extra)
    return sum(after[p] - before.get(p, 0.0) for p in after)


class Step:
    """A training step of fixed duration: a CPU sleep, or a real CUDA step on a device."""

    def __init__(self, seconds):
        import torch

        self.torch, self.seconds = torch, seconds
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            self.weight = torch.randn(16, 3, 3, 3, device="cuda")
            torch.cuda.synchronize()
            start = time.perf_counter()
            torch.cuda._sleep(10_000_000)
            torch.cuda.synchronize()
            self.cycles_per_s = 10_000_000 / (time.perf_counter() - start)

    def __call__(self, images):
        if not self.cuda:
            time.sleep(self.seconds)
            return
        torch = self.torch
        start = time.perf_counter()
        x = images.to("cuda", non_blocking=True).float()
        torch.nn.functional.conv2d(x, self.weight, padding=1).sum()
        torch.cuda.synchronize()
        rest = self.seconds - (time.perf_counter() - start)
        if rest > 0:
            torch.cuda._sleep(int(rest * self.cycles_per_s))
        torch.cuda.synchronize()


def batches_seed(args, root):
    import torch
    import torchvision
    from torchvision import transforms as T

    ds = torchvision.datasets.ImageFolder(os.path.join(root, "train"), T.Compose([
        T.RandomResizedCrop(CROP), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]))
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True,
                                         num_workers=args.cores, pin_memory=True,
                                         persistent_workers=True, drop_last=True)
    while True:  # epochs, the workers persisting
        if len(loader) == 0:
            raise SystemExit(f"fewer than --batch-size {args.batch_size} images under {root}")
        for images, _ in loader:
            yield images


def batches_loader(args, view):
    import stagefs

    device = "cuda:0" if args.cuda else "cpu"
    loader = stagefs.Loader([f"{view}/images.npy", f"{view}/labels.npy"], args.batch_size,
                            shuffle=True, seed=0, drop_last=True, device=device,
                            transform=stagefs.RandomResizedCrop(CROP, flip=True),
                            normalize=(stagefs.IMAGENET_MEAN, stagefs.IMAGENET_STD),
                            dtype="float32", layout="NCHW", readers=args.cores)
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        got = 0
        for images, _ in loader:
            got += 1
            yield images
        if got == 0:
            raise SystemExit(f"fewer than --batch-size {args.batch_size} rows in {view}")
        epoch += 1


def batches_dali(args, root):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=args.batch_size, num_threads=args.cores, device_id=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=os.path.join(root, "train"), random_shuffle=True,
                                        name="reader")
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        images = fn.random_resized_crop(images, size=CROP)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                          mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
                                          mirror=fn.random.coin_flip())
        return images, labels

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["images", "labels"], reader_name="reader",
                             last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)
    while True:
        got = 0
        for out in it:
            got += 1
            yield out[0]["images"]
        if got == 0:
            raise SystemExit(f"fewer than --batch-size {args.batch_size} images under {root}")


def child(args):
    os.sched_setaffinity(0, set(int(c) for c in args.cpus.split(",")))
    import warnings

    import torch

    warnings.filterwarnings("ignore")  # pin_memory without a device says so once per worker
    torch.set_num_threads(args.cores)
    args.cuda = torch.cuda.is_available()
    extra = mount_pids(args.mnt)
    if args.child == "tensors":
        return child_tensors(args, extra)
    source = {"seed": batches_seed, "loader": batches_loader, "dali": batches_dali}[args.child]
    batches = source(args, args.root)
    step = Step(args.step_ms / 1000)
    for _ in range(args.warmup):
        step(next(batches))
    want = max(1, args.images // args.batch_size)
    before, start, wait, n = cpu_snapshot(extra), time.perf_counter(), 0.0, 0
    for _ in range(want):
        t = time.perf_counter()
        images = next(batches)
        wait += time.perf_counter() - t
        assert tuple(images.shape[1:]) == (3, CROP, CROP), images.shape
        n += images.shape[0]
        step(images)
    seconds = time.perf_counter() - start
    cpu = cpu_since(before, extra)
    print(json.dumps({"images": n, "seconds": seconds, "wait": wait, "cpu": cpu}), flush=True)
    os._exit(0)  # persistent workers and reader threads end with the process


def child_tensors(args, extra):
    import numpy as np
    import torch

    d = os.path.join(args.root, "tensors")
    out = {}
    for ext, load in ((".pt", torch.load), (".npy", np.load)):
        files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(ext))
        if files:
            load(files[0])  # untimed: the loader's first call imports and sets up
        before, start, size = cpu_snapshot(extra), time.perf_counter(), 0
        for f in files:
            a = load(f)
            size += a.nbytes if hasattr(a, "nbytes") else a.numel() * a.element_size()
        seconds = time.perf_counter() - start
        out[ext] = {"files": len(files), "bytes": size, "seconds": seconds,
                    "cpu": cpu_since(before, extra)}
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- orchestrating, in the parent


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def find_binary(arg):
    if arg:
        return arg
    if os.environ.get("STAGEFS_BIN"):
        return os.environ["STAGEFS_BIN"]
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    path = os.path.join(target, "release", "stagefs")
    return path if os.access(path, os.X_OK) else None


def dali_available():
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import nvidia.dali  # noqa: F401

        return True
    except Exception:  # noqa: BLE001 - any import failure means: not here
        return False


class Run:
    def __init__(self, args):
        self.args = args
        self.bin = find_binary(args.stagefs)
        self.work = os.path.abspath(args.work)
        self.mnt = os.path.join(self.work, "mnt")
        self.cache = os.path.join(self.work, "cache")

    def command(self, who, cpus, root, under_mount, extra=()):
        a = self.args
        cmd = [sys.executable, os.path.abspath(__file__), "--child", who, "--root", root,
               "--cpus", ",".join(map(str, cpus)), "--cores", str(len(cpus)),
               "--batch-size", str(a.batch_size), "--images", str(a.images),
               "--warmup", str(a.warmup), "--step-ms", str(a.step_ms), *extra]
        if under_mount:
            cmd = [self.bin, "run", "--mount", f"{os.path.abspath(a.data)}:{self.mnt}:{self.cache}",
                   f"--mount-arg=--image-size={VIEW_SIZE}", "--", *cmd, "--mnt", self.mnt]
        return ["taskset", "-c", ",".join(map(str, cpus)), *cmd]

    def measure(self, who, cpus, root, under_mount):
        # seed-mount is the seed's program, unmodified, on another root.
        cmd = self.command("seed" if who == "seed-mount" else who, cpus, root, under_mount)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.args.timeout)
        lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            sys.exit(f"{who} on {len(cpus)} cores failed ({p.returncode}): {' '.join(cmd)}\n"
                     f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        return json.loads(lines[-1])


def stage_local(args):
    """The seed's staging step: rsync DATA to an empty scratch (timed: the whole copy)."""
    dst = os.path.abspath(args.scratch)
    shutil.rmtree(dst, ignore_errors=True)
    start = time.perf_counter()
    if shutil.which("rsync"):
        subprocess.run(["rsync", "-a", os.path.abspath(args.data) + "/", dst + "/"], check=True)
    else:
        shutil.copytree(args.data, dst, dirs_exist_ok=True)
    return dst, time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", nargs="?", help="the dataset (bench/pipeline/gen.py)")
    p.add_argument("--mount", action="store_true", help="also seed-mount, and the Loader on the mount")
    p.add_argument("--cores", default="1,2,all", help="core counts, comma-separated ('all')")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--images", type=int, default=1280, help="timed images per measurement")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=50.0, help="training step per batch")
    p.add_argument("--scratch", help="the local copy (default DATA-scratch)")
    p.add_argument("--work", help="mount point, cache, view (default DATA-work)")
    p.add_argument("--out", help="pipeline.md and pipeline.png go here (default DATA-out)")
    p.add_argument("--stagefs", help="the stagefs binary")
    p.add_argument("--timeout", type=float, default=900, help="seconds per measurement")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--cpus", help=argparse.SUPPRESS)
    p.add_argument("--mnt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.cores = int(args.cores)
        return child(args)
    if not args.data or not os.path.isdir(os.path.join(args.data, "train")):
        sys.exit("usage: run.py DATA ...: DATA/train/CLASS/*.jpg from bench/pipeline/gen.py")
    data = os.path.abspath(args.data).rstrip("/")
    args.scratch = args.scratch or data + "-scratch"
    args.work = args.work or data + "-work"
    args.out = args.out or data + "-out"
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    run = Run(args)
    allowed = sorted(os.sched_getaffinity(0))
    counts = []
    for c in args.cores.split(","):
        n = len(allowed) if c == "all" else int(c)
        if not 1 <= n <= len(allowed):
            sys.exit(f"--cores {c}: this run may use {len(allowed)} cores")
        if n not in counts:
            counts.append(n)
    wanted = [c for c in args.contenders.split(",") if c]
    unknown = set(wanted) - set(CONTENDERS)
    if unknown:
        sys.exit(f"--contenders: unknown {sorted(unknown)}; use {','.join(CONTENDERS)}")
    skipped = {}
    if "seed-mount" in wanted and not args.mount:
        wanted.remove("seed-mount")
    if (args.mount or "loader" in wanted) and not run.bin:
        sys.exit("--mount and the loader need the stagefs binary: --stagefs, $STAGEFS_BIN, or "
                 "cargo build --release --bin stagefs")
    if "dali" in wanted and not dali_available():
        wanted.remove("dali")
        skipped["dali"] = "skipped: needs a GPU (and nvidia.dali)"
        print("dali: skipped: needs a GPU (and nvidia.dali)", flush=True)

    load_before = loadavg()
    scratch, rsync_s = stage_local(args)
    files = sum(len(fs) for _, _, fs in os.walk(os.path.join(scratch, "train")))
    mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(scratch, "train"))
             for f in fs) / 1e6
    print(f"local copy: {files} files, {mb:.0f} MB, rsync {rsync_s:.1f} s (page cache warm after)",
          flush=True)
    view, convert_s = None, None
    if "loader" in wanted and not args.mount:
        # One SRC: convert writes its view straight into OUT (images.npy, labels.npy).
        view = os.path.join(args.work, "view", "train")
        shutil.rmtree(view, ignore_errors=True)
        start = time.perf_counter()
        subprocess.run([run.bin, "convert", os.path.join(scratch, "train"), view, "--to", "npy",
                        "--image-size", str(VIEW_SIZE), "-q"], check=True)
        convert_s = time.perf_counter() - start
        print(f"view: stagefs convert --to npy {convert_s:.1f} s", flush=True)
    if args.mount:
        os.makedirs(run.mnt, exist_ok=True)
        start = time.perf_counter()
        # One pass each over the raw files and the view fills the cache a later epoch finds.
        warm = run.command("seed", allowed, run.mnt, True)
        subprocess.run([*warm[:warm.index("--") + 1], "sh", "-c",
                        f"find {run.mnt}/train -type f -exec cat {{}} + > /dev/null && "
                        f"cat {run.mnt}/.npy/train/images.npy {run.mnt}/.npy/train/labels.npy > /dev/null"],
                       check=True)
        print(f"mount cache warmed in {time.perf_counter() - start:.1f} s", flush=True)

    where = {"seed": (scratch, False), "seed-mount": (run.mnt, True), "dali": (scratch, False),
             "loader": ((os.path.join(run.mnt, ".npy", "train"), True) if args.mount else (view, False))}
    results = {}
    for n in counts:
        cpus = allowed[:n]
        for r in range(args.rounds):
            for who in wanted:
                root, under = where[who]
                m = run.measure(who, cpus, root, under)
                results.setdefault((who, n), []).append(m)
                print(f"cores {n} round {r + 1} {who:10s} {m['images'] / m['seconds']:8.1f} img/s  "
                      f"wait {m['wait'] / m['seconds']:5.1%}  "
                      f"{m['cpu'] / m['images'] * 1000:6.2f} CPU s/1000 img", flush=True)

    tensors = {}
    if os.path.isdir(os.path.join(scratch, "tensors")):
        places = [("local", scratch, False)] + ([("mount", run.mnt, True)] if args.mount else [])
        for r in range(args.rounds):
            for place, root, under in (places if r % 2 == 0 else places[::-1]):  # A B, B A
                cmd = run.command("tensors", allowed, root, under)
                out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                     timeout=args.timeout).stdout
                m = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
                for ext, v in m.items():
                    tensors.setdefault((ext, place), []).append(v)
                    print(f"round {r + 1} {ext:4s} {place:5s} {v['files'] / v['seconds']:8.0f} files/s "
                          f"{v['bytes'] / v['seconds'] / 1e6:7.0f} MB/s", flush=True)
    load_after = loadavg()
    report(args, counts, wanted, skipped, results, tensors, load_before, load_after,
           files, mb, rsync_s, convert_s)


def med(values):
    return statistics.median(values) if values else float("nan")


def report(args, counts, wanted, skipped, results, tensors, load_before, load_after,
           files, mb, rsync_s, convert_s):
    import platform

    device = "CPU sleep"
    try:
        import torch

        if torch.cuda.is_available():
            device = f"CUDA step on {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    lines = [
        "# Pipeline benchmark",
        "",
        f"`{' '.join(sys.argv)}`",
        "",
        f"Machine: {len(os.sched_getaffinity(0))} cores usable, {platform.machine()}, kernel "
        f"{platform.release()}; load average before {load_before}, after {load_after}.",
        f"Data: {files} JPEGs, {mb:.0f} MB; local copy by rsync in {rsync_s:.1f} s"
        + (f"; view by `stagefs convert` in {convert_s:.1f} s" if convert_s is not None else "")
        + ".",
        f"Each measurement: {args.warmup} batches untimed, then {args.images} images in batches of "
        f"{args.batch_size}, a {args.step_ms:g} ms training step per batch ({device}); medians of "
        f"{args.rounds} rounds, contenders alternated.",
        "",
        "| contender | cores | images/s | data wait | CPU s / 1000 images |",
        "|---|---:|---:|---:|---:|",
    ]
    rows = {}
    for who in wanted:
        for n in counts:
            ms = results.get((who, n), [])
            rate = med([m["images"] / m["seconds"] for m in ms])
            wait = med([m["wait"] / m["seconds"] for m in ms])
            cpu = med([m["cpu"] / m["images"] * 1000 for m in ms])
            rows[who, n] = (rate, wait, cpu)
            lines.append(f"| {who} | {n} | {rate:.1f} | {wait:.0%} | {cpu:.2f} |")
    for who, why in skipped.items():
        lines.append(f"| {who} | – | {why} | | |")
    if tensors:
        lines += ["", "| file | from | files/s | MB/s | CPU s / 1000 files |", "|---|---|---:|---:|---:|"]
        for (ext, place), vs in sorted(tensors.items()):
            lines.append(f"| `{ext}` ({'torch.load' if ext == '.pt' else 'np.load'}) | {place} | "
                         f"{med([v['files'] / v['seconds'] for v in vs]):.0f} | "
                         f"{med([v['bytes'] / v['seconds'] / 1e6 for v in vs]):.0f} | "
                         f"{med([v['cpu'] / v['files'] * 1000 for v in vs]):.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "pipeline.md"), "w") as f:
        f.write(text)
    print("\n" + text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for who in wanted:
        ax1.plot(counts, [rows[who, n][0] for n in counts], marker="o", label=who)
        ax2.plot(counts, [100 * rows[who, n][1] for n in counts], marker="o", label=who)
    ax1.set(xlabel="cores", ylabel="images/s", title="throughput", xticks=counts, ylim=(0, None))
    ax2.set(xlabel="cores", ylabel="% of step loop waiting for data", title="data wait",
            xticks=counts, ylim=(0, 100))
    ax1.legend()
    fig.suptitle(f"{files} JPEGs, batch {args.batch_size}, {args.step_ms:g} ms step ({device})")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "pipeline.png"), dpi=100)
    print(f"wrote {args.out}/pipeline.md and pipeline.png")


if __name__ == "__main__":
    main()
