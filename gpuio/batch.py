"""``Batch``: what flows between pipeline stages, and the per-sample random seeds.

A batch holds its fields as lists (one value per row, ragged allowed: encoded bytes,
images of different sizes, boxes) or as arrays with one leading row per sample once
they have a fixed shape. ``index`` is each row's dataset position (-1 for a padding
row). Random ops draw from ``batch.rng(row, salt)``, a generator derived from
``(seed, epoch, sample index)`` and the op's ``salt``, so results do not depend on
thread timing, batch composition or resume position.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuio.device import Device, require

__all__ = ["Batch", "Op", "sample_seeds", "splitmix64"]

def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 ``x``, in place (array arithmetic wraps modulo
    2**64 without warnings); returns ``x``."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _mix(x: np.ndarray) -> np.ndarray:
    """One splitmix64 step (increment, then finalizer) on a new uint64 array."""
    return splitmix64(x + np.uint64(0x9E3779B97F4A7C15))


@functools.lru_cache(maxsize=64)
def _epoch_base(seed: int, epoch: int) -> np.ndarray:
    """The part of every seed of one epoch that the sample does not change (1 element)."""
    mask = 0xFFFFFFFFFFFFFFFF
    return _mix(_mix(np.array([seed & mask], dtype=np.uint64)) ^ np.uint64(epoch & mask))


def sample_seeds(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """One uint64 seed per sample from ``(seed, epoch, sample index)``."""
    return _mix(_epoch_base(seed, epoch) ^ np.asarray(indices).astype(np.uint64))


@dataclass
class Batch:
    """One batch between stages. See the module docstring."""

    data: dict[str, Any]
    index: np.ndarray
    seeds: np.ndarray
    device: Device = field(default_factory=lambda: Device("cpu"))
    on_error: str = "raise"  # or "skip"
    stream: Any = None  # the CuPy stream GPU ops run on (None: current stream)
    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    warnings: list[tuple[int, str]] = field(default_factory=list)  # (sample, message): decoded despite them
    _rejected: set[int] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def xp(self) -> Any:
        """``numpy`` for a CPU batch, ``cupy`` for a GPU batch."""
        return require("cupy") if self.device.is_cuda else np

    @contextlib.contextmanager
    def on_device(self) -> Iterator[Any]:
        """The batch's array module for the block: ``numpy`` for a CPU batch; for a GPU
        batch ``cupy``, with the batch's GPU the current device and its stream (else
        that device's current stream) the current stream. Every CuPy call of an op
        runs inside such a block: a worker thread's current device is GPU 0, and its
        current stream the legacy default stream, until it says otherwise."""
        if not self.device.is_cuda:
            yield np
            return
        cp = require("cupy")
        with cp.cuda.Device(self.device.index):  # the current stream is per device: picked inside
            with self.stream if self.stream is not None else cp.cuda.get_current_stream():
                yield cp

    def rng(self, row: int, salt: int = 0) -> np.random.Generator:
        """The generator for ``row``; ops pass a ``salt`` of their own so that two
        random ops do not draw the same numbers."""
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(self.seeds[row]), salt])))

    def reject(self, row: int, error: BaseException) -> None:
        """Report a bad sample: raise ``error`` (``on_error="raise"``) or mark the row
        to be dropped after the current op (``on_error="skip"``)."""
        if self.on_error != "skip":
            raise error
        self._rejected.add(row)
        self.errors.append((int(self.index[row]), error))

    def warn(self, row: int, message: str) -> None:
        """Report that ``row`` was decoded despite a problem a decoder warned of (the
        Loader counts these in ``stats()``); the row stays."""
        self.warnings.append((int(self.index[row]), message))

    def drop_rejected(self) -> None:
        """Remove the rows rejected so far from every field (called between ops)."""
        if not self._rejected:
            return
        keep = np.array([r for r in range(len(self)) if r not in self._rejected], dtype=np.int64)
        for name, col in self.data.items():
            self.data[name] = [col[r] for r in keep.tolist()] if isinstance(col, list) else col[keep]
        self.index = self.index[keep]
        self.seeds = self.seeds[keep]
        self._rejected.clear()


class Op:
    """Base for ops: ``op(batch) -> batch``. Subclasses set ``salt`` if random.

    ``host_inputs`` names the fields the op needs in host memory (e.g. encoded JPEG
    bytes for a decoder that parses on the host); the loader reads extent fields named
    there into host (pinned) memory and every other extent field onto its device.
    """

    salt = 0
    host_inputs: tuple[str, ...] = ()

    def __call__(self, batch: Batch) -> Batch:  # pragma: no cover - interface
        """Run the op on ``batch`` and return the batch (the same object or a new one)."""
        raise NotImplementedError
