"""Spectral features with DALI's operators, names, parameters and defaults:
``spectrogram``, ``mel_filter_bank``, ``to_decibels`` and ``mfcc``.

Each reads and writes ``audio`` by default. The batch is computed at once: the
spectrogram frames every row into one ``[frames, window_length]`` array (on the host one
C call, ``ops/_audio.c``, where it was built; else one strided copy per row; no loop
per window) and runs one batched real FFT over it
(``scipy.fft`` on the CPU, in groups of rows whose buffers stay in cache; CuPy's cuFFT
on a GPU, the whole batch at once, the frame count rounded up so that batches of
similar size reuse one cached plan); the mel filter bank and the DCT of
``mfcc`` are one matrix product over all frames of the batch.

Layouts: ``"ft"`` rows are ``[frequency, time]`` (DALI's default), ``"tf"`` rows
``[time, frequency]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError, FormatError
from gpuio.ops.audio import audio_dependency
from gpuio.ops.ragged import empty, groups, pack, ragged_axis, rows_of, segment_max, unpack

try:
    from gpuio.ops import _audio
except ImportError:  # built at install where a C compiler exists; else NumPy computes the same
    _audio = None

__all__ = ["Spectrogram", "MelFilterBank", "ToDecibels", "MFCC", "spectrogram", "mel_filter_bank",
           "to_decibels", "mfcc", "hann_window", "mel_filters", "dct_matrix"]

_LAYOUTS = ("ft", "tf")
_CUFFT_ROWS = 1024  # GPU frame counts are rounded up to a multiple of this (plan reuse)


def hann_window(length: int) -> np.ndarray:
    """DALI's Hann window: ``0.5 - 0.5 cos(2 pi (n + 0.5) / length)``, float32."""
    n = np.arange(length, dtype=np.float64)
    return (0.5 - 0.5 * np.cos(2 * np.pi * (n + 0.5) / length)).astype(np.float32)


def _hz_to_mel(f: np.ndarray, formula: str) -> np.ndarray:
    if formula == "htk":
        return 2595.0 * np.log10(1.0 + f / 700.0)
    # Slaney: linear below 1 kHz (3 mel per 200 Hz), logarithmic above
    return np.where(f < 1000.0, f * 3.0 / 200.0, 15.0 + 27.0 * np.log(np.maximum(f, 1e-9) / 1000.0) / np.log(6.4))


def _mel_to_hz(m: np.ndarray, formula: str) -> np.ndarray:
    if formula == "htk":
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    return np.where(m < 15.0, m * 200.0 / 3.0, 1000.0 * np.exp((m - 15.0) * np.log(6.4) / 27.0))


def mel_filters(sample_rate: float, nfft: int, nfilter: int, freq_low: float, freq_high: float,
                mel_formula: str, normalize: bool) -> np.ndarray:
    """Triangular filters ``[nfilter, nfft // 2 + 1]`` (float64): centres evenly spaced
    on the mel scale between ``freq_low`` and ``freq_high`` (Hz); with ``normalize``
    each filter's area is 1 (Slaney's ``2 / (f[i+2] - f[i])``), else its peak is 1."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.float64(freq_low), mel_formula),
                                   _hz_to_mel(np.float64(freq_high), mel_formula), nfilter + 2), mel_formula)
    bins = np.arange(nfft // 2 + 1) * (sample_rate / nfft)
    rise = (bins[None, :] - edges[:-2, None]) / (edges[1:-1] - edges[:-2])[:, None]
    fall = (edges[2:, None] - bins[None, :]) / (edges[2:] - edges[1:-1])[:, None]
    weights = np.maximum(0.0, np.minimum(rise, fall))
    if normalize:
        weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights


def dct_matrix(n_out: int, n_in: int, dct_type: int, normalize: bool) -> np.ndarray:
    """DCT-I..IV as a matrix ``[n_out, n_in]`` (float64) in DALI's convention (the
    textbook sums without scipy's factor 2), or orthonormal with ``normalize``."""
    k = np.arange(n_out, dtype=np.float64)[:, None]
    n = np.arange(n_in, dtype=np.float64)[None, :]
    if dct_type == 1:
        m = np.cos(np.pi * k * n / (n_in - 1))
        m[:, 0] *= 0.5
        m[:, -1] *= 0.5
        return m
    if dct_type == 2:
        m = np.cos(np.pi / n_in * (n + 0.5) * k)
        if normalize:
            m *= np.sqrt(2.0 / n_in)
            m[0] /= np.sqrt(2.0)
        return m
    if dct_type == 3:
        m = np.cos(np.pi / n_in * n * (k + 0.5))
        if normalize:
            m *= np.sqrt(2.0 / n_in)
            m[:, 0] /= np.sqrt(2.0)
        else:
            m[:, 0] *= 0.5
        return m
    m = np.cos(np.pi / n_in * (n + 0.5) * (k + 0.5))
    return m * np.sqrt(2.0 / n_in) if normalize else m


