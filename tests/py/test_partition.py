"""`stagefs.Loader(partition="node")`: each epoch every sample exactly once across all ranks
(padding as DistributedSampler's), each node inside its own contiguous part at exchange=0,
deterministic, the layout taken from torchrun's/SLURM's environment, and a state saved
mid-epoch on 4 nodes resumed on 2 and on 8 nodes: every remaining sample of the epoch once.
Also `stagefs._native.node_order` (what `stagefs.torch.DistributedSampler` uses) equals the
Loader's order. CPU and numpy only."""

import pickle

import numpy as np
import pytest

import stagefs
from stagefs import _native

NODES, LOCAL = 4, 2
WORLD = NODES * LOCAL


@pytest.fixture(params=[1000, 1001])
def ids(tmp_path, request):
    """Row ids as 4 KiB rows (read row by row, not held in memory: the read path is real)."""
    rows = request.param
    data = np.zeros((rows, 512), dtype=np.int64)
    data[:, 0] = np.arange(rows)
    path = tmp_path / "ids.npy"
    np.save(path, data)
    return str(path), rows


def loaders(path, world, local, **kw):
    kw.setdefault("shuffle", True)
    kw.setdefault("seed", 3)
    return [stagefs.Loader(path, 16, tensors="numpy", readers=2, rank=r, world_size=world,
                           local_world_size=local, partition="node", hints=False, **kw)
            for r in range(world)]


def rows_of(batch):
    return [int(x) for x in batch[0][:, 0]]


def epoch_rows(ls, epoch, stop=None):
    """Each rank's rows of `epoch` (stopping after `stop` batches), and rank 0's state then."""
    out, state = [], None
    for rank, loader in enumerate(ls):
        loader.set_epoch(epoch)
        got = []
        for i, batch in enumerate(loader):
            got += rows_of(batch)
            if stop is not None and i + 1 == stop:
                if rank == 0:
                    state = pickle.loads(pickle.dumps(loader.state_dict()))
                break
        out.append(got)
    return out, state


@pytest.mark.parametrize("exchange", [0.0, 0.25, 1.0])
def test_every_sample_once_per_epoch_and_nodes_keep_their_part(ids, exchange):
    path, rows = ids
    ls = loaders(path, WORLD, LOCAL, exchange=exchange)
    per_rank = -(-rows // WORLD)
    parts = []
    for epoch in range(3):
        got, _ = epoch_rows(ls, epoch)
        assert all(len(g) == per_rank for g in got), "ranks must step in lockstep"
        counts = np.bincount(np.concatenate(got), minlength=rows)
        assert (counts >= 1).all(), f"epoch {epoch}: samples missed"
        assert counts.sum() - rows == per_rank * WORLD - rows  # only the padding repeats
        assert got == [loader.order(epoch) for loader in ls]
        node_sets = [set(got[n * LOCAL]) | set(got[n * LOCAL + 1]) for n in range(NODES)]
        parts.append(node_sets)
        if exchange == 0.0:
            for s in node_sets:  # one contiguous span per node
                assert max(s) - min(s) + 1 == len(s)
    if exchange == 0.0:
        assert parts[0] == parts[1] == parts[2], "q=0: every node keeps its part"
    # The Loader's chunks are 8 MiB (more than this file): the parts move in chunks of 16 rows.
    moved = [_native.node_ranges(rows, 3, exchange, (0, 1, 16), e, NODES, 0) for e in range(2)]
    if exchange < 1.0:
        assert (moved[0] != moved[1]) == (exchange > 0.0)
    else:
        assert moved[0] == [(0, rows)], "q=1: every node may read every sample"
    # The same order from the function the Sampler uses.
    grid = ls[0]._native.grid
    assert grid == (128, 4096, 8 << 20)
    for rank in (0, 5):
        assert _native.node_order(rows, True, 3, exchange, grid, 2, NODES, LOCAL, rank) == \
            ls[rank].order(2)


@pytest.mark.parametrize("new_nodes", [2, 8, 4])
@pytest.mark.parametrize("exchange", [0.0, 0.25])
def test_resume_mid_epoch_on_another_number_of_nodes(ids, new_nodes, exchange):
    path, rows = ids
    old = loaders(path, WORLD, LOCAL, exchange=exchange)
    full, _ = epoch_rows(old, 1)
    done, state = epoch_rows(old, 1, stop=3)
    assert state["partition"]["nodes"] == NODES and state["segments"] == [[4, 2, 3 * 16 * 8]]
    world = new_nodes * LOCAL
    new = loaders(path, world, LOCAL, exchange=exchange)
    for loader in new:
        loader.load_state_dict(state)
    rest, _ = epoch_rows(new, 1)
    assert all(len(r) == len(rest[0]) for r in rest)
    seen = np.bincount(np.concatenate(done), minlength=rows)
    later = np.bincount(np.concatenate(rest), minlength=rows)
    assert ((seen + later) >= 1).all(), "a sample of the epoch was never visited"
    # Fresh samples come once, apart from fewer than one padding position per new rank.
    assert later[seen == 0].sum() - (seen == 0).sum() < world
    if new_nodes == NODES:
        assert rest == [f[3 * 16:] for f in full], "exact resume must continue the epoch"
    # Deterministic, and the next epoch is the new layout's own.
    again = loaders(path, world, LOCAL, exchange=exchange)
    for loader in again:
        loader.load_state_dict(state)
    assert epoch_rows(again, 1)[0] == rest
    nxt, _ = epoch_rows(new, 2)
    assert np.bincount(np.concatenate(nxt), minlength=rows).min() >= 1


def test_layout_from_the_environment(ids, monkeypatch):
    path, _ = ids
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    loader = stagefs.Loader(path, 16, tensors="numpy", rank=3, world_size=8, hints=False)
    assert (loader.nodes, loader.local_world_size) == (4, 2)
    with pytest.raises(ValueError, match="node by node"):
        stagefs.Loader(path, 16, tensors="numpy", rank=2, world_size=8, hints=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    loader = stagefs.Loader(path, 16, tensors="numpy", rank=4, world_size=8, hints=False)
    assert (loader.nodes, loader.local_world_size) == (2, 4)
    with pytest.raises(ValueError, match="SLURM_NODEID"):
        stagefs.Loader(path, 16, tensors="numpy", rank=0, world_size=8, hints=False)


def test_one_node_is_the_global_order_and_states_do_not_mix(ids):
    path, _ = ids
    node = stagefs.Loader(path, 16, tensors="numpy", shuffle=True, rank=1, world_size=3,
                          hints=False)
    glob = stagefs.Loader(path, 16, tensors="numpy", shuffle=True, rank=1, world_size=3,
                          partition="global", hints=False)
    assert node.order(4) == glob.order(4)
    # On one node the states move between the two, mid-epoch too.
    for src, dst in (("global", "node"), ("node", "global")):
        a, b = (stagefs.Loader(path, 16, tensors="numpy", shuffle=True, rank=1, world_size=3,
                               partition=p, hints=False) for p in (src, dst))
        a.set_epoch(2)
        it = iter(a)
        next(it)
        next(it)
        b.load_state_dict(a.state_dict())
        assert list(b.order(2, b._start, b._before)) == a.order(2)[2 * 16:]
    several = stagefs.Loader(path, 16, tensors="numpy", shuffle=True, rank=1, world_size=4,
                             local_world_size=2, hints=False)
    with pytest.raises(ValueError, match="partition"):
        several.load_state_dict(glob.state_dict())
    with pytest.raises(ValueError, match="exchange"):
        stagefs.Loader(path, 16, tensors="numpy", exchange=1.5)
