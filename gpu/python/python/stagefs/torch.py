"""``stagefs.torch.DistributedSampler``: the node-partitioned order of ``stagefs.Loader`` for
your own ``Dataset`` (an ``ImageFolder``, anything with ``__len__``), as a drop-in for
``torch.utils.data.DistributedSampler``::

    sampler = stagefs.torch.DistributedSampler(dataset, partition="node", exchange=0.0, seed=0)
    loader = DataLoader(dataset, batch_size=256, sampler=sampler, num_workers=8)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            ...

Each node (``rank // local_world_size``) visits a fixed, contiguous run of the dataset's
indices (for ``ImageFolder``: a run of files in directory order), shuffled within the node;
``exchange`` moves that fraction of every node's part to other nodes each epoch, in chunks of
``chunk`` consecutive samples. The order is computed by the same Rust function as the Loader's
(``stagefs._native.node_order``). When the dataset lists its files (``ImageFolder``'s
``samples``) and they lie on a stagefs mount, the sampler declares this node's files to the
mount at each epoch, so the mount stages only them (``stagefs mount --stage-hinted``).
"""

from __future__ import annotations

import json
import math
import os
import socket
from typing import Iterator

import torch.distributed as dist
from torch.utils.data import Sampler

from . import _native
from . import _partition

__all__ = ["DistributedSampler"]

#: Samples per exchanged chunk by default: 64 ImageNet JPEGs (~110 KB each) are ~7 MB, about
#: the Loader's 8 MiB chunk, and a run of 64 files is one directory read for the mount.
CHUNK_SAMPLES = 64
#: Files declared per line to the mount (the daemon's bound on ranges does not apply: one file
#: per line), and how long a write may wait for it.
_SEND_TIMEOUT_S = 10.0


def _default(name: str, env: str, fallback: int) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() if name == "world" else dist.get_rank()
    value = os.environ.get(env)
    return int(value) if value not in (None, "") else fallback


