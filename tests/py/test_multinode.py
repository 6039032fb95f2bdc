"""Several "nodes" on one machine: 4 unprivileged mounts (as stagefs-test) of one source, each
with its own cache and `--stage-hinted`, two ranks of a node-partitioned `stagefs.Loader` on
each, 3 epochs. Every epoch visits every sample exactly once across the 8 ranks; the mounts
together read the dataset from the source about once (exchange 0) or once plus the exchanged
chunks (exchange 0.25, each epoch's next part staged ahead from its middle), not 4 times as the
global order (exchange 1) does; each cache holds about a quarter of the dataset at exchange 0.

The source is a 128 MiB rows.npy of 4 KiB rows: each node's part is 32 MiB, 4 chunks of the
Loader's 8 MiB, so exchange 0.25 moves one chunk per node per epoch."""

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_loader_mount import BIN  # noqa: E402  (the same `stagefs` binary)

USER = "stagefs-test"
NODES, LOCAL, EPOCHS = 4, 2, 3
ROWS, ROW_INTS = 32768, 512  # 4 KiB rows, 128 MiB of data
# One node's run (two ranks, three epochs of 32 MiB) takes seconds; this bounds a hang.
TIMEOUT = 300


def _user():
    if os.geteuid() != 0:
        pytest.skip("skipped: needs root (to mount as the unprivileged stagefs-test account)")
    try:
        return pwd.getpwnam(USER).pw_uid
    except KeyError:
        pytest.skip(f"skipped: needs the {USER} account (scripts/env.sh creates it)")


def as_user(uid, args, **kw):
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *map(str, args)]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "LOCAL_", "RANK", "WORLD_"))}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, **kw)


def stats(uid, mnt):
    p = as_user(uid, ["cat", f"{mnt}/.stagefs/stats"])
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def settled(uid, mnts):
    """The mounts' stats once nothing is fetched any more (staging may run after the ranks)."""
    last = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = [stats(uid, m) for m in mnts]
        key = [(s["source_bytes_read"], s["fetches_in_flight"]) for s in now]
        if key == last and all(s["fetches_in_flight"] == 0 for s in now):
            return now
        last = key
        time.sleep(0.5)
    return now


@pytest.fixture(scope="module")
def world():
    uid = _user()
    if shutil.which("setpriv") is None:
        pytest.skip("skipped: needs setpriv (util-linux)")
    base = tempfile.mkdtemp(prefix="stagefs-multinode-", dir="/tmp")
    os.chmod(base, 0o755)
    src = os.path.join(base, "src")
    os.mkdir(src)
    data = np.zeros((ROWS, ROW_INTS), dtype=np.int64)
    data[:, 0] = np.arange(ROWS)
    np.save(os.path.join(src, "rows.npy"), data)
    subprocess.run(["chown", "-R", f"{uid}:{uid}", base], check=True)
    try:
        yield uid, base, os.path.getsize(os.path.join(src, "rows.npy"))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_job(uid, base, exchange, nodes=NODES, epochs=EPOCHS):
    """Mounts `nodes` of the NODES nodes, runs their ranks for `epochs` epochs; the rows each
    rank got per epoch and the mounts' settled stats."""
    job = os.path.join(base, f"q{exchange}-n{nodes}-e{epochs}")
    as_user(uid, ["mkdir", "-p", job])
    mnts, ranks = [], []
    try:
        for n in range(nodes):
            mnt, cache = os.path.join(job, f"mnt{n}"), os.path.join(job, f"cache{n}")
            as_user(uid, ["mkdir", "-p", mnt])
            p = as_user(uid, [BIN, "mount", os.path.join(base, "src"), mnt, "--cache", cache,
                              "--stage-hinted"])
            assert p.returncode == 0, f"mount {n}: {p.stderr}"
            mnts.append(mnt)
        for r in range(nodes * LOCAL):
            out = os.path.join(job, f"rank{r}.npz")
            cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                   sys.executable, os.path.join(HERE, "multinode_rank.py"), mnts[r // LOCAL],
                   str(r), str(NODES * LOCAL), str(LOCAL), str(exchange), str(epochs), out]
            ranks.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True), out))
        try:
            for p, _ in ranks:
                text, _ = p.communicate(timeout=TIMEOUT)
                assert p.returncode == 0, text
        finally:
            for p, _ in ranks:  # a hung rank must not outlive the test (nor hold its mount)
                if p.poll() is None:
                    p.kill()
                    p.wait()
        got = []
        for _, out in ranks:
            with np.load(out) as z:
                got.append([z[f"e{e}"] for e in range(epochs)])
        return got, settled(uid, mnts)
    finally:
        for mnt in mnts:
            as_user(uid, [BIN, "umount", mnt])


@pytest.mark.parametrize("exchange", [0.0, 0.25, 1.0])
def test_four_nodes_read_the_dataset_once_in_total(world, exchange):
    uid, base, size = world
    got, st = run_job(uid, base, exchange)
    for e in range(EPOCHS):
        rows = np.concatenate([g[e] for g in got])
        counts = np.bincount(rows, minlength=ROWS)
        # 32768 rows over 8 ranks: no padding, so exactly once.
        assert (counts == 1).all(), f"epoch {e}: {np.sum(counts != 1)} samples not once"
    read = [s["source_bytes_read"] for s in st]
    used = [s["cache_used"] for s in st]
    total = sum(read)
    print(f"\nexchange {exchange}: source_bytes_read per mount {read} (sum {total / size:.3f}x "
          f"the dataset), cache_used per mount {used}")
    if exchange == 1.0:
        # The global order: every node reads (nearly) everything, as before partitions.
        assert total >= 0.9 * NODES * size, f"{total / size:.3f}x"
        return
    # Each epoch exchanges `exchange` of the dataset in, and from its middle each epoch's
    # next part is staged ahead: so the epoch after the last one's too, once (EPOCHS, not
    # EPOCHS - 1, exchanges).
    bound = 1.0 + exchange * EPOCHS + 0.1
    assert total <= bound * size, f"{total / size:.3f}x the dataset read, bound {bound}x"
    # Not vacuous: every node read its own part at least.
    assert all(r >= size / NODES * 0.9 for r in read), read
    if exchange == 0.0:
        assert all(u <= 1.1 * size / NODES for u in used), used
    else:
        # Rows of other nodes' parts did come: each node saw more than its own part.
        for n in range(NODES):
            seen = set()
            for g in got[n * LOCAL:(n + 1) * LOCAL]:
                for e in range(EPOCHS):
                    seen.update(g[e].tolist())
            assert len(seen) > ROWS // NODES


def test_the_next_epochs_part_is_staged_during_this_one(world):
    """Regression: the next epoch's part was not declared ahead, so the chunks it exchanges in
    were read from the source only when its readers asked for them. One node of four reads one
    epoch at exchange 0.25: its mount stages its part and, from the epoch's middle, the next
    epoch's exchanged chunk too (a quarter of a part more)."""
    uid, base, size = world
    got, st = run_job(uid, base, 0.25, nodes=1, epochs=1)
    part = size / NODES
    read = st[0]["source_bytes_read"]
    assert sum(len(g[0]) for g in got) == ROWS // NODES, "the node read its part"
    print(f"\none epoch of one node: {read / part:.3f}x its part read from the source")
    assert read >= (1 + 0.25 * 0.9) * part, f"{read / part:.3f}x the part: next part not staged"
    assert read <= (1 + 0.25 + 0.1) * part, f"{read / part:.3f}x the part"
