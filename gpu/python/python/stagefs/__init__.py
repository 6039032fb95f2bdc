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

Augmentation runs in the Rust reader threads, deterministically (drawn from seed, epoch and
sample index), and the loader's position can be saved and restored mid-epoch, also under another
world size::

    loader = stagefs.Loader([f"{d}/images.npy", f"{d}/labels.npy"], 256, shuffle=True,
                            transform=stagefs.RandomResizedCrop(224, flip=True),
                            normalize=(stagefs.IMAGENET_MEAN, stagefs.IMAGENET_STD),
                            dtype="float16", layout="NCHW")
    loader.load_state_dict(checkpoint["loader"])      # on restart
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)                       # keeps the restored position
        for images, labels in loader:
            ...
            checkpoint = {"loader": loader.state_dict(), ...}   # beside model and optimizer

A batch's memory is one ring slot; it goes back to the readers when the last tensor made from
it is released, so memory stays at ``ring`` batches (on the host, and on the GPU as well). A
tensor kept longer (``kept.append(images)``) keeps its slot: keep ``images.clone()`` instead.
"""

from __future__ import annotations

import os
import zlib
from typing import Iterator, Sequence

from . import _native
from . import _partition

__all__ = ["Loader", "RandomResizedCrop", "CenterCrop", "IMAGENET_MEAN", "IMAGENET_STD"]

_TENSOR_KINDS = ("torch", "numpy", "dlpack")
_DTYPES = ("uint8", "float16", "float32")
_LAYOUTS = ("NHWC", "NCHW")
#: The ImageNet statistics torchvision's recipes normalise with (0..1 scale, RGB).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
#: See ``IMAGENET_MEAN``.
IMAGENET_STD = (0.229, 0.224, 0.225)
#: Version of ``Loader.state_dict``'s layout.
_STATE_VERSION = 1
#: Bytes at each end of a file that its fingerprint checksums: the header and the first and last
#: rows, enough to tell datasets apart without reading them (a view renders only those rows).
_FINGERPRINT_BYTES = 64 << 10
# Reader threads by default: one per core this process may run on, at most 8. Each reader's
# copy out of the page cache is 3-4 GB/s of CPU work; on the H200 machine (16 cores, 55 GB/s
# pinned peak; scripts/gpu-sweep.sh, 2026-12-04) 2 readers moved 9.8 GB/s, 8 moved 26 and 16
# moved 31: 8 feed a GPU faster than training consumes and leave the rest of the cores to the
# training program.
_MAX_AUTO_READERS = 8
# Ring slots beyond the readers' by default: a batch being copied to the GPU and one held by
# the training step, so no reader waits for a slot while the step runs.
_RING_SPARE = 2


class RandomResizedCrop:
    """torchvision's ``RandomResizedCrop(size, scale, ratio)`` (+ ``RandomHorizontalFlip`` with
    ``flip=True``), applied by the loader's reader threads to each uint8 ``[H, W, C]`` row of the
    first file, resized with the image views' antialiased filter (Pillow's BILINEAR).

    The window and flip of a sample are drawn from (seed, epoch, sample index): the same on
    resume, with any number of readers, on any machine (``crop_box`` shows them).
    """

    _kind = "random_resized"

    def __init__(self, size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: bool = False):
        self.size = int(size)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.flip = bool(flip)

    def _args(self, normalize=None, dtype="uint8", layout="NHWC") -> tuple:
        mean, std = (None, None) if normalize is None else (
            [float(m) for m in normalize[0]], [float(s) for s in normalize[1]])
        return (self._kind, self.size, self.scale, self.ratio, self.flip, mean, std, dtype, layout)

    def crop_box(self, seed: int, epoch: int, row: int, height: int, width: int) -> tuple:
        """``(top, left, height, width, flip)`` of sample ``row`` in ``epoch`` for images of
        ``height × width``: the window the readers resize (to ``size × size``), then mirror."""
        return _native.crop_box(self._args(), int(seed), int(epoch), int(row), int(height), int(width))

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self._args() == other._args()

    def __repr__(self) -> str:
        return (f"stagefs.RandomResizedCrop({self.size}, scale={self.scale}, "
                f"ratio={self.ratio}, flip={self.flip})")


class CenterCrop(RandomResizedCrop):
    """torchvision's ``CenterCrop(size)`` (evaluation): the centred ``size × size`` window of
    each image row, no resize; render the view larger (``--image-size 256``) to crop 224."""

    _kind = "center"

    def __init__(self, size: int):
        super().__init__(size)

    def __repr__(self) -> str:
        return f"stagefs.CenterCrop({self.size})"


class _Full(RandomResizedCrop):
    """The whole image (only normalize / dtype / layout apply)."""

    _kind = "full"

    def __init__(self):
        super().__init__(1)


def _auto_readers() -> int:
    """The default reader count: the cores this process may use (SLURM's binding included)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 2
    return max(2, min(cores, _MAX_AUTO_READERS))


def _dtype_name(dtype) -> str:
    # Accepts "float16", numpy.float16, numpy.dtype("float16") and torch.float16.
    name = str(getattr(dtype, "__name__", dtype)).replace("torch.", "")
    name = {"half": "float16", "float": "float32"}.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(_DTYPES)}")
    return name


