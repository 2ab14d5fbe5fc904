"""Sample order for one epoch: one seeded global order cut into per-rank batches.

The rule (order version 2, ``ORDER_VERSION``), with ``N`` samples, batch size ``B``,
``W`` ranks and ``G = W * B`` samples per global step:

1. The epoch's order is ``arange(N)``, or with ``shuffle`` a permutation of ``[0, N)``
   keyed by ``(seed, epoch)`` that is evaluated position by position
   (``EpochOrder``): a Feistel network on ``[0, 2**k)``, ``2**k`` the smallest power of
   two ``>= max(N, 2)``, with cycle-walking (a value ``>= N`` is put through the network
   again until it falls below ``N``). The ``k`` bits are a left half of ``k // 2`` bits
   and a right half of the rest; each of ``ROUNDS`` rounds maps ``(L, R)`` to
   ``(R, L ^ (mix(R ^ key[i]) mod 2**len(L)))``, the halves trading widths, where
   ``mix`` is the splitmix64 finalizer and the round keys are
   ``np.random.SeedSequence([seed, epoch]).generate_state(ROUNDS, np.uint64)`` (seed
   and epoch taken modulo ``2**64``). The order is the same on every rank, so ranks
   agree without talking to each other, and a rank evaluates only the positions it
   reads: time and memory grow with its share, ``N / W``, not with ``N``.
2. An epoch's plan covers the positions ``[start, N)`` of that order (``start`` is 0,
   or where a resumed epoch goes on, see ``consumed``). Full global steps: step
   ``k < (N - start) // G`` gives rank ``r`` the positions
   ``start + k*G + r*B .. start + k*G + (r+1)*B - 1``.
3. The ``M = (N - start) % G`` positions left over (when ``M > 0``) are split into
   ``W`` contiguous shares in rank order, the first ``M % W`` ranks taking one more
   (``np.array_split`` sizes), and what happens to them depends on ``last_batch``:

   - ``"drop"``: they are dropped, ``(N - start) // G`` batches per rank; every sample
     is seen at most once per epoch, and ``M < G`` samples are not seen.
   - ``"partial"``: one more batch per rank holding its share (``M // W`` or
     ``M // W + 1`` rows); a rank whose share is empty (only when ``M < W``) gets one
     padding row, so that every rank yields the same number of batches.
   - ``"pad"``: one more batch per rank, its share followed by padding rows up to ``B``.

   Padding rows have ``index == -1`` and carry the data (and random augmentation draws)
   of the epoch's first samples: padding row ``i`` of a batch reads ``order[i % N]``.

Consumed positions: after every rank has handed out ``k`` batches of a plan, the
epoch's consumed part is the prefix ``[0, start + k*G)`` of its order while ``k`` is
at most the number of full steps, and all of ``[0, N)`` once the plan's last batch is
out (``k == len(plan)``): the last step (a partial one, or the samples ``"drop"``
leaves out) counts as wholly consumed, and padding rows consume nothing. A resumed
epoch is the plan from ``start = consumed`` with the resuming loader's own ``B``,
``W`` and ``last_batch``, so its remaining samples are each a real row exactly once
across the new ranks.

Every rank yields the same number of batches, and across ranks every sample is a real
row exactly once per epoch for ``"partial"`` and ``"pad"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from gpuio.batch import splitmix64
from gpuio.errors import ConfigError

__all__ = ["LAST_BATCH", "ORDER_VERSION", "ROUNDS", "EpochOrder", "EpochPlan", "epoch_order"]

LAST_BATCH = ("partial", "drop", "pad")
# Version 1 (no version key in a state) was a full PCG64 permutation per epoch; states
# saved under it name positions of another order and cannot be resumed.
ORDER_VERSION = 2
ROUNDS = 6  # Feistel rounds: four already make a keyed strong pseudorandom permutation
_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 18  # positions evaluated at once: the network's temporaries stay a few MB
# full batches whose positions ``EpochPlan.batches`` evaluates in one call: NumPy's cost per
# call, paid once per round and cycle-walking pass, is shared by as many rows
_BLOCK = 64


class EpochOrder:
    """The order of one epoch (rule 1 of the module docstring): ``order[p]`` is the
    sample at position ``p``, for an int, a slice or an array of positions, computed for
    those positions only. ``np.asarray(order)`` evaluates all ``N`` of them."""

    def __init__(self, n: int, shuffle: bool, seed: int, epoch: int) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ConfigError(f"the number of samples must be an integer >= 0, got {n!r}")
        self.n, self.shuffle = int(n), bool(shuffle)
        self.bits = max(1, (self.n - 1).bit_length())
        seq = np.random.SeedSequence([int(seed) & _MASK64, int(epoch) & _MASK64])
        self.keys = seq.generate_state(ROUNDS, np.uint64)

    def __len__(self) -> int:
        return self.n

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[np.arange(self.n, dtype=np.int64)]
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, positions: Any) -> Any:
        if isinstance(positions, slice):
            positions = np.arange(*positions.indices(self.n), dtype=np.int64)
        scalar = np.ndim(positions) == 0
        p = np.atleast_1d(np.asarray(positions, dtype=np.int64))
        if p.size and (p.min() < 0 or p.max() >= self.n):
            raise ConfigError(f"order position out of range 0..{self.n - 1}: "
                              f"{int(p.min()) if p.min() < 0 else int(p.max())}")
        if not self.shuffle:
            out = p.copy()
        else:
            out = np.empty(p.shape, dtype=np.int64)
            for lo in range(0, p.size, _CHUNK):
                out[lo: lo + _CHUNK] = self._permute(p[lo: lo + _CHUNK])
        return int(out[0]) if scalar else out

    def _permute(self, p: np.ndarray) -> np.ndarray:
        x = self._feistel(p.astype(np.uint64))
        outside = np.flatnonzero(x >= np.uint64(self.n))
        while outside.size:  # cycle-walking: each value's cycle comes back below n
            x[outside] = self._feistel(x[outside])
            outside = outside[x[outside] >= np.uint64(self.n)]
        return x.astype(np.int64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        """The network on ``[0, 2**bits)``: ``(L, R)`` -> ``(R, L ^ F(R))``, widths swapping."""
        a = self.bits // 2  # the left half's width
        b = self.bits - a
        left, right = x >> np.uint64(b), x & np.uint64((1 << b) - 1)
        for key in self.keys:
            f = splitmix64(right ^ key)
            f &= np.uint64((1 << a) - 1)
            f ^= left
            left, right = right, f
            a, b = b, a
        left <<= np.uint64(b)
        left |= right
        return left


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> EpochOrder:
    """The epoch's sample order: ``arange(n)``, or the permutation keyed by (seed, epoch)."""
    return EpochOrder(n, shuffle, seed, epoch)


