"""`stagefs.torch.DistributedSampler` with a real torch DataLoader (2 workers) over an
ImageFolder through a mount started with `--stage-hinted`: the process plays node 1 of 2 (ranks
2 and 3 of 4). Every sample comes exactly once across the 4 ranks, node 1's ranks read one
contiguous run of files, the order equals `stagefs._native.node_order` (the Loader's), and the
mount read from the source only node 1's files (the sampler declared them). Resume mid-epoch
from 2 nodes to 1 covers the rest once."""

import json
import os
import sys

import numpy as np
import pytest

try:
    import torch
    from torch.utils.data import DataLoader, Dataset
    from torchvision import datasets, transforms
except ImportError:
    pytest.skip("skipped: needs torch and torchvision (tests/requirements-torch.txt)",
                allow_module_level=True)

import stagefs
from stagefs import _native

sys.path.insert(0, os.path.dirname(__file__))
from mounting import mounted, stats, wait_stats  # noqa: E402

CLASSES, PER_CLASS = 3, 40
WORLD, LOCAL = 4, 2


class Indexed(Dataset):
    """The ImageFolder's images (decoded, so read through the mount) with their indices."""

    def __init__(self, folder):
        self.folder = folder

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, i):
        image, label = self.folder[i]
        return i, label, image.shape[-1]


@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    from PIL import Image

    base = tmp_path_factory.mktemp("sampler")
    src = base / "src"
    rng = np.random.default_rng(9)
    for c in range(CLASSES):
        d = src / "imgs" / f"class{c}"
        d.mkdir(parents=True)
        for i in range(PER_CLASS):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(d / f"{i:03d}.png")
    mnt, cache = base / "mnt", base / "cache"
    with mounted(src, mnt, cache, "--stage-hinted", "--no-passthrough"):
        yield src, mnt


def test_dataloader_workers_read_this_nodes_files_once(mount):
    src, mnt = mount
    folder = datasets.ImageFolder(str(mnt / "imgs"), transform=transforms.ToTensor())
    n = len(folder)
    # Node 0's samplers stand for the other node's: they must not declare their part to this
    # node's mount (on a cluster they would reach their own node's mount, not this one).
    samplers = [stagefs.torch.DistributedSampler(folder, num_replicas=WORLD, rank=r, seed=4,
                                                 local_world_size=LOCAL, chunk=8,
                                                 hints=r // LOCAL == 1)
                for r in range(WORLD)]
    before = stats(mnt)["source_bytes_read"]
    got = {}
    for r in (2, 3):  # node 1, through the DataLoader and the mount
        samplers[r].set_epoch(1)
        loader = DataLoader(Indexed(folder), batch_size=8, sampler=samplers[r], num_workers=2)
        got[r] = [int(i) for idx, _, width in loader for i in idx]
        assert len(got[r]) == len(samplers[r]) == -(-n // WORLD)
    for r in (0, 1):  # node 0: its order only
        samplers[r].set_epoch(1)
        got[r] = list(samplers[r])
        assert got[r] == _native.node_order(n, True, 4, 0.0, (0, 1, 8), 1, 2, LOCAL, r)
    counts = np.bincount(np.concatenate([got[r] for r in range(WORLD)]), minlength=n)
    assert (counts == 1).all(), "every sample exactly once"
    mine = sorted(got[2] + got[3])
    assert mine == list(range(mine[0], mine[0] + len(mine))), "one contiguous run per node"
    # The mount read node 1's files and nothing of node 0's (small files: whole-file fetches).
    node_bytes = sum(os.path.getsize(folder.samples[i][0].replace(str(mnt), str(src), 1))
                     for i in mine)
    # The stats file is one rendering for up to 1 s (the same one `before` saw, if the epoch
    # was quick): wait for a fresh one.
    s = wait_stats(mnt, lambda s: s["source_bytes_read"] - before >= node_bytes)
    read = s["source_bytes_read"] - before
    print(f"\nnode 1 read {read} bytes from the source for {node_bytes} bytes of its files "
          f"({n} files, {sum(os.path.getsize(p.replace(str(mnt), str(src), 1)) for p, _ in folder.samples)} bytes in all)")
    assert node_bytes <= read <= 1.1 * node_bytes, (read, node_bytes)
    assert s["hints_rejected"] == 0, s["errors"]


def test_resume_from_two_nodes_to_one(mount):
    _, mnt = mount
    folder = datasets.ImageFolder(str(mnt / "imgs"))
    n = len(folder)
    old = [stagefs.torch.DistributedSampler(folder, num_replicas=WORLD, rank=r, seed=4,
                                            local_world_size=LOCAL, exchange=0.5, chunk=8,
                                            hints=False) for r in range(WORLD)]
    seen = []
    for s in old:
        s.set_epoch(2)
        seen += list(s)[:10]
    state = json.loads(json.dumps(old[0].state_dict(consumed=10)))
    new = [stagefs.torch.DistributedSampler(folder, num_replicas=2, rank=r, seed=4,
                                            local_world_size=2, exchange=0.5, chunk=8,
                                            hints=False) for r in range(2)]
    rest = []
    for s in new:
        s.load_state_dict(state)
        assert len(s) == len(list(s))
        rest += list(s)
    counts = np.bincount(np.asarray(seen + rest), minlength=n)
    assert (counts >= 1).all() and counts.sum() - n < WORLD + 2
    with pytest.raises(ValueError, match="exchange"):
        stagefs.torch.DistributedSampler(folder, num_replicas=2, rank=0, seed=4, chunk=8,
                                         local_world_size=2).load_state_dict(state)
