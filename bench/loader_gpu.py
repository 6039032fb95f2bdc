#!/usr/bin/env python3
"""stagefs.Loader -> cuda:N on a GPU machine: GB/s against the pinned copy peak, and the share of
time a consumer running at 0.9x that peak waited for data. Called by scripts/gpu-check.sh.

    python3 bench/loader_gpu.py FILE.npy --device cuda:0 --peak-gbps 25.1 [--epochs 3]
        [--readers R] [--ring K]   (default: the Loader's own defaults)

Needs only the built package on PYTHONPATH (gpu/python/python with _native*.so): with torch
installed the batches are taken with torch.from_dlpack on a side stream and checksummed on the
device against the file; without torch the DLPack capsules are taken raw and the consumer is
emulated by sleeping bytes / rate per batch (as `stagefs stream --consume-gbps` does).
Prints one JSON object per measurement.
"""

import argparse
import json
import time

import stagefs

VERIFY_EVERY = 16  # batches between two checksummed on the device (inside the timed loop)

try:
    import torch
except ImportError:
    torch = None


def run(path, device, batch, epochs, consume_gbps, verify, readers, ring):
    tensors = "torch" if torch is not None else "dlpack"
    loader = stagefs.Loader([path], batch, shuffle=True, seed=0, device=device, ring=ring,
                            readers=readers, tensors=tensors)
    mismatches = checked = 0
    want = None
    if verify and torch is not None:
        import numpy as np

        want = np.load(path, mmap_mode="r")
    start = time.perf_counter()
    nbytes = 0
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        order = loader.order(epoch)
        for i, (x,) in enumerate(loader):
            if tensors == "dlpack":
                x.__dlpack__(stream=None)  # what a consumer does: wait for the copy, take it
                n = x.shape[0] * (x.shape[1] if len(x.shape) > 1 else 1)
            else:
                n = x.numel() * x.element_size()
                if want is not None and i % VERIFY_EVERY == 0:
                    rows = order[i * batch:(i + 1) * batch]
                    ref = torch.from_numpy(want[rows]).to(device)
                    checked += 1
                    mismatches += int(not torch.equal(x, ref))
            nbytes += n
            if consume_gbps:
                time.sleep(n / (consume_gbps * 1e9))
    if torch is not None:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    s = loader.stats()
    return {"gb_per_s": nbytes / 1e9 / wall, "seconds": wall, "bytes": nbytes,
            "consume_gbps": consume_gbps, "device_wait_share": s["device_wait_share"],
            "ring_full_share": s["ring_full_share"], "verdict": s["verdict"], "tensors": tensors,
            "verified_batches": checked, "verify_mismatches": mismatches, "readers": s["readers"],
            "ring": s["ring"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batch", type=int, default=64, help="rows per batch (1 MiB rows: 64 MiB)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--peak-gbps", type=float, default=0.0)
    p.add_argument("--readers", type=int, help="[default: the Loader's]")
    p.add_argument("--ring", type=int, help="batches in flight [default: the Loader's]")
    p.add_argument("--no-verify", action="store_true", help="time the loader alone")
    args = p.parse_args()
    fast = run(args.file, args.device, args.batch, args.epochs, None, not args.no_verify, args.readers,
               args.ring)
    fast["name"] = "loader_page_cache"
    print(json.dumps(fast, separators=(",", ":")), flush=True)
    if args.peak_gbps > 0:
        paced = run(args.file, args.device, args.batch, args.epochs, 0.9 * args.peak_gbps, False,
                    args.readers, args.ring)
        paced["name"] = f"loader_consumer_at_{0.9 * args.peak_gbps:.2f}GBps"
        print(json.dumps(paced, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
