"""The Loader through a real mount: batches of `MNT/.npy/<dir>/images.npy` + `labels.npy`
equal the same Loader over `stagefs convert --to npy`'s files, and over numpy's own reading."""

import os
import subprocess
import sys

import numpy as np
import pytest

import stagefs

sys.path.insert(0, os.path.dirname(__file__))
import gen_dataset  # noqa: E402

from mounting import BIN, ROOT, stagefs_cli  # noqa: E402,F401  (BIN: other tests import it here)

SIZE = 32


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    base = tmp_path_factory.mktemp("loader-mount")
    src = base / "src"
    gen_dataset.make_images(str(src), np.random.default_rng(gen_dataset.SEED))
    out = base / "converted"
    stagefs_cli("convert", src / "images" / "train", out, "--to", "npy", "--image-size", SIZE, "--allow-bad", "-q")
    mnt, cache = base / "mnt", base / "cache"
    mnt.mkdir()
    stagefs_cli("mount", src, mnt, "--cache", cache, "--image-size", SIZE)
    try:
        yield mnt / ".npy" / "images" / "train", out
    finally:
        stagefs_cli("umount", mnt)


def epoch(paths, **kw):
    ld = stagefs.Loader([str(p) for p in paths], 5, tensors="numpy", ring=3, **kw)
    return [tuple(t.copy() for t in batch) for batch in ld]


def test_loader_over_the_mount_equals_loader_over_convert(views):
    mounted, converted = views
    names = ["images.npy", "labels.npy"]
    conv_dir = converted  # convert writes the given folder's view at the top of OUT
    for kw in [{}, {"shuffle": True, "seed": 4}, {"shuffle": True, "seed": 4, "rank": 1, "world_size": 2}]:
        a = epoch([mounted / n for n in names], **kw)
        b = epoch([conv_dir / n for n in names], **kw)
        assert len(a) == len(b) > 1
        for (ia, la), (ib, lb) in zip(a, b):
            assert ia.shape[1:] == (SIZE, SIZE, 3) and ia.dtype == np.uint8
            np.testing.assert_array_equal(ia, ib)
            np.testing.assert_array_equal(la, lb)
    # And both equal numpy's own reading of the mounted view.
    images = np.load(mounted / "images.npy", mmap_mode="r")
    flat = np.concatenate([i for i, _ in epoch([mounted / n for n in names])])
    np.testing.assert_array_equal(flat, images)
    assert len(set(np.load(mounted / "labels.npy").tolist())) == 3


def test_examples_train_through_the_mount(views):
    """examples/: the same tiny model trained a few steps with stagefs.Loader on the view and
    with torchvision's ImageFolder + DataLoader on the raw folder, both through the mount."""
    pytest.importorskip("torch", reason="needs torch (pip install torch)")
    pytest.importorskip("torchvision", reason="needs torchvision")
    mounted, _ = views
    raw = mounted.parent.parent.parent / "images" / "train"  # MNT/.npy/images/train -> MNT/images/train
    examples = os.path.join(ROOT, "examples")
    runs = [
        ["train_stagefs.py", str(mounted), "--steps", "3", "--batch-size", "4", "--device", "cpu"],
        ["train_imagefolder.py", str(raw), "--steps", "3", "--batch-size", "4", "--image-size", str(SIZE),
         "--workers", "1", "--device", "cpu"],
    ]
    for script, *args in runs:
        p = subprocess.run([sys.executable, os.path.join(examples, script), *args], capture_output=True,
                           text=True, timeout=300, cwd=examples)
        assert p.returncode == 0, f"{script}: {p.stdout}\n{p.stderr}"
        assert "step   3" in p.stdout and "3 steps in" in p.stdout, p.stdout
