"""stagefs: the GPU streamer inside the training program.

``stagefs.Loader`` reads rows of ``.npy`` files that share their first dimension (a mount's
``images.npy`` and ``labels.npy``, a table's ``features.npy``) in batches, through a ring of
``ring`` buffers filled by reader threads in Rust, and hands each batch over as a tuple of
tensors, one per file, without a copy (DLPack)::

    loader = stagefs.Loader([f"{d}/images.npy", f"{d}/labels.npy"], 256,
                            shuffle=True, seed=0, device="cuda:0",
                            rank=rank, world_size=world_size)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:      # torch tensors on cuda:0, rows aligned
            ...

A batch's memory is one ring slot; it goes back to the readers when the last tensor made from
it is released, so memory stays at ``ring`` batches (on the host, and on the GPU as well). A
tensor kept longer (``kept.append(images)``) keeps its slot: keep ``images.clone()`` instead.
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

from . import _native

__all__ = ["Loader"]

_TENSOR_KINDS = ("torch", "numpy", "dlpack")


class Loader:
    """Batches of aligned rows of ``.npy`` files, one epoch per iteration.

    Arguments:
        paths: ``.npy`` files (format 1.0-3.0, little-endian, C order, numeric or bool) with
            the same first dimension; each batch has one tensor per path, in this order.
        batch_size: rows per batch; the last batch of an epoch is shorter unless ``drop_last``.
        shuffle: visit the rows in a random order, drawn from ``seed`` and the epoch.
        seed: the shuffle's seed (the same seed gives the same order, on any machine).
        drop_last: drop the last, short batch of each epoch.
        device: ``"cpu"`` or ``"cuda:N"``: where the batches are handed over. On a GPU the
            tensors live in device memory written by the streamer's copy stream; the stream you
            use them on waits for that copy (the DLPack protocol), and a slot is reused only
            after the work you queued on it before releasing the tensors.
        rank, world_size: split the rows across data-parallel ranks as PyTorch's
            ``DistributedSampler`` does (padded by repeating rows so every rank gets the same
            number, then every ``world_size``-th row from ``rank``); deterministic per
            (seed, epoch).
        ring: ring slots (batches read ahead, or held by you); memory is ``ring`` batches.
        readers: reader threads.
        tensors: ``"torch"`` (default), ``"numpy"`` (CPU only) or ``"dlpack"`` (the raw
            DLPack producers, for any framework's ``from_dlpack``).
        pin_memory: on ``device="cpu"``, page-lock the ring so ``tensor.cuda(non_blocking=True)``
            is a true asynchronous copy; ``None`` pins when a CUDA driver is present.

    Iterating gives one epoch. Without ``set_epoch`` each iteration advances the epoch by one
    (a fresh shuffle each time); ``set_epoch(e)`` sets the next iteration's epoch, as with
    ``DistributedSampler``. Starting a new iteration stops the previous one.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        ring: int = 4,
        readers: int = 2,
        tensors: str = "torch",
        pin_memory: bool | None = None,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if tensors not in _TENSOR_KINDS:
            raise ValueError(f"tensors={tensors!r}: use one of {', '.join(_TENSOR_KINDS)}")
        device = str(device)
        if tensors == "numpy" and device != "cpu":
            raise ValueError("tensors='numpy' needs device='cpu'")
        for name, value in (("batch_size", batch_size), ("ring", ring), ("readers", readers)):
            if int(value) < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if int(world_size) < 1 or not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank {rank} is not in 0..world_size ({world_size})")
        if int(seed) < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self._convert = _converter(tensors)
        self.paths = [os.fspath(p) for p in paths]
        self.batch_size = int(batch_size)
        self._epoch = 0
        self._native = _native.Loader(
            self.paths, self.batch_size, bool(shuffle), int(seed), bool(drop_last), device,
            int(rank), int(world_size), int(ring), int(readers), pin_memory,
        )

    def __iter__(self) -> Iterator[tuple]:
        epoch = self._native.epoch(self._epoch)
        self._epoch += 1
        return _EpochIterator(epoch, self._convert)

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._native)

    def set_epoch(self, epoch: int) -> None:
        """Makes the next iteration epoch ``epoch`` (its shuffle is drawn from seed and epoch)."""
        if int(epoch) < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        self._epoch = int(epoch)

    def order(self, epoch: int) -> list[int]:
        """The rows this rank visits in ``epoch``, in order (batch i is ``order[i*B:(i+1)*B]``)."""
        return self._native.order(int(epoch))

    def stats(self) -> dict:
        """Who waited on whom, over all epochs so far: the figures of ``stagefs stream --json``.

        ``device_wait_share`` is the share of time the training loop waited for data (near 0:
        storage keeps up); ``ring_full_share`` the share the readers waited for you to release
        a batch (near 1: the loop is the bottleneck, not the data).
        """
        return self._native.stats()

    @property
    def rows(self) -> int:
        """Rows in each file."""
        return self._native.rows

    @property
    def device(self) -> str:
        """The device, in words."""
        return self._native.device

    def close(self) -> None:
        """Stops the running epoch's readers; tensors handed out stay valid."""
        self._native.close()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"stagefs.Loader({self.paths!r}, {self.batch_size}, rows={self.rows}, "
                f"batches={len(self)}, device={self.device!r})")


class _EpochIterator:
    """One epoch: converts each native batch to the caller's tensor kind."""

    def __init__(self, epoch, convert) -> None:
        self._epoch = epoch
        self._convert = convert

    def __iter__(self) -> "_EpochIterator":
        return self

    def __next__(self) -> tuple:
        # No reference to the native batch survives this call: the slot goes back as soon as
        # the caller drops the returned tensors.
        return tuple(self._convert(part) for part in next(self._epoch))

    def close(self) -> None:
        self._epoch.close()


def _converter(kind: str):
    if kind == "dlpack":
        return lambda part: part
    if kind == "numpy":
        import numpy

        return numpy.from_dlpack
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "stagefs.Loader hands out torch tensors by default; install torch, or pass "
            "tensors='numpy' (CPU) or tensors='dlpack'"
        ) from e
    return torch.from_dlpack
