"""The random numbers of a whole batch at once: row ``r``'s numbers equal those of
``batch.rng(r, salt)`` (NumPy's ``Generator(PCG64(SeedSequence([seed, salt])))``), made
with array arithmetic over the rows instead of one generator object per row (building
one costs more than the few draws a row makes, and a train pipeline would build two per
image).

NumPy documents these algorithms and keeps their streams stable: ``SeedSequence``
hashes the entropy words (the seed's 32-bit words, low first, then the salt's) into a
4-word pool and expands it into PCG64's 128-bit state and increment; PCG64 steps
``state = state * M + inc`` (mod 2**128) and outputs XSL-RR of the new state.
``Generator.random`` is ``(next64 >> 11) * 2**-53``, ``uniform(a, b)`` is ``a + (b - a) *
random()``, and ``integers(0, n + 1)`` takes Lemire's bounded draw on a 32-bit half
(the low half of a fresh output; the next 32-bit draw takes the high half).
"""

from __future__ import annotations

import numpy as np

__all__ = ["Streams"]

_M32 = np.uint64(0xFFFFFFFF)
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = np.uint64(0xCA01F9DD), np.uint64(0x4973F715)
_MUL_HI, _MUL_LO = 0x2360ED051FC65DA4, 0x4385DF649FCCF645  # PCG's default 128-bit multiplier
_S16, _S32, _S63 = np.uint64(16), np.uint64(32), np.uint64(63)


def _u32(x: np.ndarray) -> np.ndarray:
    return x & _M32


def _hashmix(value: np.ndarray, const: list[int]) -> np.ndarray:
    """SeedSequence's hashmix on uint32 words (held in uint64); ``const`` is the running
    hash constant, the same for every row."""
    value = value ^ np.uint64(const[0])
    const[0] = (const[0] * _MULT_A) & 0xFFFFFFFF
    value = _u32(value * np.uint64(const[0]))
    return value ^ (value >> _S16)


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    result = _u32(_MIX_L * x - _MIX_R * y)
    return result ^ (result >> _S16)


def _mul64(a: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """The 128-bit product of uint64 ``a`` and the constant ``b``: (high, low)."""
    a0, a1, b0, b1 = a & _M32, a >> _S32, np.uint64(b & 0xFFFFFFFF), np.uint64(b >> 32)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> _S32) + (p01 & _M32) + (p10 & _M32)
    return p11 + (p01 >> _S32) + (p10 >> _S32) + (mid >> _S32), (p00 & _M32) | (mid << _S32)


class Streams:
    """One PCG64 stream per seed (uint64 ``[N]``) for ``salt``; see the module docstring."""

    def __init__(self, seeds: np.ndarray, salt: int) -> None:
        seeds = np.asarray(seeds, np.uint64)
        low, high = seeds & _M32, seeds >> _S32
        wide = high > 0  # the seed takes two 32-bit entropy words, else one
        salt_word = np.uint64(salt & 0xFFFFFFFF)
        if salt >> 32:
            raise ValueError(f"salt {salt:#x}: 32 bits at most")
        zero = np.zeros_like(seeds)
        entropy = [low, np.where(wide, high, salt_word), np.where(wide, salt_word, zero), zero]
        const = [_INIT_A]
        pool = [_hashmix(word, const) for word in entropy]
        for src in range(4):
            for dst in range(4):
                if src != dst:
                    pool[dst] = _mix(pool[dst], _hashmix(pool[src], const))
        words, const_b = [], _INIT_B
        for k in range(8):  # generate_state(4, uint64): 8 words from the pool, in turn
            value = pool[k % 4] ^ np.uint64(const_b)
            const_b = (const_b * _MULT_B) & 0xFFFFFFFF
            value = _u32(value * np.uint64(const_b))
            words.append(value ^ (value >> _S16))
        state = [words[2 * k] | (words[2 * k + 1] << _S32) for k in range(4)]
        init_hi, init_lo, seq_hi, seq_lo = state
        self.inc_hi = (seq_hi << np.uint64(1)) | (seq_lo >> _S63)
        self.inc_lo = (seq_lo << np.uint64(1)) | np.uint64(1)
        self.hi, self.lo = zero.copy(), zero.copy()
        self._step()
        self.lo = self.lo + init_lo
        self.hi = self.hi + init_hi + (self.lo < init_lo).astype(np.uint64)
        self._step()
        self.half, self.has_half = zero.copy(), np.zeros(len(seeds), bool)  # the high half a 32-bit draw kept

    def _step(self, rows: np.ndarray | None = None) -> None:
        """Step the streams where ``rows`` (bool ``[N]``; all when None)."""
        hi, lo = _mul64(self.lo, _MUL_LO)
        hi = hi + self.lo * np.uint64(_MUL_HI) + self.hi * np.uint64(_MUL_LO)
        lo = lo + self.inc_lo
        hi = hi + self.inc_hi + (lo < self.inc_lo).astype(np.uint64)
        if rows is None:
            self.hi, self.lo = hi, lo
        else:
            self.hi, self.lo = np.where(rows, hi, self.hi), np.where(rows, lo, self.lo)

    def next64(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The next 64-bit output of the streams where ``rows`` (bool ``[N]``; all when
        None; the others do not move and give 0), uint64 ``[N]``."""
        self._step(rows)
        value = self.hi ^ self.lo
        rot = self.hi >> np.uint64(58)
        value = (value >> rot) | (value << ((np.uint64(64) - rot) & _S63))
        return value if rows is None else np.where(rows, value, np.uint64(0))

    def random(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``Generator.random()`` of the streams where ``rows``, float64 ``[N]``."""
        return (self.next64(rows) >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)

    def uniform(self, low: float, high: float, rows: np.ndarray | None = None) -> np.ndarray:
        """``Generator.uniform(low, high)`` of the streams where ``rows``, float64 ``[N]``."""
        return low + (high - low) * self.random(rows)

    def next32(self, rows: np.ndarray) -> np.ndarray:
        """The next 32-bit draw of the streams where ``rows``: the high half a stream
        kept from its last 32-bit draw, else the low half of a fresh output (whose high
        half it keeps), as ``Generator`` buffers them."""
        fresh = rows & ~self.has_half
        out = self.next64(fresh) if fresh.any() else np.zeros_like(self.hi)
        value = np.where(fresh, out & _M32, np.where(rows, self.half, np.uint64(0)))
        self.half = np.where(fresh, out >> _S32, self.half)
        self.has_half = np.where(rows, fresh, self.has_half)
        return value

    def integers(self, high: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``Generator.integers(0, high)`` of the streams where ``rows`` (``high`` per
        row, ``1 <= high < 2**32``; 1 draws nothing), int64 ``[N]`` (0 elsewhere):
        Lemire's method, redrawing where it rejects."""
        span = np.asarray(high, np.uint64)
        threshold = (np.uint64(2**32) - span) % span
        draw = rows & (span > np.uint64(1))
        value = np.zeros(len(span), np.uint64)
        while draw.any():
            product = self.next32(draw) * span
            value = np.where(draw, product >> _S32, value)
            draw = draw & ((product & _M32) < threshold)
        return value.astype(np.int64)