class Spectrogram(Op):
    """DALI's ``spectrogram`` of mono audio ``[T]``: windows of ``window_length``
    samples every ``window_step`` (with ``center_windows``, window ``k`` starts at
    sample ``k * window_step - window_length // 2`` and the signal is extended by
    mirrored (``reflect_padding``) or zero samples on both sides: ``T // window_step
    + 1`` windows; without, only whole windows: ``(T - window_length) // window_step
    + 1``), times ``window_fn`` (default: DALI's Hann window, ``hann_window``),
    zero-filled to ``nfft`` (default ``window_length``), ``|FFT|**power``; rows
    ``[nfft // 2 + 1, windows]`` for layout "ft", transposed for "tf". A row too
    short for one window is a ``FormatError`` (skipped under ``on_error="skip"``)."""

    def __init__(self, nfft: int | None = None, window_length: int = 512, window_step: int = 256, power: int = 2,
                 center_windows: bool = True, reflect_padding: bool = True, window_fn: Any = None,
                 layout: str = "ft", *, field: str = "audio") -> None:
        self.nfft = int(nfft) if nfft is not None else int(window_length)
        if window_length < 1 or window_step < 1 or self.nfft < window_length:
            raise ConfigError(f"spectrogram needs window_length >= 1, window_step >= 1 and nfft >= "
                              f"window_length; got {window_length}, {window_step}, {self.nfft}")
        if power not in (1, 2):
            raise ConfigError(f"power {power!r}; choose 1 (amplitude) or 2 (power)")
        self.time_axis = _time_axis(layout)
        self.window = hann_window(window_length) if window_fn is None else np.asarray(window_fn, np.float32)
        if self.window.shape != (window_length,):
            raise ConfigError(f"window_fn has {self.window.size} values for window_length {window_length}")
        self.window_length, self.window_step, self.power = int(window_length), int(window_step), power
        self.center_windows, self.reflect_padding, self.layout = center_windows, reflect_padding, layout
        self.field = field

    def __call__(self, batch: Batch) -> Batch:
        rows = rows_of(batch.data[self.field])
        xp = batch.xp
        for row, r in enumerate(rows):
            if r.ndim != 1:
                raise ConfigError(f"spectrogram needs mono audio [T]; got a row of shape {r.shape}")
            if r.shape[0] == 0 or self._windows(r.shape[0]) < 1:
                batch.reject(row, FormatError(f"audio of {r.shape[0]} samples is shorter than one window "
                                              f"({self.window_length})", sample=int(batch.index[row])))
        batch.drop_rejected()
        rows = rows_of(batch.data[self.field])
        if not rows:
            batch.data[self.field] = []
            return batch
        counts = np.array([self._windows(r.shape[0]) for r in rows], dtype=np.int64)
        out = empty(xp, (int(counts.sum()), self.nfft // 2 + 1), np.float32)
        parts = groups(xp, counts, self.nfft)
        # one zero-filled frame buffer for all groups: each group overwrites its windows
        most = max(f1 - f0 for _, _, f0, f1 in parts)
        if xp is np:  # pooled (no page faults per batch); only the FFT's zero fill needs zeros
            work = empty(np, (most, self.nfft), np.float32)
            work[:, self.window_length:] = 0
        else:
            work = xp.zeros((-(-most // _CUFFT_ROWS) * _CUFFT_ROWS, self.nfft), xp.float32)
        for r0, r1, f0, f1 in parts:
            frames = work[: f1 - f0 if xp is np else len(work)]
            self.frames(xp, rows[r0:r1], counts[r0:r1], frames)
            self._power(xp, frames, out[f0:f1])
        batch.data[self.field] = unpack(out, counts, self.time_axis)
        return batch

    def _windows(self, t: int) -> int:
        if self.center_windows:
            return t // self.window_step + 1
        return (t - self.window_length) // self.window_step + 1 if t >= self.window_length else 0

    def _power(self, xp: Any, frames: Any, out: Any) -> None:
        """``|rfft(frames)| ** power`` of the first ``len(out)`` frames into ``out``."""
        if xp is np:
            spec = audio_dependency("scipy.fft").rfft(frames, axis=1)
        else:  # one batched cuFFT plan per padded frame count, cached by CuPy
            spec = xp.fft.rfft(frames, axis=1)[: len(out)]
        if self.power == 2 and xp is np and _audio is not None:
            _audio.power(spec, out)
        elif self.power == 2:  # re**2 + im**2 in place on the spectrum's floats
            parts = spec.view(xp.float32).reshape(*spec.shape, 2)
            xp.square(parts, out=parts)
            xp.add(parts[..., 0], parts[..., 1], out=out)
        else:
            xp.abs(spec, out=out)

    def frames(self, xp: Any, rows: list[Any], counts: np.ndarray, out: Any) -> None:
        """The windowed frames of ``rows`` (``counts`` each), end to end, into the
        first ``window_length`` columns of ``out`` ``[frames, nfft]`` float32, whose
        other columns (the FFT's zero fill) and rows beyond the frames stay zero."""
        half = self.window_length // 2
        if xp is np and _audio is not None:  # the same products, without the padded copy of each row
            mode = 0 if not self.center_windows else 1 if self.reflect_padding else 2
            _audio.frames([r.astype(np.float32, copy=False) for r in rows], np.ascontiguousarray(counts, np.int64),
                          self.window, self.window_step, half if self.center_windows else 0, mode, out.shape[1],
                          out)
            return
        window = xp.asarray(self.window)
        mode = "reflect" if self.reflect_padding else "constant"
        start = 0
        for r, n in zip(rows, counts.tolist()):
            r = r.astype(xp.float32, copy=False)
            if self.center_windows:
                # window k starts at k * step - half; the last one ends past T by win - half
                r = xp.pad(r, (half, self.window_length - half), mode=mode)
            step = r.strides[0]
            view = xp.lib.stride_tricks.as_strided(r, shape=(n, self.window_length),
                                                   strides=(self.window_step * step, step))
            xp.multiply(view, window, out=out[start:start + n, : self.window_length])
            start += n


def _time_axis(layout: str) -> int:
    if layout not in _LAYOUTS:
        raise ConfigError(f"layout {layout!r}; choose one of {', '.join(_LAYOUTS)}")
    return 1 if layout == "ft" else 0


class MelFilterBank(Op):
    """DALI's ``mel_filter_bank``: spectrogram rows (``layout``, "ft" as
    ``spectrogram`` gives them) through ``nfilter`` triangular filters
    (``mel_filters``; ``freq_high`` 0 means ``sample_rate / 2``; ``mel_formula``
    "slaney" or "htk"). The number of FFT bins comes from the rows. One matrix product
    for the batch's frames."""

    def __init__(self, sample_rate: float = 44100.0, nfilter: int = 128, freq_low: float = 0.0,
                 freq_high: float = 0.0, mel_formula: str = "slaney", normalize: bool = True,
                 layout: str = "ft", *, field: str = "audio") -> None:
        if mel_formula not in ("slaney", "htk"):
            raise ConfigError(f"mel_formula {mel_formula!r}; choose 'slaney' or 'htk'")
        high = float(freq_high) if freq_high else sample_rate / 2.0
        if not 0 <= freq_low < high <= sample_rate / 2.0:
            raise ConfigError(f"need 0 <= freq_low < freq_high <= sample_rate / 2; got {freq_low}, {high}, "
                              f"{sample_rate / 2}")
        self.sample_rate, self.nfilter, self.freq_low, self.freq_high = float(sample_rate), int(nfilter), \
            float(freq_low), high
        self.mel_formula, self.normalize, self.field = mel_formula, bool(normalize), field
        self.time_axis = _time_axis(layout)
        self._filters: dict[int, np.ndarray] = {}

    def filters(self, bins: int) -> np.ndarray:
        """The filter bank for spectrograms of ``bins`` bins, ``[bins, nfilter]`` float32."""
        if bins not in self._filters:
            self._filters[bins] = mel_filters(self.sample_rate, 2 * (bins - 1), self.nfilter, self.freq_low,
                                              self.freq_high, self.mel_formula, self.normalize).T.astype(np.float32)
        return self._filters[bins]

    def __call__(self, batch: Batch) -> Batch:
        return _matmul_op(batch, self.field, self.time_axis, self.filters, sparse=True)


class MFCC(Op):
    """DALI's ``mfcc``: a DCT (``dct_type`` 1-4; orthonormal with ``normalize``) of
    each frame of a mel spectrogram over ``axis`` (0: the mel axis of "ft" rows),
    keeping ``n_mfcc`` coefficients, then, with ``lifter`` > 0, coefficient ``i``
    times ``1 + sin(pi * (i + 1) / lifter) * lifter / 2``."""

    def __init__(self, n_mfcc: int = 20, dct_type: int = 2, normalize: bool = False, lifter: float = 0.0,
                 axis: int = 0, *, field: str = "audio") -> None:
        if dct_type not in (1, 2, 3, 4):
            raise ConfigError(f"dct_type {dct_type!r}; choose 1, 2, 3 or 4")
        if dct_type == 1 and normalize:
            raise ConfigError("mfcc: normalize is not supported with dct_type=1 (as in DALI)")
        if axis not in (0, 1):
            raise ConfigError(f"mfcc axis {axis!r}: rows are 2-D, choose 0 or 1")
        self.n_mfcc, self.dct_type, self.normalize, self.lifter = int(n_mfcc), dct_type, bool(normalize), lifter
        self.time_axis, self.field = 1 - axis, field
        self._mats: dict[int, np.ndarray] = {}

    def matrix(self, n_in: int) -> np.ndarray:
        """``[n_in, n_mfcc]`` float32: the DCT and lifter for ``n_in`` mel bands."""
        if n_in not in self._mats:
            if self.n_mfcc > n_in:
                raise ConfigError(f"n_mfcc={self.n_mfcc} is more than the {n_in} mel bands")
            m = dct_matrix(self.n_mfcc, n_in, self.dct_type, self.normalize)
            if self.lifter:
                i = np.arange(self.n_mfcc, dtype=np.float64)
                m *= (1.0 + np.sin(np.pi * (i + 1) / self.lifter) * self.lifter / 2.0)[:, None]
            self._mats[n_in] = m.T.astype(np.float32)
        return self._mats[n_in]

    def __call__(self, batch: Batch) -> Batch:
        return _matmul_op(batch, self.field, self.time_axis, self.matrix)


def _matmul_op(batch: Batch, field: str, time_axis: int, matrix: Any, sparse: bool = False) -> Batch:
    """Every frame of 2-D rows times ``matrix(features)`` ``[features, out]``: one
    product over the packed batch; rows keep their layout. ``sparse``: each column of
    the matrix is zero outside a short span (a filter bank), which the host sums alone."""
    rows = rows_of(batch.data[field])
    if not rows:
        return batch
    xp = batch.xp
    if rows[0].ndim != 2:
        raise ConfigError(f"expected 2-D feature rows; got shape {rows[0].shape}")
    packed, counts = pack(xp, rows, time_axis)
    weights = xp.asarray(matrix(packed.shape[1]))
    out = empty(xp, (len(packed), weights.shape[1]), np.float32)
    if sparse and xp is np and _audio is not None:
        _audio.sparse_matmul(np.ascontiguousarray(packed, np.float32), np.ascontiguousarray(weights),
                             weights.shape[0], weights.shape[1], out)
    else:
        xp.matmul(packed.astype(xp.float32, copy=False), weights, out=out)
    batch.data[field] = unpack(out, counts, time_axis)
    return batch


class ToDecibels(Op):
    """DALI's ``to_decibels``: ``multiplier * log10(max(10**(cutoff_db / multiplier),
    x / reference))``; ``reference`` None (DALI's 0) is each row's largest value."""

    def __init__(self, multiplier: float = 10.0, reference: float | None = None, cutoff_db: float = -200.0, *,
                 field: str = "audio") -> None:
        self.multiplier, self.cutoff_db, self.field = float(multiplier), float(cutoff_db), field
        self.reference = float(reference) if reference else None

    def __call__(self, batch: Batch) -> Batch:
        rows = rows_of(batch.data[self.field])
        if not rows:
            return batch
        xp = batch.xp
        ragged = ragged_axis(rows)
        x, counts = pack(xp, rows, ragged)
        x = x.astype(xp.float32, copy=False)
        out = empty(xp, x.shape, np.float32)
        if self.reference is None:
            flat = x.reshape(len(x), -1).max(axis=1) if x.ndim > 1 else x
            ref = segment_max(xp, flat, counts).astype(xp.float32)
            scale = (1.0 / xp.where(ref > 0, ref, 1.0)).astype(xp.float32)
            per_row = xp.asarray(np.repeat(np.arange(len(rows)), counts))
            xp.multiply(x, scale[per_row].reshape((-1,) + (1,) * (x.ndim - 1)), out=out)
        else:
            xp.multiply(x, np.float32(1.0 / self.reference), out=out)
        xp.maximum(out, np.float32(10.0 ** (self.cutoff_db / self.multiplier)), out=out)
        xp.log10(out, out=out)
        out *= np.float32(self.multiplier)
        batch.data[self.field] = unpack(out, counts, ragged)
        return batch


def spectrogram(nfft: int | None = None, window_length: int = 512, window_step: int = 256, power: int = 2,
                center_windows: bool = True, reflect_padding: bool = True, window_fn: Any = None,
                layout: str = "ft", *, field: str = "audio") -> Spectrogram:
    """See ``Spectrogram``."""
    return Spectrogram(nfft, window_length, window_step, power, center_windows, reflect_padding, window_fn,
                       layout, field=field)


def mel_filter_bank(sample_rate: float = 44100.0, nfilter: int = 128, freq_low: float = 0.0,
                    freq_high: float = 0.0, mel_formula: str = "slaney", normalize: bool = True,
                    layout: str = "ft", *, field: str = "audio") -> MelFilterBank:
    """See ``MelFilterBank``."""
    return MelFilterBank(sample_rate, nfilter, freq_low, freq_high, mel_formula, normalize, layout, field=field)


def to_decibels(multiplier: float = 10.0, reference: float | None = None, cutoff_db: float = -200.0, *,
                field: str = "audio") -> ToDecibels:
    """See ``ToDecibels``."""
    return ToDecibels(multiplier, reference, cutoff_db, field=field)


def mfcc(n_mfcc: int = 20, dct_type: int = 2, normalize: bool = False, lifter: float = 0.0, axis: int = 0, *,
         field: str = "audio") -> MFCC:
    """See ``MFCC``."""
    return MFCC(n_mfcc, dct_type, normalize, lifter, axis, field=field)
