"""Audio: ``decode_audio`` and DALI's waveform ops ``preemphasis_filter``,
``nonsilent_region`` and ``slice``, with DALI's names, parameters and defaults.

Each op reads and writes ``audio`` by default: per row a waveform ``[T]`` (or
``[T, C]`` without downmix), float32, samples in [-1, 1]. The ops compute per
batch, not per sample: rows lie end to end in one array (``gpuio.ops.ragged``), which
CuPy works through in one pass and the host in one C call (``ops/_audio.c``, the GIL
released; where it was not built, NumPy computes the same numbers); no
Python loop runs per window or per value.

Decoding is libsndfile's (``soundfile``: WAV, FLAC, OGG/Vorbis, Opus, MP3), on the
host, from the bytes the storage core read (the file is never opened again by
path). FLAC files go to gpuio's own decoder (``ops/_flac.c``, written from RFC 9639:
every FLAC file of a batch in one C call, the GIL released, so that a batch costs one
call and other threads run meanwhile; ``bench/audio.py --decode`` compares it with
libsndfile and DALI), which gives the samples libsndfile
gives, bit for bit, in every dtype; a file it does not take (a frame changing format, a
32-bit stereo-decorrelated stream, no sample count in STREAMINFO), or every FLAC file
where the extension was not built, libsndfile decodes. A corrupt FLAC frame (CRC,
reserved codes, data ending inside it) is a ``FormatError`` naming its byte offset.
On a GPU batch the decoded batch is uploaded in one copy.

Resampling (``decode_audio(sample_rate=...)``) is ``scipy.signal.resample_poly``: a
polyphase FIR (Kaiser window, beta 5, ``10 * max(up, down)`` taps per phase) at the
rate ratio reduced to lowest terms, linear phase, no dependency beyond SciPy. Its
quality is below soxr's: measured on 3 s of tones and noise taken to 16 kHz from 8,
22.05, 44.1 and 48 kHz, its output is 45-50 dB SNR from soxr "VHQ" (soxr "HQ": 70-76
dB) and a 10 kHz tone (above the new Nyquist) is left at -57 dB (soxr HQ: below -130
dB). Enough for speech features; resample offline with soxr where it is not.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError, DependencyError, FormatError
from gpuio.ops.ragged import empty, pack, rows_of, segment_max, segment_span, to_host, unpack

try:
    from gpuio.ops import _audio
except ImportError:  # built at install where a C compiler exists; else NumPy computes the same
    _audio = None
try:
    from gpuio.ops import _flac
except ImportError:  # built where a C compiler exists; else libsndfile decodes FLAC
    _flac = None


@contextlib.contextmanager
def flac_by_libsndfile() -> Iterator[None]:
    """Inside: FLAC decoded by libsndfile (``soundfile``), as where gpuio's own decoder
    (``ops/_flac.c``) was not built; for comparing the two."""
    global _flac
    native, _flac = _flac, None
    try:
        yield
    finally:
        _flac = native

__all__ = ["DecodeAudio", "PreemphasisFilter", "NonsilentRegion", "Slice", "decode_audio",
           "preemphasis_filter", "nonsilent_region", "slice", "AUDIO_EXTENSIONS", "audio_dependency"]

AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".opus", ".mp3")
_DTYPES = ("float32", "float64", "int16", "int32")  # also _flac.decode's dtype codes, in this order
_BORDERS = ("zero", "clamp", "reflect")


def audio_dependency(module: str) -> Any:
    """Import ``module`` (soundfile, scipy.*), or say that the ``audio`` extra has it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DependencyError(f"audio ops need {module!r} ({exc}); install it with pip install "
                              f"'gpuio[audio]'") from exc


def _wav_shortfall(buf: memoryview) -> tuple[int, int] | None:
    """(declared, present) bytes of a RIFF/WAVE file's data chunk when the file ends
    before the chunk does (libsndfile then silently decodes what is there)."""
    if len(buf) < 12 or buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
        return None
    pos = 12
    while pos + 8 <= len(buf):
        cid = bytes(buf[pos:pos + 4])
        (size,) = struct.unpack_from("<I", buf, pos + 4)
        if cid == b"data":
            present = len(buf) - pos - 8
            # 0 and 0xFFFFFFFF mark a stream whose size was not known when written
            return (size, present) if size not in (0, 0xFFFFFFFF) and present < size else None
        pos += 8 + size + (size & 1)
    return None


