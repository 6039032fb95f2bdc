"""Stand-in training program for the SLURM test (tests/slurm_e2e.sh).

Reads every file under --data (the preprocessed handoff) and records what it saw in
OUT/seen.txt, then "trains": each step rewrites OUT/ckpt.bin in place (so syncs meet a file
being written) and writes OUT/step-N.txt. SIGUSR1 (SLURM's warning, forwarded by stagefs run)
makes it write OUT/ckpt-usr1.txt and keep going; SIGTERM makes it write OUT/final-term.txt and
exit 143, as a real trainer that saves on termination would.
"""

import argparse
import hashlib
import os
import signal
import sys
import time

usr1 = False


def on_usr1(_sig, _frame):
    global usr1
    usr1 = True


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-seconds", type=float, default=0.5)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)

    def on_term(_sig, _frame):
        write(os.path.join(a.out, "final-term.txt"), "saved on SIGTERM\n")
        sys.exit(143)

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_term)

    lines = []
    for root, dirs, files in os.walk(a.data):
        # Skip hidden entries, as data loaders do: the mount adds a `.stagefs/` control dir.
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in sorted(f for f in files if not f.startswith(".")):
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            lines.append(f"{os.path.relpath(path, a.data)} {digest}\n")
    lines.sort()
    write(os.path.join(a.out, "seen.txt"), "".join(lines))

    global usr1
    for step in range(a.steps):
        with open(os.path.join(a.out, "ckpt.bin"), "wb") as f:
            for _ in range(16):
                f.write(bytes([step % 256]) * 65536)
        write(os.path.join(a.out, f"step-{step}.txt"), f"step {step}\n")
        if usr1:
            usr1 = False
            write(os.path.join(a.out, "ckpt-usr1.txt"), f"checkpoint at step {step}\n")
        time.sleep(a.step_seconds)
    write(os.path.join(a.out, "done.txt"), "done\n")


if __name__ == "__main__":
    main()
