"""Sample order for one epoch: a seeded global permutation cut into per-rank batches.

The rule (``EpochPlan``), with ``N`` samples, batch size ``B``, ``W`` ranks and
``G = W * B`` samples per global step:

1. The epoch's order is ``arange(N)``, or with ``shuffle`` the permutation
   ``np.random.Generator(np.random.PCG64([seed, epoch])).permutation(N)``: the same on
   every rank, so ranks agree without talking to each other.
2. Full global steps: step ``k < N // G`` gives rank ``r`` the contiguous slice
   ``order[k*G + r*B : k*G + (r+1)*B]``.
3. The ``M = N % G`` samples left over (when ``M > 0``) are split into ``W`` contiguous
   shares in rank order, the first ``M % W`` ranks taking one more (``np.array_split``
   sizes), and what happens to them depends on ``last_batch``:

   - ``"drop"``: they are dropped, ``N // G`` batches per rank; every sample is seen at
     most once per epoch, and ``M < G`` samples are not seen.
   - ``"partial"``: one more batch per rank holding its share (``M // W`` or
     ``M // W + 1`` rows); a rank whose share is empty (only when ``M < W``) gets one
     padding row, so that every rank yields the same number of batches.
   - ``"pad"``: one more batch per rank, its share followed by padding rows up to ``B``.

   Padding rows have ``index == -1`` and carry the data (and random augmentation draws)
   of the epoch's first samples: padding row ``i`` of a batch reads ``order[i % N]``.

Every rank yields the same number of batches, and across ranks every sample is a real
row exactly once per epoch for ``"partial"`` and ``"pad"``.
"""

from __future__ import annotations

import numpy as np

from gpuio.errors import ConfigError

LAST_BATCH = ("partial", "drop", "pad")


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The epoch's sample order: ``arange(n)`` or a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFFFFFFFFFF, epoch & 0xFFFFFFFFFFFFFFFF]))
    return rng.permutation(n).astype(np.int64, copy=False)


class EpochPlan:
    """Which samples rank ``rank`` reads in each batch of an epoch (module docstring)."""

    def __init__(self, n: int, batch_size: int, world_size: int, rank: int, last_batch: str) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be an integer in 0..{world_size - 1}, got {rank!r}")
        if last_batch not in LAST_BATCH:
            raise ConfigError(f"last_batch={last_batch!r}; choose one of {', '.join(LAST_BATCH)}")
        self.n, self.batch_size, self.world_size, self.rank = n, batch_size, world_size, rank
        self.last_batch = last_batch
        step = batch_size * world_size
        self.full, rest = divmod(n, step)
        self.rest = rest
        self.num_batches = self.full + (1 if rest and last_batch != "drop" else 0)

    def __len__(self) -> int:
        return self.num_batches

    def rows(self, order: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``k``: ``(src, index)``, the samples to read and the dataset position
        of each row (-1 for padding rows, whose ``src`` is the sample they copy)."""
        b, w, r = self.batch_size, self.world_size, self.rank
        if not 0 <= k < self.num_batches:
            raise ConfigError(f"batch {k} out of range for an epoch of {self.num_batches} batches")
        if k < self.full:
            start = k * b * w + r * b
            src = order[start: start + b]
            return src, src.copy()
        q, extra = divmod(self.rest, w)
        start = self.full * b * w + r * q + min(r, extra)
        real = order[start: start + q + (r < extra)]
        pads = b - len(real) if self.last_batch == "pad" else (0 if len(real) else 1)
        if not pads:
            return real, real.copy()
        pad_src = order[np.arange(pads) % self.n]
        src = np.concatenate([real, pad_src])
        index = np.concatenate([real, np.full(pads, -1, dtype=np.int64)])
        return src, index