class _FlacStream:
    """A FLAC file for ``gpuio.ops._flac``: STREAMINFO's rate (Hz), channels, bits per
    sample and total samples, and the byte where the first frame starts."""

    def __init__(self, data: memoryview, samplerate: int, channels: int, bits: int, frames: int,
                 start: int) -> None:
        self.data, self.samplerate, self.channels, self.bits = data, samplerate, channels, bits
        self.frames, self.start = frames, start

    @classmethod
    def parse(cls, data: memoryview) -> _FlacStream | None:
        """The stream in ``data``, or None where ``_flac`` should not decode it (not a
        native FLAC stream, STREAMINFO not first, total samples unknown, bytes missing):
        libsndfile then decodes it, or says what is wrong."""
        if _flac is None or len(data) < 42 or data[:4] != b"fLaC" or data[4] & 0x7F or data[5:8] != b"\0\0\x22":
            return None
        # STREAMINFO after its 10 bytes of block and frame sizes: rate 20 bits, channels - 1
        # 3 bits, bits per sample - 1 5 bits, total samples 36 bits
        info = int.from_bytes(data[18:26], "big")
        rate, channels, bits, frames = info >> 44, (info >> 41 & 7) + 1, (info >> 36 & 31) + 1, info & (1 << 36) - 1
        pos = 4
        while True:  # the metadata blocks: 1 bit last-block flag, 7 bits type, 24 bits size
            if pos + 4 > len(data):
                return None
            last = data[pos] & 0x80
            pos += 4 + int.from_bytes(data[pos + 1:pos + 4], "big")
            if last:
                break
        if frames == 0 or bits < 4 or pos >= len(data):
            return None
        return cls(data, rate, channels, bits, frames, pos)

    def capacity(self) -> int:
        """The most samples the bytes after the metadata can hold: frames of at most
        65536 samples, each at least 9 bytes (header, one subframe byte, CRC-16)."""
        return -(-(len(self.data) - self.start) // 9) * 65536

    def close(self) -> None:
        pass


class _Reader:
    """A read-only binary file over bytes in memory, for libsndfile's virtual I/O
    (``io.BytesIO`` would first copy the whole file)."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    def readinto(self, buf: Any) -> int:
        n = max(min(len(buf), len(self.data) - self.pos), 0)
        memoryview(buf).cast("B")[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size < 0 else min(self.pos + size, len(self.data))
        out = bytes(self.data[self.pos:end])
        self.pos = max(self.pos, end)
        return out

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.data)}[whence]
        self.pos = max(base + offset, 0)
        return self.pos

    def tell(self) -> int:
        return self.pos


def _resample(x: np.ndarray, rate: float, target: float) -> np.ndarray:
    up, down = _ratio(rate, target)
    return audio_dependency("scipy.signal").resample_poly(x, up, down, axis=0).astype(x.dtype, copy=False)


def _ratio(rate: float, target: float) -> tuple[int, int]:
    """``target / rate`` as a ratio of integers in lowest terms (rates in Hz; rates
    that are not whole numbers are rounded to 1/100 Hz)."""
    a, b = round(target * 100), round(rate * 100)
    g = math.gcd(a, b)
    return a // g, b // g


class DecodeAudio(Op):
    """Decode ``field`` (encoded bytes per row) into ``out`` (``[T]``, or ``[T, C]``
    with ``downmix=False``; ``dtype`` samples, floats in [-1, 1]) and the file's (or
    the target) rate in Hz into ``rate_out`` (float32 ``[B]``).

    ``downmix``: the mean of the channels. ``sample_rate``: resample to it (see the
    module docstring for the method). When the batch has the fields ``offset_field``
    and ``duration_field`` (seconds, as ``formats.manifest`` gives them), only
    ``[offset, offset + duration)`` is decoded (a duration <= 0 or NaN: to the end);
    the file is seeked there, not decoded from its start where the codec allows.

    Bad input: bytes that are not audio, a file cut short (fewer frames than its
    header declares), or an offset past the end are a ``FormatError`` naming the
    sample (the loader adds the file), or skipped rows under ``on_error="skip"``.
    """

    def __init__(self, sample_rate: float | None = None, downmix: bool = True, dtype: str = "float32", *,
                 field: str = "data", out: str = "audio", rate_out: str = "sample_rate",
                 offset_field: str | None = "offset", duration_field: str | None = "duration") -> None:
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
        if sample_rate is not None and (sample_rate <= 0 or dtype not in ("float32", "float64")):
            raise ConfigError(f"sample_rate={sample_rate!r}: resampling needs a rate > 0 and a float dtype")
        self.sample_rate, self.downmix, self.dtype = sample_rate, bool(downmix), dtype
        self.field, self.out, self.rate_out = field, out, rate_out
        self.offset_field, self.duration_field = offset_field, duration_field
        self.host_inputs = (field,)

    def __call__(self, batch: Batch) -> Batch:
        sf = audio_dependency("soundfile")
        bufs = batch.data[self.field]
        offsets = batch.data.get(self.offset_field) if self.offset_field else None
        durations = batch.data.get(self.duration_field) if self.duration_field else None
        opened: list[tuple[Any, int, int] | None] = []  # (SoundFile, first frame, frames) per row
        for row, buf in enumerate(bufs):
            try:
                opened.append(self._open(sf, buf, row, batch, offsets, durations))
            except FormatError as exc:
                opened.append(None)
                batch.reject(row, exc)
        try:
            audio, rates = self._read(sf, batch, opened)
        finally:
            for item in opened:
                if item is not None:
                    item[0].close()
        if batch.device.is_cuda:  # one upload for the batch, on the batch's stream
            with batch.on_device() as cp:
                packed, lengths = pack(np, audio, 0)
                audio = unpack(cp.asarray(packed), lengths, 0)
        batch.data[self.out] = audio
        batch.data[self.rate_out] = rates
        batch.drop_rejected()
        return batch

    def _open(self, sf: Any, buf: Any, row: int, batch: Batch, offsets: Any,
              durations: Any) -> tuple[Any, int, int]:
        sample = int(batch.index[row])
        data = memoryview(np.ascontiguousarray(buf if isinstance(buf, np.ndarray)
                                               else np.frombuffer(buf, np.uint8))).cast("B")
        short = _wav_shortfall(data)
        if short is not None:
            raise FormatError(f"WAV file cut short: its data chunk declares {short[0]} bytes, "
                              f"{short[1]} are present", sample=sample)
        f = _FlacStream.parse(data) or self._soundfile(sf, data, sample)
        if isinstance(f, _FlacStream) and f.frames > f.capacity():  # before the batch buffer is sized by it
            raise FormatError(f"FLAC STREAMINFO declares {f.frames} samples; the {len(data) - f.start} bytes "
                              f"of frames hold at most {f.capacity()}", offset=18, sample=sample)
        first, frames = 0, f.frames
        offset = 0.0 if offsets is None else float(offsets[row])
        duration = 0.0 if durations is None else float(durations[row])
        if not math.isfinite(offset) or math.isinf(duration):  # a NaN duration: not given, to the end
            f.close()
            raise FormatError(f"offset {offset} s, duration {duration} s: give finite seconds", sample=sample)
        if offsets is not None:
            first = round(offset * f.samplerate)
            if not 0 <= first <= f.frames:
                f.close()
                raise FormatError(f"offset {offset} s is outside the file's "
                                  f"{f.frames / f.samplerate:.3f} s", sample=sample)
        if duration > 0:  # NaN compares false
            frames = round(duration * f.samplerate)
        return f, first, min(frames, f.frames - first)

    @staticmethod
    def _soundfile(sf: Any, data: memoryview, sample: int) -> Any:
        try:
            return sf.SoundFile(_Reader(data))
        except (sf.SoundFileError, RuntimeError, TypeError) as exc:
            raise FormatError(f"not an audio file libsndfile reads ({len(data)} bytes): {exc}",
                              sample=sample) from exc

    def _read(self, sf: Any, batch: Batch, opened: list[Any]) -> tuple[list[np.ndarray], np.ndarray]:
        """Decode the opened rows into one host buffer, rows end to end."""
        mono = self.downmix
        channels = [item[0].channels if item else 1 for item in opened]
        if not mono and len(set(c for c, item in zip(channels, opened) if item)) > 1:
            raise ConfigError(f"decode_audio(downmix=False): the batch mixes channel counts "
                              f"{sorted(set(channels))}; downmix or batch files alike")
        width = 1 if mono else max(channels, default=1)
        counts = np.array([item[2] if item else 0 for item in opened], dtype=np.int64)
        buffer = empty(np, (int(counts.sum()), width), self.dtype)
        rows = unpack(buffer, counts, 0)
        rates = np.zeros(len(opened), dtype=np.float32)
        # libsndfile's PCM_16 rows are read as int16 into one reused buffer (fresh arrays
        # page-fault per row); FLAC rows decode straight into their rows
        sizes = [c for c, item in zip(counts.tolist(), opened) if item and not isinstance(item[0], _FlacStream)]
        scratch = empty(np, (max(sizes, default=0) * width,), np.int16)
        flac_jobs, flac_rows = [], []
        for row, item in enumerate(opened):
            if item is None:
                continue
            f, first, frames = item
            rates[row] = f.samplerate
            if isinstance(f, _FlacStream):
                flac_jobs.append((f.data, f.start, first, frames, f.channels, f.bits, rows[row]))
                flac_rows.append(row)
            else:
                self._read_row(sf, batch, row, f, first, frames, rows[row], scratch)
        if flac_jobs:  # every FLAC file of the batch in one call
            results = _flac.decode(flac_jobs, _DTYPES.index(self.dtype), mono)
            for row, job, (status, _, at, error) in zip(flac_rows, flac_jobs, results):
                sample = int(batch.index[row])
                if status == 1:
                    batch.reject(row, FormatError(f"cannot decode FLAC: {error} (the frame at byte {at})",
                                                  offset=at, sample=sample))
                elif status == 2:  # a stream the C decoder does not take: libsndfile's turn
                    try:
                        f = self._soundfile(sf, job[0], sample)
                    except FormatError as exc:
                        batch.reject(row, exc)
                        continue
                    with f:
                        self._read_row(sf, batch, row, f, *opened[row][1:], rows[row], scratch)
        audio = [r[:, 0] if mono else r for r in rows]
        if self.sample_rate is not None:
            target = float(self.sample_rate)
            audio = [_resample(a, float(rt), target) if rt and rt != target else a
                     for a, rt in zip(audio, rates.tolist())]
            rates[rates > 0] = target
            packed, lengths = pack(np, audio, 0)  # end to end again, for the next op
            audio = unpack(packed, lengths, 0)
        return audio, rates

    def _read_row(self, sf: Any, batch: Batch, row: int, f: Any, first: int, frames: int, out: np.ndarray,
                  scratch: np.ndarray) -> None:
        """Frames ``[first, first + frames)`` of the open SoundFile ``f`` into ``out``
        (``[frames, width]``); a decoding error or a short read rejects ``row``."""
        width = out.shape[1]
        try:
            if first:
                f.seek(first)
            if f.channels == width and self.dtype == "float32" and f.subtype == "PCM_16" and \
                    len(scratch) >= frames * width:
                # the same floats as libsndfile's conversion (x / 32768), several times faster
                ints = f.read(frames, dtype="int16", always_2d=True,
                              out=scratch[:frames * width].reshape(frames, width))
                got = np.multiply(ints, np.float32(1 / 32768), out=out[:len(ints)])
            elif f.channels == width:
                got = f.read(frames, dtype=self.dtype, always_2d=True, out=out)
            else:  # downmix: average the channels
                got = f.read(frames, dtype=self.dtype, always_2d=True)
                mean = got.mean(axis=1, keepdims=True, dtype=np.float64)
                out[:len(got)] = mean if self.dtype.startswith("float") else np.rint(mean)
        except (sf.SoundFileError, RuntimeError) as exc:
            batch.reject(row, FormatError(f"cannot decode audio: {exc}", sample=int(batch.index[row])))
            return
        if len(got) < frames:
            batch.reject(row, FormatError(f"audio cut short: {frames} frames expected from the "
                                          f"header, {len(got)} decoded", sample=int(batch.index[row])))


class PreemphasisFilter(Op):
    """DALI's ``preemphasis_filter``: ``y[t] = x[t] - preemph_coeff * x[t-1]``, with
    ``x[-1]`` = 0 (``border="zero"``), ``x[0]`` (``"clamp"``) or ``x[1]``
    (``"reflect"``). Float32 out."""

    def __init__(self, preemph_coeff: float = 0.97, border: str = "clamp", *, field: str = "audio") -> None:
        if border not in _BORDERS:
            raise ConfigError(f"border {border!r}; choose one of {', '.join(_BORDERS)}")
        self.preemph_coeff, self.border, self.field = float(preemph_coeff), border, field

    def __call__(self, batch: Batch) -> Batch:
        rows = rows_of(batch.data[self.field])
        if not rows:
            return batch
        xp = batch.xp
        x, lengths = pack(xp, rows, 0)
        x = x.astype(xp.float32, copy=False)
        c = np.float32(self.preemph_coeff)
        y = empty(xp, x.shape, np.float32)
        if xp is np and _audio is not None:
            _audio.preemphasis(np.ascontiguousarray(x), y, lengths, c, _BORDERS.index(self.border))
            batch.data[self.field] = unpack(y, lengths, 0)
            return batch
        xp.multiply(x[:-1], -c, out=y[1:])
        y[1:] += x[1:]
        starts = np.cumsum(lengths) - lengths
        nonempty = starts[lengths > 0]
        if len(nonempty):
            first = xp.asarray(nonempty)
            if self.border == "zero":
                y[first] = x[first]
            elif self.border == "clamp":
                y[first] = x[first] - c * x[first]
            else:
                second = xp.asarray(np.where(lengths[lengths > 0] > 1, nonempty + 1, nonempty))
                y[first] = x[first] - c * x[second]
        batch.data[self.field] = unpack(y, lengths, 0)
        return batch


def _ordered_cumsum(xp: Any, terms: Any) -> Any:
    """float32 cumulative sums along axis 1 of a C-contiguous ``[rows, width]`` array,
    each row added strictly in order (the float32 roundings of a sequential loop):
    NumPy's accumulate does; CuPy's cumsum is a parallel scan, so a thread per row."""
    if xp is np:
        return np.cumsum(terms, axis=1, dtype=np.float32)
    kernel = xp.ElementwiseKernel(
        "raw float32 terms, int64 width", "raw float32 sums",
        "float s = 0.0f; for (long long j = i * width; j < (i + 1) * width; ++j) { s += terms[j]; sums[j] = s; }",
        "gpuio_ordered_cumsum")
    sums = xp.empty_like(terms)
    if terms.size:
        kernel(terms, terms.shape[1], sums, size=terms.shape[0])
    return sums


class NonsilentRegion(Op):
    """DALI's ``nonsilent_region`` on mono audio, computed as DALI 2.4's CPU operator
    computes it. Per sample ``k`` of a row, the short-term power is the mean of ``x**2``
    over the ``w = min(window_length, T)`` samples up to ``k`` (fewer at the row's start),
    a float32 running sum: add ``x[k]**2``, read the power, subtract the square of the
    window's first sample; every ``reset_interval`` samples (-1: never) the sum restarts
    from the ``w - 1`` samples before, added in order. A sample is loud when its power
    reaches, in float32, ``reference_power`` (default: the row's largest power) times
    ``10 ** (cutoff_db / 10)``. ``out`` gets, per row, the start of the first loud
    sample's window and the length up to the last loud sample (int64 ``[B]`` each; 0
    and 0 when no sample is loud)."""

    def __init__(self, cutoff_db: float = -60.0, window_length: int = 2048, reference_power: float | None = None,
                 reset_interval: int = 8192, *, field: str = "audio", out: Sequence[str] = ("begin", "length")) -> None:
        if window_length < 1:
            raise ConfigError(f"window_length must be >= 1, got {window_length}")
        if reset_interval != -1 and (reset_interval < 1 or reset_interval % window_length):
            raise ConfigError(f"reset_interval ({reset_interval}) must be -1 or a multiple of "
                              f"window_length ({window_length}), as in DALI")
        if len(out) != 2:
            raise ConfigError(f"out names two fields (begin, length), got {out!r}")
        self.cutoff_db, self.window_length = float(cutoff_db), int(window_length)
        self.reference_power, self.reset_interval = reference_power, reset_interval
        self.field, self.out = field, tuple(out)

    def __call__(self, batch: Batch) -> Batch:
        rows = rows_of(batch.data[self.field])
        begin = np.zeros(len(rows), dtype=np.int64)
        length = np.zeros(len(rows), dtype=np.int64)
        if rows:
            if rows[0].ndim != 1:
                raise ConfigError(f"nonsilent_region needs mono audio [T]; got rows of shape {rows[0].shape} "
                                  f"(decode with downmix=True)")
            begin, length = self.regions(batch.xp, rows)
        batch.data[self.out[0]], batch.data[self.out[1]] = begin, length
        return batch

    def regions(self, xp: Any, rows: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """(begin, length) per row, host int64 arrays."""
        x, lengths = pack(xp, rows, 0)
        # DALI's threshold factor: float32 10 ** (cutoff_db * (1 / 10)), times the reference in float32
        ratio = np.float32(10) ** (np.float32(self.cutoff_db) * (np.float32(1) / np.float32(10)))
        fixed = None if self.reference_power is None else np.float32(self.reference_power) * ratio
        if xp is not np:  # one pass over the batch
            return self._regions(xp, x, lengths, ratio, fixed)
        begin = np.zeros(len(rows), dtype=np.int64)
        length = np.zeros(len(rows), dtype=np.int64)
        if _audio is not None and x.dtype == np.float32:  # _regions of one row at a time, in one pass
            _audio.nonsilent(np.ascontiguousarray(x), lengths, self.window_length, self.reset_interval,
                             float(ratio), math.nan if fixed is None else float(fixed), begin, length)
            return begin, length
        ends = np.cumsum(lengths)
        for r, (s0, s1) in enumerate(zip((ends - lengths).tolist(), ends.tolist())):
            begin[r:r + 1], length[r:r + 1] = self._regions(np, x[s0:s1], lengths[r:r + 1], ratio, fixed)
        return begin, length

    def _regions(self, xp: Any, x: Any, lengths: np.ndarray, ratio: np.float32,
                 fixed: np.float32 | None) -> tuple[np.ndarray, np.ndarray]:
        starts = np.cumsum(lengths) - lengths
        w = np.minimum(lengths, self.window_length)  # DALI shortens the window to a shorter row
        interval = np.maximum(lengths, 1) if self.reset_interval == -1 else np.full_like(lengths, self.reset_interval)
        # blocks of samples that share one running sum: row, first sample, number of samples
        blocks = -(-lengths // interval)
        row = np.repeat(np.arange(len(lengths)), blocks)
        first = (np.arange(len(row)) - np.repeat(np.cumsum(blocks) - blocks, blocks)) * interval[row]
        size = np.minimum(interval[row], lengths[row] - first)
        # per block, the terms its float32 running sum adds in order: the squares of the
        # w - 1 samples before it, then per sample k +x[k]**2 (power[k] is the sum here) and
        # -x[k + 1 - w]**2; a cumulative sum along each block adds them in that order
        wb, sb, origin, start = (xp.asarray(a[:, None]) for a in (w[row], size, starts[row] + first, first))
        rel = xp.arange(int((w[row] - 1 + 2 * size).max(initial=0)))[None, :] - (wb - 1)
        leave = (rel >= 0) & (rel % 2 == 1)
        at = xp.where(rel < 0, rel, xp.where(leave, rel // 2 + 1 - wb, rel // 2))  # sample, from the block's first
        used = (at + start >= 0) & (rel < 2 * sb)
        sq = xp.square(x.astype(xp.float32, copy=False))
        term = sq[xp.where(used, origin + at, 0)]
        term = xp.where(used, xp.where(leave, -term, term), xp.float32(0))
        sums = _ordered_cumsum(xp, term)
        power = (sums * (xp.float32(1) / wb.astype(xp.float32)))[(rel >= 0) & ~leave & (rel < 2 * sb)]
        if fixed is None:  # the largest power as DALI takes it: NaNs skipped, unless the first is NaN
            top = segment_max(xp, xp.where(xp.isnan(power), xp.float32(-np.inf), power), lengths)
            head = power[xp.asarray(np.minimum(starts, max(len(power) - 1, 0)))] if len(power) else top
            threshold = xp.where(xp.isnan(head), head, top) * xp.float32(ratio)
        else:
            threshold = xp.full(len(lengths), fixed, dtype=xp.float32)
        loud_first, loud_last = segment_span(xp, power, threshold, lengths)
        found = loud_last >= 0
        begin = np.where(found, np.maximum(loud_first - (w - 1), 0), 0)
        return begin, np.where(found, loud_last - begin + 1, 0)


class Slice(Op):
    """Per row, ``length`` samples of ``field`` from sample ``begin`` along ``axis``,
    where ``begin`` and ``length`` name int fields (``nonsilent_region``'s outputs),
    as DALI's ``slice(data, begin, length, axes=[0])``. Rows become views (no copy);
    a region outside a row is clipped to it."""

    def __init__(self, begin: str = "begin", length: str = "length", axes: Sequence[int] = (0,), *,
                 field: str = "audio") -> None:
        if len(axes) != 1:
            raise ConfigError(f"slice takes one axis, got {axes!r}")
        self.begin, self.length, self.axis, self.field = begin, length, int(axes[0]), field

    def __call__(self, batch: Batch) -> Batch:
        rows = rows_of(batch.data[self.field])
        begin = to_host(batch.data[self.begin]).astype(np.int64).reshape(-1)
        length = to_host(batch.data[self.length]).astype(np.int64).reshape(-1)
        out = []
        for r, b, n in zip(rows, begin.tolist(), length.tolist()):
            index = [np.s_[:]] * r.ndim
            index[self.axis] = np.s_[max(b, 0): max(b, 0) + max(n, 0)]
            out.append(r[tuple(index)])
        batch.data[self.field] = out
        return batch


def decode_audio(sample_rate: float | None = None, downmix: bool = True, dtype: str = "float32", *,
                 field: str = "data", out: str = "audio", rate_out: str = "sample_rate",
                 offset_field: str | None = "offset", duration_field: str | None = "duration") -> DecodeAudio:
    """See ``DecodeAudio``."""
    return DecodeAudio(sample_rate, downmix, dtype, field=field, out=out, rate_out=rate_out,
                       offset_field=offset_field, duration_field=duration_field)


def preemphasis_filter(preemph_coeff: float = 0.97, border: str = "clamp", *,
                       field: str = "audio") -> PreemphasisFilter:
    """See ``PreemphasisFilter``."""
    return PreemphasisFilter(preemph_coeff, border, field=field)


def nonsilent_region(cutoff_db: float = -60.0, window_length: int = 2048, reference_power: float | None = None,
                     reset_interval: int = 8192, *, field: str = "audio",
                     out: Sequence[str] = ("begin", "length")) -> NonsilentRegion:
    """See ``NonsilentRegion``."""
    return NonsilentRegion(cutoff_db, window_length, reference_power, reset_interval, field=field, out=out)


def slice(begin: str = "begin", length: str = "length", axes: Sequence[int] = (0,), *,  # noqa: A001
          field: str = "audio") -> Slice:
    """See ``Slice``."""
    return Slice(begin, length, axes, field=field)
