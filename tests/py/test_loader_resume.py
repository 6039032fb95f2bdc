"""`stagefs.Loader.state_dict` / `load_state_dict`: interrupted at random positions and resumed,
a run delivers exactly the batches (per-batch checksums) of the uninterrupted run, for several
(batch size, world size, drop_last, shuffle); under another world size (4 -> 2, 2 -> 3) every
sample not yet seen in the epoch comes exactly once; a state for other files, another seed or
another shuffle is refused. CPU and numpy only."""

import pickle
import random
import zlib

import numpy as np
import pytest

import stagefs

ROWS = 103  # a prime: no batch size or world size divides it
EPOCHS = 2


@pytest.fixture
def files(tmp_path):
    """Row ids (to know which samples came) and images (to checksum what came)."""
    rng = np.random.default_rng(1)
    ids = tmp_path / "ids.npy"
    images = tmp_path / "images.npy"
    np.save(ids, np.arange(ROWS, dtype=np.int64))
    np.save(images, rng.integers(0, 256, size=(ROWS, 6, 5, 3), dtype=np.uint8))
    return [str(ids), str(images)]


def make(paths, batch_size, **kw):
    kw.setdefault("readers", 3)
    return stagefs.Loader(paths, batch_size, tensors="numpy", **kw)


def checksum(batch):
    crc = 0
    for part in batch:
        crc = zlib.crc32(np.ascontiguousarray(part).tobytes(), crc)
    return crc


def run(loader, stop_after=None):
    """Steps through epochs `loader.epoch..EPOCHS` as a training loop does; returns the batches'
    checksums and the loader's state after `stop_after` steps (None: to the end)."""
    sums = []
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            sums.append(checksum(batch))
            if stop_after is not None and len(sums) == stop_after:
                # Round trip through pickle, as torch.save does.
                return sums, pickle.loads(pickle.dumps(loader.state_dict()))
    return sums, None


COMBOS = [
    (1, 1, False, True),
    (7, 1, False, False),
    (7, 1, True, True),
    (10, 3, False, True),
    (10, 3, True, False),
    (32, 2, True, True),
    (32, 4, False, True),
    (200, 2, False, True),
]


@pytest.mark.parametrize("batch_size,world_size,drop_last,shuffle", COMBOS)
def test_interrupted_runs_deliver_the_uninterrupted_batches(files, batch_size, world_size, drop_last, shuffle):
    rnd = random.Random(f"{batch_size}-{world_size}-{drop_last}-{shuffle}")
    kw = dict(world_size=world_size, drop_last=drop_last, shuffle=shuffle, seed=5)
    for rank in range(world_size):
        full, _ = run(make(files, batch_size, rank=rank, **kw))
        assert len(full) == EPOCHS * len(make(files, batch_size, rank=rank, **kw))
        for _ in range(4):
            # Two interruptions at random steps (0: before the first step).
            cuts = sorted(rnd.randrange(0, len(full) + 1) for _ in range(2))
            got, state, done = [], None, 0
            for cut in cuts + [None]:
                loader = make(files, batch_size, rank=rank, **kw)
                if state is not None:
                    loader.load_state_dict(state)
                part, state = run(loader, None if cut is None else cut - done)
                got += part
                done = len(got)
                if cut is not None and state is None:
                    break  # the run ended before the cut
                loader.close()
            assert got == full, f"rank {rank}, cuts {cuts}"


def test_state_after_a_finished_epoch_starts_the_next(files):
    loader = make(files, 10)
    for _ in loader:
        pass
    state = loader.state_dict()
    assert (state["epoch"], state["start"]) == (1, 0)
    resumed = make(files, 10)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1


def rows_of(loader):
    return [int(r) for ids, _ in loader for r in ids]


@pytest.mark.parametrize("old,new,steps", [(4, 2, 2), (2, 3, 3), (4, 2, 5), (3, 1, 1)])
def test_elastic_resume_delivers_each_unseen_sample_once(files, old, new, steps):
    b = 5
    kw = dict(shuffle=True, seed=9)
    seen = []
    states = []
    for rank in range(old):
        loader = make(files, b, rank=rank, world_size=old, **kw)
        it = iter(loader)
        for _ in range(steps):
            seen += [int(r) for r in next(it)[0]]
        states.append(loader.state_dict())
        loader.close()
    # Every rank's state is the same state (ranks step in lockstep).
    assert all(s == states[0] for s in states)
    assert len(seen) == steps * b * old
    later = []
    for rank in range(new):
        loader = make(files, b, rank=rank, world_size=new, **kw)
        loader.load_state_dict(states[0])
        assert loader.epoch == 0
        later += rows_of(loader)  # the rest of epoch 0
        # The next epoch is the new world size's own epoch 1.
        fresh = make(files, b, rank=rank, world_size=new, **kw)
        fresh.set_epoch(1)
        assert rows_of(loader) == rows_of(fresh)
    unseen = sorted(set(range(ROWS)) - set(seen))
    counts = {r: later.count(r) for r in unseen}
    assert all(c == 1 for c in counts.values()), {r: c for r, c in counts.items() if c != 1}
    assert sorted(r for r in later if r in counts) == unseen
    # The rest are padding (so every rank steps equally): fewer than `new`, from seen rows
    # once some were seen.
    padding = [r for r in later if r not in counts]
    assert len(padding) < new
    if len(seen) >= new:
        assert set(padding) <= set(seen)


def test_a_state_for_other_files_is_refused(files, tmp_path):
    loader = make(files, 10)
    next(iter(loader))
    state = loader.state_dict()
    other = tmp_path / "other"
    other.mkdir()
    ids = np.load(files[0])
    images = np.load(files[1])
    images[50, 0, 0, 0] ^= 1  # same size, one byte apart, in the middle: not in the checksum
    images[-1, 0, 0, 0] ^= 1  # the last row: in the checksum
    np.save(other / "ids.npy", ids)
    np.save(other / "images.npy", images)
    with pytest.raises(ValueError, match="other files.*images.npy"):
        make([str(other / "ids.npy"), str(other / "images.npy")], 10).load_state_dict(state)
    with pytest.raises(ValueError, match="for 2 files, this loader reads 1"):
        make(files[:1], 10).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0"):
        make(files, 10, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        make(files, 10, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        make(files, 10).load_state_dict({"version": 99})
    # The same files under another path (another node's mount) are the same files.
    copy = tmp_path / "copy"
    copy.mkdir()
    np.save(copy / "ids.npy", ids)
    np.save(copy / "images.npy", np.load(files[1]))
    make([str(copy / "ids.npy"), str(copy / "images.npy")], 10).load_state_dict(state)
