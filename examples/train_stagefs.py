"""A small model trained on a mount's image view with stagefs.Loader, that survives the time
limit: it checkpoints to --out every --ckpt-every steps and on SLURM's warning (SIGUSR1), and
on restart continues from the newest complete checkpoint found under --resume-from.

    stagefs mount /bigdata/raw $SCRATCH/data --cache $SCRATCH/cache --image-size 80
    python examples/train_stagefs.py $SCRATCH/data/.npy/images/train --steps 200 \\
        --out $SCRATCH/out --resume-from /bigdata/$USER/runs/$SLURM_JOB_ID

The view's images.npy (uint8 [N, S, S, 3], decoded by the mount) and labels.npy are read by
stagefs.Loader's threads, which also augment (RandomResizedCrop + flip, drawn from seed, epoch
and sample, so the same on resume) and normalise to float NCHW: the batch arrives model-ready.

A checkpoint holds model, optimizer and loader state (loader.state_dict(): the position inside
the epoch), so a resumed run trains on exactly the batches the uninterrupted run would have.
On SIGUSR1 the step in progress finishes, a checkpoint is written, and the program exits with
--requeue-exit (42): scripts/train.sh then requeues the job once `stagefs run` has synced the
checkpoint home. On SIGTERM (time limit, scancel) it checkpoints after the step and exits 143.

Each step's samples are logged as a checksum (steps-<restart>.txt in --out) and the final
weights' SHA-256 goes to weights.sha256: tests/slurm_e2e.sh compares them with an uninterrupted
run. On CPU with --threads 1 training is deterministic, so the weights are identical too.
"""

import signal

stop_signal = None


def on_signal(sig, _frame):
    # Only a flag: the step in progress finishes, then the checkpoint is written.
    global stop_signal
    stop_signal = sig


# Before the slow imports: a warning that comes while torch loads must not kill the program.
signal.signal(signal.SIGUSR1, on_signal)
signal.signal(signal.SIGTERM, on_signal)

import argparse  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import torch  # noqa: E402

import stagefs  # noqa: E402


def tiny_model(classes):
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes),
    )


CKPT = re.compile(r"^ckpt-(\d+)\.pt$")


def newest_checkpoint(dirs):
    """The newest checkpoint under `dirs` that loads completely (a file cut short by a kill, or a
    sync temporary, is skipped for the one before it)."""
    found = []
    for d in dirs:
        for path in glob.glob(os.path.join(glob.escape(d), "ckpt-*.pt")):
            m = CKPT.match(os.path.basename(path))
            if m:
                found.append((int(m.group(1)), path))
    for _, path in sorted(found, reverse=True):
        try:
            return path, torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: take the one before
            print(f"skipping incomplete checkpoint {path}: {e}", flush=True)
    return None, None


def save_checkpoint(out, step, model, opt, loader, keep=2):
    """Writes ckpt-STEP.pt atomically (a temporary renamed into place: a reader, or the sync,
    never sees half a file) and keeps the newest `keep` in --out."""
    state = {"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
             "loader": loader.state_dict()}
    path = os.path.join(out, f"ckpt-{step:08d}.pt")
    tmp = os.path.join(out, f".tmp-ckpt-{step:08d}-{os.getpid()}")
    # Private (0600), and O_EXCL: never write through a file or link someone else put there.
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    old = sorted(p for p in glob.glob(os.path.join(glob.escape(out), "ckpt-*.pt"))
                 if CKPT.match(os.path.basename(p)))
    for p in old[:-keep]:
        os.remove(p)
    ld = state["loader"]
    print(f"checkpoint {path}: step {step}, epoch {ld['epoch']}, "
          f"{ld['start']} of {ld['rows']} samples into the epoch", flush=True)
    return path


def weights_sha256(model):
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("view", help="a .npy view directory of an image folder (MNT/.npy/<dir>)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--crop", type=int, default=0,
                   help="RandomResizedCrop size (0: no crop; render the view larger than this)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT"),
                   help="where checkpoints, the step log and weights.sha256 go (default $OUT; none: no checkpoints)")
    p.add_argument("--resume-from", action="append", default=[],
                   help="directory searched for the newest complete checkpoint (persistent storage; "
                        "repeatable; --out is searched too); default $RESUME_FROM")
    p.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every N steps (0: only on signals)")
    p.add_argument("--requeue-exit", type=int, default=42,
                   help="exit status after the checkpoint a SIGUSR1 asked for (scripts/train.sh requeues on it)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (1: bit-reproducible on CPU)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests: a slow step)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    if args.out:
        os.makedirs(args.out, mode=0o700, exist_ok=True)

    classes = len(open(f"{args.view}/classes.txt").read().split())
    augment = dict(transform=stagefs.RandomResizedCrop(args.crop, scale=(0.35, 1), flip=True)) if args.crop else {}
    loader = stagefs.Loader([f"{args.view}/images.npy", f"{args.view}/labels.npy"], args.batch_size,
                            shuffle=True, seed=args.seed, device=args.device,
                            normalize=(stagefs.IMAGENET_MEAN, stagefs.IMAGENET_STD), layout="NCHW",
                            **augment)
    torch.manual_seed(args.seed)
    model = tiny_model(classes).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    step = 0
    dirs = (args.resume_from or [d for d in [os.environ.get("RESUME_FROM")] if d]) + [args.out]
    path, ckpt = newest_checkpoint([d for d in dirs if d])
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        loader.load_state_dict(ckpt["loader"])  # refuses a checkpoint of other data
        step = ckpt["step"]
        ld = ckpt["loader"]
        where = "mid-epoch" if 0 < ld["start"] < ld["rows"] else "at an epoch boundary"
        print(f"resumed from {path}: step {step}, epoch {ld['epoch']}, {where} "
              f"({ld['start']} of {ld['rows']} samples done)", flush=True)

    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    log = open(os.path.join(args.out, f"steps-{restart}-{os.getpid()}.txt") if args.out else os.devnull, "a")
    start = time.perf_counter()
    first = step
    while step < args.steps:
        loader.set_epoch(loader.epoch)  # keeps a restored position inside its epoch
        epoch = loader.epoch
        for images, labels in loader:
            # The samples of this step, as the loader delivered them (after augmentation).
            crc = zlib.crc32(labels.cpu().numpy().tobytes(), zlib.crc32(images.cpu().numpy().tobytes()))
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            log.write(f"{step} {epoch} {crc:08x}\n")
            log.flush()
            if step % 5 == 0 or step == args.steps:
                print(f"step {step:3d}  epoch {epoch}  loss {loss.item():.3f}", flush=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            due = stop_signal is not None or step == args.steps or (args.ckpt_every and step % args.ckpt_every == 0)
            if args.out and due:
                save_checkpoint(args.out, step, model, opt, loader)
            if stop_signal is not None:
                name = signal.Signals(stop_signal).name
                code = args.requeue_exit if stop_signal == signal.SIGUSR1 else 128 + stop_signal
                print(f"{name}: checkpointed at step {step}; exiting {code}", flush=True)
                log.close()
                sys.exit(code)
            if step == args.steps:
                break
    log.close()
    digest = weights_sha256(model)
    if args.out:
        with open(os.path.join(args.out, "weights.sha256"), "w") as f:
            f.write(digest + "\n")
    s = loader.stats()
    print(f"{step - first} steps in {time.perf_counter() - start:.1f} s (step {step} of {args.steps}); "
          f"weights sha256 {digest[:16]}; the loop waited on data {100 * s['device_wait_share']:.0f}% "
          f"of the time ({s['verdict']})", flush=True)


if __name__ == "__main__":
    main()