def _is_int(v) -> bool:
    """An integer of a saved state (``bool`` is an ``int`` to Python, not to a state)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _fingerprint(path: str) -> dict:
    """A file's identity for ``load_state_dict``: its size and a CRC-32 of its first and last
    ``_FINGERPRINT_BYTES`` (the ``.npy`` header and the first and last rows). Not its mtime or
    path: a checkpoint resumed on another node sees the same dataset through another mount, and
    a view's mtime is that of its render."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        crc = zlib.crc32(f.read(_FINGERPRINT_BYTES))
        if size > _FINGERPRINT_BYTES:
            f.seek(max(_FINGERPRINT_BYTES, size - _FINGERPRINT_BYTES))
            crc = zlib.crc32(f.read(_FINGERPRINT_BYTES), crc)
    return {"name": os.path.basename(path), "size": size, "crc32": crc}


def _direct_default() -> bool:
    """Direct reads unless the environment turns them off (``STAGEFS_DIRECT=0``)."""
    return os.environ.get("STAGEFS_DIRECT") != "0"


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
        ring: ring slots (batches read ahead, or held by you); memory is ``ring`` batches
            (default: ``readers + 2``, at least 4).
        readers: reader threads (default: the cores this process may use, 2 to 8; each
            copies 3-4 GB/s out of the page cache, so a GPU fed at tens of GB/s needs several).
        tensors: ``"torch"`` (default), ``"numpy"`` (CPU only) or ``"dlpack"`` (the raw
            DLPack producers, for any framework's ``from_dlpack``).
        pin_memory: on ``device="cpu"``, page-lock the ring so ``tensor.cuda(non_blocking=True)``
            is a true asynchronous copy; ``None`` pins when a CUDA driver is present.
        transform: ``RandomResizedCrop`` or ``CenterCrop``, applied to each row of the first
            file (uint8 ``[H, W]`` or ``[H, W, 1|3]`` images) by the reader threads.
        normalize: ``(mean, std)`` per channel on the 0..1 scale (``IMAGENET_MEAN``,
            ``IMAGENET_STD``): the first file's rows become ``(x / 255 - mean) / std``.
        dtype: of the first file's batches: ``uint8`` (default without ``normalize``),
            ``float32`` (default with it) or ``float16``; floats without ``normalize`` are
            ``x / 255``.
        layout: ``"NHWC"`` (the view's, default) or ``"NCHW"`` (what convolutions take).
        hints: when the files live on a stagefs mount, tell its daemon which rows are read
            next (a few batches ahead of the readers), so it fetches, renders and pushes them
            in that order; ``False`` turns it off. A mount without the hint socket (or a
            broken one) just means no hints, never an error.
        direct: files on a stagefs mount whose verified copy is in the mount's cache are read
            through a read-only descriptor of that copy, at local speed, instead of through
            FUSE; any other file reads through the mount, silently, with the reason in
            ``stats()["direct_fallbacks"]``. ``False`` turns it off; the default (``None``)
            is on unless the environment says ``STAGEFS_DIRECT=0`` (as ``stagefs run
            --no-direct`` sets it for its command).
        partition: ``"node"`` (default): each node (``rank // local_world_size``) reads a
            fixed, contiguous part of the rows, shuffled within the node, so N nodes' mounts
            read the dataset once in total; ``"global"``: one permutation split across all
            ranks (``DistributedSampler``). On one node the two are alike (docs/multi-node.md).
        exchange: with ``partition="node"``, the fraction (0..1) of each node's part that
            moves to other nodes each epoch, in chunks of ~8 MiB (1: the global order).
        local_world_size: ranks per node; default from ``LOCAL_WORLD_SIZE`` (torchrun) or
            ``SLURM_NNODES`` (srun), else all ranks on one node.

    The position can be saved with ``state_dict()`` and restored with ``load_state_dict()``
    (mid-epoch, also under another ``world_size``); ``epoch`` is the next epoch to iterate.

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
        ring: int | None = None,
        readers: int | None = None,
        tensors: str = "torch",
        pin_memory: bool | None = None,
        transform: RandomResizedCrop | None = None,
        normalize: tuple | None = None,
        dtype=None,
        layout: str = "NHWC",
        hints: bool = True,
        direct: bool | None = None,
        partition: str = _partition.DEFAULT_PARTITION,
        exchange: float = 0.0,
        local_world_size: int | None = None,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if tensors not in _TENSOR_KINDS:
            raise ValueError(f"tensors={tensors!r}: use one of {', '.join(_TENSOR_KINDS)}")
        device = str(device)
        if tensors == "numpy" and device != "cpu":
            raise ValueError("tensors='numpy' needs device='cpu'")
        if readers is None:
            readers = _auto_readers()
        if ring is None:
            ring = max(4, int(readers) + _RING_SPARE)
        for name, value in (("batch_size", batch_size), ("ring", ring), ("readers", readers)):
            if int(value) < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if int(world_size) < 1 or not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank {rank} is not in 0..world_size ({world_size})")
        if int(seed) < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        if transform is not None and not isinstance(transform, RandomResizedCrop):
            raise TypeError(f"transform={transform!r}: use stagefs.RandomResizedCrop or CenterCrop")
        if layout not in _LAYOUTS:
            raise ValueError(f"layout={layout!r}: use one of {', '.join(_LAYOUTS)}")
        if normalize is not None and len(normalize) != 2:
            raise ValueError("normalize=(mean, std): two sequences of 1 or C values")
        dtype = _dtype_name(dtype) if dtype is not None else (
            "float32" if normalize is not None else "uint8")
        native_transform = None
        if transform is not None or normalize is not None or dtype != "uint8" or layout != "NHWC":
            native_transform = (transform or _Full())._args(normalize, dtype, layout)
        self._convert = _converter(tensors)
        self.paths = [os.fspath(p) for p in paths]
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.transform = transform
        self.partition = partition
        self.local_world_size, self.exchange = _partition.resolve(
            partition, exchange, self.rank, self.world_size, local_world_size)
        self.nodes = self.world_size // self.local_world_size
        # Earlier runs of the next epoch, (nodes, local_world_size, consumed), for a node
        # partition restored mid-epoch.
        self._before: list = []
        self._epoch = 0
        # Positions of the next epoch's permutation already consumed (by a restored run).
        self._start = 0
        self._current: _EpochIterator | None = None
        self._fingerprints: list | None = None
        self._native = _native.Loader(
            self.paths, self.batch_size, self.shuffle, self.seed, self.drop_last, device,
            self.rank, self.world_size, int(ring), int(readers), pin_memory, native_transform,
            bool(hints), _direct_default() if direct is None else bool(direct),
            (self.local_world_size, self.exchange) if partition == "node" else None,
        )

    def __iter__(self) -> Iterator[tuple]:
        epoch, start, before = self._epoch, self._start, self._before
        native = self._native.epoch(epoch, start, before)
        self._epoch, self._start, self._before = epoch + 1, 0, []
        self._current = _EpochIterator(
            native, self._convert, epoch, start, self._native.batches_from(start, before))
        self._current.before = before
        return self._current

    @property
    def epoch(self) -> int:
        """The epoch the next iteration runs (after ``load_state_dict``: the restored one)."""
        return self._epoch

    def state_dict(self) -> dict:
        """The loader's position as a small picklable dict (store it beside the model with
        ``torch.save``): seed, epoch, how far into the epoch's permutation all ranks together
        got, the settings it was cut with, and the files' fingerprints.

        Taken after the training step on batch k, it resumes with batch k + 1. With several
        ranks it assumes they step in lockstep (DDP does): any rank's state is the state.
        """
        it = self._current
        before = self._before
        if it is not None and not it.finished and it.delivered < it.total:
            epoch = it.epoch
            consumed = it.delivered * self.batch_size * self.world_size
            start = min(self.rows, it.start + consumed)
            if self.partition == "node":
                before = it.before + [(self.nodes, self.local_world_size, consumed)]
        else:
            epoch, start = self._epoch, self._start
        node = {}
        if self.partition == "node":
            node = {
                # How the parts were assigned, and the runs of this epoch so far.
                "partition": {"mode": "node", "nodes": self.nodes,
                              "local_world_size": self.local_world_size,
                              "exchange": self.exchange,
                              "grid": list(self._native.grid)},
                "segments": [list(s) for s in before],
            }
        return {
            **node,
            "version": _STATE_VERSION,
            "epoch": epoch,
            # Samples of the epoch's permutation consumed by all ranks together (0: none yet).
            "start": start,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "rows": self.rows,
            "transform": repr(self.transform),
            "files": self.fingerprints(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state`` (``state_dict()`` of this or an earlier run): the next
        iteration is the rest of the saved epoch, exactly the batches the uninterrupted run
        would have delivered next. Under another ``world_size`` (or ``batch_size``) the rest of
        that epoch is split anew: every sample not yet seen in it comes exactly once across the
        ranks, and later epochs are those of the new split.

        Raises ``ValueError`` for a state of other files (size or checksum differ), another
        seed or shuffle, or an unknown version.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"not a stagefs.Loader state of version {_STATE_VERSION}: "
                f"{state.get('version') if isinstance(state, dict) else type(state).__name__!r}")
        mine, theirs = self.fingerprints(), state.get("files")
        if not isinstance(theirs, list) or len(theirs) != len(mine):
            raise ValueError(
                f"this state is for {len(theirs) if isinstance(theirs, list) else '?'} files, "
                f"this loader reads {len(mine)}: {self.paths}")
        for i, b in enumerate(theirs):
            if not isinstance(b, dict) or not all(
                    _is_int(b.get(k)) for k in ("size", "crc32")):
                raise ValueError(
                    f"not a stagefs.Loader state: files[{i}] should be a dict with integer "
                    f"'size' and 'crc32', got {b!r:.200}")
        for key in ("epoch", "start"):
            if not _is_int(state.get(key)):
                raise ValueError(
                    f"not a stagefs.Loader state: {key!r} should be an integer, "
                    f"got {state.get(key)!r:.200}")
        for path, a, b in zip(self.paths, mine, theirs):
            if (a["size"], a["crc32"]) != (b.get("size"), b.get("crc32")):
                raise ValueError(
                    f"this state is for other files: {path} has {a['size']} bytes, checksum "
                    f"{a['crc32']:08x}, but the state's {b.get('name')} had {b.get('size')} bytes, "
                    f"checksum {b.get('crc32', 0):08x}; resume with the dataset it was saved with")
        for key in ("seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"this state was saved with {key}={state.get(key)!r}, this loader has "
                    f"{key}={getattr(self, key)!r}: the epoch's order would differ")
        epoch, start = int(state["epoch"]), int(state["start"])
        if epoch < 0 or not 0 <= start <= self.rows:
            raise ValueError(f"state position out of range: epoch {epoch}, start {start}")
        before = self._check_partition(state)
        self.close()
        self._current = None
        self._epoch, self._start, self._before = epoch, start, before

    def _check_partition(self, state: dict) -> list:
        """The earlier runs of the saved epoch, once the state's partition matches ours."""
        saved = state.get("partition") or {"mode": "global"}
        mode = saved.get("mode")
        segments = state.get("segments") or []
        # One node is the global order exactly: such states move between the two.
        if mode == "global" and self.partition == "node" and self.nodes == 1:
            return [(1, self.local_world_size, int(state["start"]))]
        if mode == "node" and self.partition == "global" and all(
                isinstance(s, list) and s and s[0] == 1 for s in segments):
            return []
        if mode != self.partition:
            raise ValueError(
                f"this state was saved with partition={mode!r}, this loader has "
                f"partition={self.partition!r}: the epoch's order would differ")
        if mode != "node":
            return []
        for key, mine in (("exchange", self.exchange), ("grid", list(self._native.grid))):
            if saved.get(key) != mine:
                raise ValueError(
                    f"this state was saved with {key}={saved.get(key)!r}, this loader has "
                    f"{key}={mine!r}: the epoch's order would differ")
        try:
            return [tuple(int(x) for x in s) for s in segments if len(s) == 3]
        except (TypeError, ValueError):
            raise ValueError(f"malformed segments in the state: {segments!r}") from None

    def fingerprints(self) -> list:
        """Each file's identity (name, size, CRC-32 of its ends), as ``state_dict`` stores it."""
        if self._fingerprints is None:
            self._fingerprints = [_fingerprint(p) for p in self.paths]
        return self._fingerprints

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._native)

    def set_epoch(self, epoch: int) -> None:
        """Makes the next iteration epoch ``epoch`` (its shuffle is drawn from seed and epoch).
        A position restored by ``load_state_dict`` is kept when ``epoch`` is its epoch."""
        if int(epoch) < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        if int(epoch) != self._epoch:
            self._start, self._before = 0, []
        self._epoch = int(epoch)
        # An iteration left unfinished is abandoned: the position is now the next iteration's.
        self._current = None

    def order(self, epoch: int, start: int = 0, before: Sequence = ()) -> list[int]:
        """The rows this rank visits in ``epoch``, in order (batch i is ``order[i*B:(i+1)*B]``);
        with ``start``, the rest after ``start`` positions of the epoch's permutation; with
        ``before`` (a node partition's ``state_dict()["segments"]``), the rest after those."""
        return self._native.order(int(epoch), int(start), [tuple(s) for s in before])

    def stats(self) -> dict:
        """Who waited on whom, over all epochs so far: the figures of ``stagefs stream --json``.

        ``device_wait_share`` is the share of time the training loop waited for data (near 0:
        storage keeps up); ``ring_full_share`` the share the readers waited for you to release
        a batch (near 1: the loop is the bottleneck, not the data). ``direct_files`` counts
        the files read through direct descriptors; ``direct_fallbacks`` maps each other file
        to why it reads through the mount (empty with ``direct=False``).
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

    def __init__(self, native, convert, epoch: int, start: int, total: int) -> None:
        self._native = native
        self._convert = convert
        self.epoch, self.start, self.total = epoch, start, total
        # The earlier runs of this epoch (node partition, restored mid-epoch).
        self.before: list = []
        self.delivered = 0
        self.finished = False

    def __iter__(self) -> "_EpochIterator":
        return self

    def __next__(self) -> tuple:
        # No reference to the native batch survives this call: the slot goes back as soon as
        # the caller drops the returned tensors.
        try:
            parts = next(self._native)
        except StopIteration:
            self.finished = True
            raise
        batch = tuple(self._convert(part) for part in parts)
        self.delivered += 1
        return batch

    def close(self) -> None:
        self._native.close()


def __getattr__(name: str):
    # ``stagefs.torch`` (the Sampler) on first use, so ``import stagefs`` needs no torch.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'stagefs' has no attribute {name!r}")


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
