"""The random numbers of a whole batch at once: row ``r``'s numbers equal those of
``batch.rng(r, salt)`` (NumPy's ``Generator(PCG64(SeedSequence([seed, salt])))``), made
by one C call per draw over the rows (``gpuio.ops._augment.rng_*``) instead of one
generator object per row (building one costs more than the few draws a row makes, and a
train pipeline would build two per image).

NumPy documents these algorithms and keeps their streams stable: ``SeedSequence``
hashes the entropy words (the seed's 32-bit words, low first, then the salt's) into a
4-word pool and expands it into PCG64's 128-bit state and increment; PCG64 steps
``state = state * M + inc`` (mod 2**128) and outputs XSL-RR of the new state.
``Generator.random`` is ``(next64 >> 11) * 2**-53``, ``uniform(a, b)`` is ``a + (b - a) *
random()``, and ``integers(0, n)`` takes Lemire's bounded draw on a 32-bit half (the low
half of a fresh output; the next 32-bit draw takes the high half, which ``random`` leaves
kept). ``ops/_augment.c`` holds the one implementation, shared with MixUp and CutMix.
"""

from __future__ import annotations

import numpy as np

from gpuio.ops import _augment

__all__ = ["Streams"]


class Streams:
    """One PCG64 stream per seed (uint64 ``[N]``) for ``salt`` (32 bits at most, else
    ValueError); see the module docstring. ``rows`` (bool ``[N]``; None: all) picks the
    streams a draw moves; the others stay and give 0 (``uniform``: ``low``)."""

    def __init__(self, seeds: np.ndarray, salt: int) -> None:
        seeds = np.ascontiguousarray(seeds, np.uint64)
        self.state = np.empty((len(seeds), 6), np.uint64)  # per stream: see _augment.rng_seed
        _augment.rng_seed(seeds, salt, self.state)

    def next64(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The next 64-bit output of the streams, uint64 ``[N]``."""
        out = np.empty(len(self.state), np.uint64)
        _augment.rng_next64(self.state, rows, out)
        return out

    def random(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``Generator.random()`` of the streams, float64 ``[N]``."""
        return self.uniform(0.0, 1.0, rows)

    def uniform(self, low: float, high: float, rows: np.ndarray | None = None) -> np.ndarray:
        """``Generator.uniform(low, high)`` of the streams, float64 ``[N]``."""
        out = np.empty(len(self.state))
        _augment.rng_uniform(self.state, rows, low, high, out)
        return out

    def integers(self, high: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """``Generator.integers(0, high)`` of the streams (``high`` per row, ``1 <= high
        <= 2**32``, else ValueError; 1 draws nothing), int64 ``[N]``: Lemire's method,
        redrawing where it rejects."""
        out = np.empty(len(self.state), np.int64)
        _augment.rng_integers(self.state, rows, np.ascontiguousarray(high, np.int64), out)
        return out

    def beta(self, alpha: float, rows: np.ndarray | None = None) -> np.ndarray:
        """``Generator.beta(alpha, alpha)`` of the streams for ``0 < alpha <= 1`` (Johnk's
        method, NumPy's there; else ValueError), float64 ``[N]``."""
        out = np.empty(len(self.state))
        _augment.rng_beta(self.state, rows, alpha, out)
        return out

    def permutation(self, k: int, rows: np.ndarray | None = None) -> np.ndarray:
        """``Generator.permutation(k)`` of the streams, int64 ``[N, k]``."""
        out = np.empty((len(self.state), k), np.int64)
        _augment.rng_permutation(self.state, rows, k, out)
        return out

    def boxes(self, hw: np.ndarray, scale: tuple[float, float], ratio: tuple[float, float], *, erase: bool = False,
              rows: np.ndarray | None = None) -> np.ndarray:
        """torchvision's random boxes of images of sizes ``hw`` (int64 ``[N, 2]``), int64
        ``[N, 4]`` (top, left, height, width): up to 10 tries of ``uniform(*scale)`` x the
        image's area and an aspect ``exp(uniform(log ratio))``, the first that fits
        drawing its top then its left. ``RandomResizedCrop`` (``erase`` False): the
        aspect is w/h, the box may reach the image's sides, none fits: the centered box
        of the ratio closest to the image's. ``RandomErasing``: the aspect is h/w, the
        box stays inside, none fits: zeros. Rows without a size, or not in ``rows``: zeros
        (no draws)."""
        out = np.empty((len(self.state), 4), np.int64)
        _augment.rng_boxes(self.state, rows, np.ascontiguousarray(hw, np.int64), scale, ratio, erase, out)
        return out
