"""Time to the first shuffled batch from a fresh mount's image view (issue 12's random access).

    cargo build --release -p stagefs
    python3 bench/bench_images.py --n 300 --rounds 1        # writes the photos once (or any JPEG folder)
    python3 bench/first_batch.py --dir /tmp/stagefs-bench-photos-300 [--user stagefs-test]

Each round mounts DIR with an empty cache (so every image is decoded on demand) and reads
BATCH random slots of `MNT/.npy/images.npy` (seeded by the round) one `pread` each, as a
map-style Dataset's `__getitem__` does, after parsing the `.npy` header, from `--workers`
threads (1: one slot after another; a DataLoader's workers read theirs at once); the figure is the wall
time from opening the file to the last slot read. Run as root, it mounts and reads as `--user`
(an unprivileged mount through fusermount3, the headline path; the reader is the system
`python3`, which that user can run); as anyone else, as itself. The JPEG files stay in the page
cache between rounds: this measures decode scheduling, not the backend. Prints each round
(with the mount's `views_rendered` when the last slot arrived: demand reads plus the
background renderer), the median (goal < 0.5 s) and the 1-minute load average before and
after.
"""

import argparse
import os
import pwd
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs as the mounting user: parse the .npy header, pread N random slots, print the seconds.
READER = r"""
import ast, json, os, random, sys, time
from concurrent.futures import ThreadPoolExecutor
path, n, seed, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = time.perf_counter()
fd = os.open(path, os.O_RDONLY)
head = os.pread(fd, 10, 0)
assert head[:6] == b"\x93NUMPY", "not a .npy file"
hlen = int.from_bytes(head[8:10], "little")
meta = ast.literal_eval(os.pread(fd, hlen, 10).decode("latin1"))
shape = meta["shape"]
slot = 1
for d in shape[1:]:
    slot *= d
start = 10 + hlen
idx = random.Random(seed).sample(range(shape[0]), min(n, shape[0]))
def one(i):
    b = os.pread(fd, slot, start + i * slot)
    assert len(b) == slot, "short read"
    return b.count(0) < len(b)
with ThreadPoolExecutor(workers) as pool:
    nonzero = sum(pool.map(one, idx))
secs = time.perf_counter() - t
os.close(fd)
# Image slots rendered so far (demand reads and the background renderer together).
stats = os.path.join(os.path.dirname(os.path.dirname(path)), ".stagefs", "stats")
rendered = json.load(open(stats)).get("views_rendered", -1)
print(secs, len(idx), nonzero, "x".join(map(str, shape[1:])), rendered)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a folder of images (flat, or an ImageFolder root)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=1, help="reader threads")
    ap.add_argument("--mount-flag", action="append", default=[],
                    help="extra `stagefs mount` flag (repeatable), e.g. --mount-flag=--no-staging")
    ap.add_argument("--user", default="stagefs-test", help="who mounts and reads, when run as root")
    ap.add_argument("--stagefs", default=os.path.join(ROOT, "target", "release", "stagefs"))
    a = ap.parse_args()
    prefix, uid, gid = [], os.getuid(), os.getgid()
    if uid == 0:
        pw = pwd.getpwnam(a.user)
        uid, gid = pw.pw_uid, pw.pw_gid
        prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    python = shutil.which("python3", path="/usr/bin:/bin") or "python3"
    print(f"load average before {os.getloadavg()[0]:.2f}; mounting as uid {uid}; "
          f"{a.workers} reader thread(s); {a.dir}")
    times = []
    for r in range(a.rounds):
        tmp = tempfile.mkdtemp(prefix="stagefs-first-batch-")
        try:
            os.chown(tmp, uid, gid)
            mnt, cache = os.path.join(tmp, "mnt"), os.path.join(tmp, "cache")
            for d in (mnt, cache):
                os.mkdir(d, 0o700)
                os.chown(d, uid, gid)
            run = dict(check=True, cwd="/", capture_output=True, text=True)
            subprocess.run(prefix + [a.stagefs, "mount", a.dir, mnt, "--cache", cache,
                                     "--image-size", str(a.image_size)] + a.mount_flag, **run)
            try:
                out = subprocess.run(prefix + [python, "-c", READER,
                                               os.path.join(mnt, ".npy", "images.npy"),
                                               str(a.batch), str(r), str(a.workers)],
                                 **run).stdout.split()
            finally:
                subprocess.run(prefix + [a.stagefs, "umount", mnt], **run)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        secs, n, nonzero, shape, rendered = (float(out[0]), int(out[1]), int(out[2]), out[3],
                                             int(out[4]))
        assert nonzero == n, f"{n - nonzero} of {n} slots read as zeros"
        times.append(secs)
        print(f"round {r}: {n} random slots of {shape} in {secs:.3f} s; "
              f"{rendered} slots rendered by then", flush=True)
    print(f"median {statistics.median(times):.3f} s (goal < 0.5 s); "
          f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