class EpochPlan:
    """Which samples rank ``rank`` reads in each batch of an epoch, from order position
    ``start`` on (module docstring)."""

    def __init__(self, n: int, batch_size: int, world_size: int, rank: int, last_batch: str,
                 start: int = 0) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be an integer in 0..{world_size - 1}, got {rank!r}")
        if last_batch not in LAST_BATCH:
            raise ConfigError(f"last_batch={last_batch!r}; choose one of {', '.join(LAST_BATCH)}")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= n:
            raise ConfigError(f"start must be an order position in 0..{n}, got {start!r}")
        self.n, self.batch_size, self.world_size, self.rank = n, batch_size, world_size, rank
        self.last_batch, self.start = last_batch, start
        self.step = batch_size * world_size
        self.full, self.rest = divmod(n - start, self.step)
        self.num_batches = self.full + (1 if self.rest and last_batch != "drop" else 0)

    def __len__(self) -> int:
        return self.num_batches

    def consumed(self, k: int) -> int:
        """The length of the epoch's consumed prefix once every rank has handed out
        ``k`` batches of this plan (module docstring, "Consumed positions")."""
        if not 0 <= k <= self.num_batches:
            raise ConfigError(f"batch {k} out of range 0..{self.num_batches} for this epoch's plan")
        return self.n if k == self.num_batches else self.start + k * self.step

    def samples(self, order: EpochOrder | np.ndarray) -> np.ndarray:
        """Every sample this rank reads as a real row in this plan, batch after batch
        (the real rows of ``rows(order, k)`` for each ``k``), evaluated at once."""
        b = self.batch_size
        steps = np.arange(self.full, dtype=np.int64)[:, None] * self.step
        positions = [(self.start + self.rank * b + steps + np.arange(b, dtype=np.int64)).ravel()]
        if self.num_batches > self.full:
            q, extra = divmod(self.rest, self.world_size)
            begin = self.start + self.full * self.step + self.rank * q + min(self.rank, extra)
            positions.append(np.arange(begin, begin + q + (self.rank < extra), dtype=np.int64))
        return np.asarray(order[np.concatenate(positions)], dtype=np.int64)

    def batches(self, order: EpochOrder | np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``rows(order, k)`` for every batch ``k`` in turn, the order evaluated for
        several full batches at a time."""
        b = self.batch_size
        for lo in range(0, self.full, _BLOCK):
            hi = min(lo + _BLOCK, self.full)
            steps = np.arange(lo, hi, dtype=np.int64)[:, None] * self.step
            block = np.asarray(order[(self.start + self.rank * b + steps + np.arange(b)).ravel()], dtype=np.int64)
            for src in block.reshape(hi - lo, b):
                yield src.copy(), src.copy()
        for k in range(self.full, self.num_batches):
            yield self.rows(order, k)

    def rows(self, order: EpochOrder | np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``k``: ``(src, index)``, the samples to read and the dataset position
        of each row (-1 for padding rows, whose ``src`` is the sample they copy)."""
        b, w, r = self.batch_size, self.world_size, self.rank
        if not 0 <= k < self.num_batches:
            raise ConfigError(f"batch {k} out of range for an epoch of {self.num_batches} batches")
        if k < self.full:
            begin = self.start + k * self.step + r * b
            src = np.asarray(order[begin: begin + b], dtype=np.int64)
            return src, src.copy()
        q, extra = divmod(self.rest, w)
        begin = self.start + self.full * self.step + r * q + min(r, extra)
        real = np.asarray(order[begin: begin + q + (r < extra)], dtype=np.int64)
        pads = b - len(real) if self.last_batch == "pad" else (0 if len(real) else 1)
        if not pads:
            return real, real.copy()
        pad_src = np.asarray(order[np.arange(pads) % self.n], dtype=np.int64)
        src = np.concatenate([real, pad_src])
        index = np.concatenate([real, np.full(pads, -1, dtype=np.int64)])
        return src, index