class DistributedSampler(Sampler[int]):
    """Indices of ``dataset`` for one rank, node-partitioned (see the module docs).

    Arguments (as ``torch.utils.data.DistributedSampler`` where the names match):
        dataset: anything with ``len()``.
        num_replicas, rank: default from ``torch.distributed``, else ``WORLD_SIZE``/``RANK``.
        shuffle, seed, drop_last: as DistributedSampler (``drop_last`` cuts each rank to
            ``len(dataset) // num_replicas`` instead of padding).
        partition: ``"node"`` (default) or ``"global"`` (one permutation over all ranks).
        exchange: fraction of each node's part moved to other nodes per epoch (0..1).
        local_world_size: ranks per node; default from ``LOCAL_WORLD_SIZE`` or
            ``SLURM_NNODES``, else one node.
        chunk: samples per exchanged chunk (default ``CHUNK_SAMPLES``).
        hints: declare this node's files to their stagefs mount, when reachable.
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 partition: str = _partition.DEFAULT_PARTITION, exchange: float = 0.0,
                 local_world_size: int | None = None, chunk: int = CHUNK_SAMPLES,
                 hints: bool = True) -> None:
        self.dataset = dataset
        self.num_replicas = int(num_replicas if num_replicas is not None
                                else _default("world", "WORLD_SIZE", 1))
        self.rank = int(rank if rank is not None else _default("rank", "RANK", 0))
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in 0..num_replicas ({self.num_replicas})")
        if int(seed) < 0 or int(chunk) < 1:
            raise ValueError(f"seed must be >= 0 and chunk >= 1, got {seed}, {chunk}")
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.partition = partition
        self.local_world_size, self.exchange = _partition.resolve(
            partition, exchange, self.rank, self.num_replicas, local_world_size)
        self.nodes = self.num_replicas // self.local_world_size
        self.rows = len(dataset)
        self.grid = (0, 1, int(chunk))
        self.hints = bool(hints)
        self.epoch = 0
        # Earlier runs of the current epoch, (nodes, local_world_size, consumed), once resumed.
        self._before: list = []
        self._yielded = 0
        self._declared: int | None = None

    def _order(self) -> list[int]:
        order = _native.node_order(self.rows, self.shuffle, self.seed, self.exchange, self.grid,
                                   self.epoch, self.nodes, self.local_world_size, self.rank,
                                   self._before)
        if self.drop_last and not self._before:
            order = order[:self.rows // self.num_replicas]
        return order

    def __iter__(self) -> Iterator[int]:
        self._declare()
        order = self._order()
        self._yielded = 0
        for i in order:
            self._yielded += 1
            yield int(i)

    def __len__(self) -> int:
        if not self._before:
            per = (self.rows // self.num_replicas if self.drop_last
                   else math.ceil(self.rows / self.num_replicas))
            return per
        return len(self._order())

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next iteration (its shuffle and exchange are drawn from it)."""
        if int(epoch) != self.epoch:
            self._before = []
        self.epoch = int(epoch)

    def state_dict(self, consumed: int | None = None) -> dict:
        """The position in the epoch: ``consumed`` samples of this rank are done (default: all
        it handed out; a ``DataLoader`` with workers fetches ahead, so pass ``steps *
        batch_size`` to resume exactly after the last step). Ranks step in lockstep: any rank's
        state is the state."""
        done = self._yielded if consumed is None else int(consumed)
        return {
            "epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle,
            "rows": self.rows,
            "partition": {"mode": self.partition, "exchange": self.exchange,
                          "grid": list(self.grid), "nodes": self.nodes,
                          "local_world_size": self.local_world_size},
            "segments": [list(s) for s in self._before]
            + [[self.nodes, self.local_world_size, done * self.num_replicas]],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues the saved epoch: every sample of it not yet visited comes exactly once
        across the ranks, under this sampler's (possibly different) number of nodes."""
        mine = {"seed": self.seed, "shuffle": self.shuffle, "rows": self.rows}
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(f"this state was saved with {key}={state.get(key)!r}, this "
                                 f"sampler has {key}={value!r}: the epoch's order would differ")
        saved = state.get("partition") or {}
        for key, value in (("mode", self.partition), ("exchange", self.exchange),
                           ("grid", list(self.grid))):
            if saved.get(key) != value:
                raise ValueError(f"this state was saved with {key}={saved.get(key)!r}, this "
                                 f"sampler has {value!r}: the epoch's order would differ")
        self.epoch = int(state["epoch"])
        self._before = [tuple(int(x) for x in s) for s in state.get("segments", [])]
        self._yielded = 0

    def _declare(self) -> None:
        """Tells the mount holding the dataset's files which of them this node reads this
        epoch (once per epoch and process; never an error)."""
        if not self.hints or self._declared == self.epoch or self.partition != "node":
            return
        self._declared = self.epoch
        samples = getattr(self.dataset, "samples", None)
        if not samples or self.nodes < 2:
            return
        try:
            _declare_files(samples, _native.node_ranges(
                self.rows, self.seed, self.exchange, self.grid, self.epoch, self.nodes,
                self.rank // self.local_world_size), self.epoch)
        except (OSError, ValueError, TypeError):
            pass  # Hints are an optimisation only.


def _mount_of(path: str):
    """(mount root, hint socket) of the stagefs mount holding ``path``, or None; the socket
    must be this user's (as ``gpu/src/hints.rs`` checks)."""
    d = os.path.dirname(os.path.realpath(path))
    while True:
        stats = os.path.join(d, ".stagefs", "stats")
        parent = os.path.dirname(d)
        if os.path.isfile(stats) and os.stat(d).st_dev != os.stat(parent).st_dev:
            with open(stats) as f:
                sock = json.loads(f.read(1 << 20)).get("hint_socket")
            if sock and os.lstat(sock).st_uid == os.getuid():
                return d, sock
            return None
        if parent == d:
            return None
        d = parent


def _declare_files(samples, ranges, generation: int) -> None:
    first = samples[0][0] if isinstance(samples[0], (tuple, list)) else samples[0]
    found = _mount_of(first)
    if found is None:
        return
    root, sock = found
    lines = []
    for start, end in ranges:
        for i in range(start, end):
            s = samples[i]
            path = os.path.realpath(s[0] if isinstance(s, (tuple, list)) else s)
            rel = os.path.relpath(path, root)
            if rel.startswith(".."):
                continue
            size = os.stat(path).st_size
            lines.append(json.dumps({"path": rel, "scope": generation, "ranges": [[0, size]]}))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.settimeout(_SEND_TIMEOUT_S)
        c.connect(sock)
        c.sendall(("\n".join(lines) + "\n").encode())
