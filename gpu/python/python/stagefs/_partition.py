"""The node layout of a data-parallel job, shared by ``stagefs.Loader`` and
``stagefs.torch.DistributedSampler``.

A rank's node is ``rank // local_world_size``: ranks are numbered node by node, as torchrun and
srun number them. ``local_world_size`` comes from the argument or, when it is not given, from
the environment: torchrun's ``LOCAL_WORLD_SIZE``, else SLURM's ``SLURM_NNODES`` (ranks per node
= world size / nodes). Without either the job is taken to run on one node. The environment's
``LOCAL_RANK`` / ``SLURM_LOCALID`` and ``SLURM_NODEID``, when set, are checked against that
numbering, so a job whose ranks are numbered otherwise fails at once instead of reading the
wrong part.

The order itself is computed in Rust (``stagefs._native.node_order``), once for both.
"""

from __future__ import annotations

import os

#: The values ``partition`` takes.
PARTITIONS = ("node", "global")
#: The default partition: each node reads its own part (see docs/multi-node.md for why).
DEFAULT_PARTITION = "node"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def resolve(partition: str, exchange: float, rank: int, world_size: int,
            local_world_size: int | None) -> tuple[int, float]:
    """``(local_world_size, exchange)`` for a job of ``world_size`` ranks, checked; for
    ``partition="global"`` the exchange is 1 (every node may read every row)."""
    if partition not in PARTITIONS:
        raise ValueError(f"partition={partition!r}: use one of {', '.join(PARTITIONS)}")
    exchange = float(exchange)
    if not 0.0 <= exchange <= 1.0:
        raise ValueError(f"exchange={exchange} is not in [0, 1]")
    if local_world_size is None:
        local_world_size = _env_int("LOCAL_WORLD_SIZE")
    if local_world_size is None:
        nnodes = _env_int("SLURM_NNODES")
        if nnodes:
            if world_size % nnodes:
                raise ValueError(
                    f"world_size {world_size} is not a multiple of SLURM_NNODES={nnodes}: "
                    f"pass local_world_size")
            local_world_size = world_size // nnodes
    if local_world_size is None:
        local_world_size = world_size
    local_world_size = int(local_world_size)
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"local_world_size {local_world_size} does not divide world_size {world_size}")
    local = _env_int("LOCAL_RANK")
    if local is None:
        local = _env_int("SLURM_LOCALID")
    if local is not None and world_size > 1 and local != rank % local_world_size:
        raise ValueError(
            f"rank {rank} with {local_world_size} ranks per node should be local rank "
            f"{rank % local_world_size}, but the environment says {local}: number the ranks "
            f"node by node, or pass local_world_size")
    node = _env_int("SLURM_NODEID")
    if node is not None and world_size > 1 and _env_int("SLURM_NNODES") == \
            world_size // local_world_size and node != rank // local_world_size:
        raise ValueError(
            f"rank {rank} with {local_world_size} ranks per node is on node "
            f"{rank // local_world_size}, but SLURM_NODEID={node}: number the ranks node by node")
    return local_world_size, (exchange if partition == "node" else 1.0)
