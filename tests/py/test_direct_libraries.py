"""Under `stagefs run`, the libraries a training job reads with get direct descriptors of
staged large files through the preload library (docs/direct.md): a descriptor read at random
offsets, by a forked child that inherited it and by an exec'd program; numpy (plain and
`mmap_mode="r"`, whose mapping is of the cache's copy), tarfile, PIL, pyarrow, `torch.load` and
a torch DataLoader's forked and spawned workers; every read equals the source's bytes."""

import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_loader_mount import BIN  # noqa: E402  (the mount tests' one stagefs binary)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "direct_libraries.py")
BASE = ["offsets_fork_exec", "numpy", "numpy_mmap", "tarfile", "pil", "pyarrow"]
TORCH = ["torch_load", "torch_workers_fork", "torch_workers_spawn"]


def make_source(src, torch):
    """Files above the 4 MiB of a small file (pinned descriptors over the socket)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(7)
    src.mkdir()
    np.save(src / "x.npy", rng.integers(0, 255, size=(6, 1 << 20), dtype=np.uint8))
    member = rng.integers(0, 255, size=5 << 20, dtype=np.uint8).tobytes()
    (src / "member.bin.orig").write_bytes(member)
    with tarfile.open(src / "d.tar", "w") as t:
        info = tarfile.TarInfo("member.bin")
        info.size = len(member)
        t.addfile(info, open(src / "member.bin.orig", "rb"))
    # Noise does not compress: ~5.9 MB of PNG.
    Image.fromarray(rng.integers(0, 255, size=(1400, 1400, 3), dtype=np.uint8)).save(
        src / "img.png", compress_level=0)
    pq.write_table(pa.table({"v": rng.random(1 << 20)}), src / "t.parquet", compression="none")
    if torch is not None:
        torch.save(torch.from_numpy(rng.random(1 << 20)), src / "t.pt")
    else:  # the DataLoader's file list names it
        (src / "t.pt").write_bytes(member)


def run_checks(tmp_path, checks, torch=None):
    src, mnt, cache = tmp_path / "src", tmp_path / "mnt", tmp_path / "cache"
    make_source(src, torch)
    p = subprocess.run(
        [BIN, "run", "--mount", f"{src}:{mnt}:{cache}", "--", sys.executable, SCRIPT,
         str(mnt), str(src), *checks],
        capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "STAGEFS_DIRECT")})
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {c: "direct" for c in checks}, f"{got}\n{p.stderr}"


def test_offsets_fork_exec_numpy_tarfile_pil_pyarrow_get_direct_descriptors(tmp_path):
    run_checks(tmp_path, BASE)


def test_torch_load_and_dataloader_workers_get_direct_descriptors(tmp_path):
    torch = pytest.importorskip("torch", reason="skipped: needs torch (STAGEFS_TORCH=0 skips it)")
    run_checks(tmp_path, TORCH, torch)
