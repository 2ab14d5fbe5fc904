"""Audio feature ops (preemphasis, nonsilent region + slice, spectrogram, mel filter
bank, decibels, MFCC, normalize over axes, pad) against NumPy references written
from the formulas, one frame or one row at a time; the same bodies on CPU and GPU."""

import sys
import types

import numpy as np
import pytest
import scipy.fft

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device
from gpuio.errors import ConfigError, FormatError
from gpuio.ops.ragged import pack, rows_of, segment_max, segment_span, unpack
from tests.conftest import to_host

LENGTHS = [16000, 4410, 777, 1, 2, 39]


def signals(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * rng.uniform(0.01, 0.5)).astype(np.float32) for n in lengths]


def make_batch(rows, device="cpu", field="audio", on_error="raise", **extra):
    index = np.arange(len(rows))
    dev = Device("cuda", 0) if device == "cuda" else Device("cpu")
    if device == "cuda":
        import cupy

        rows = [cupy.asarray(r) for r in rows]
    return Batch({field: list(rows), **extra}, index, sample_seeds(0, 0, index), dev, on_error=on_error)


def host_rows(batch, field="audio"):
    col = batch.data[field]
    return [to_host(r) for r in col] if isinstance(col, list) else to_host(col)


# ---------------------------------------------------------------- references


def ref_hann(n):
    return np.array([0.5 - 0.5 * np.cos(2 * np.pi * (i + 0.5) / n) for i in range(n)])


def ref_spectrogram(x, nfft, win, step, power=2, center=True, reflect=True):
    x = x.astype(np.float64)
    if center:
        x = np.pad(x, (win // 2, win - win // 2), mode="reflect" if reflect else "constant")
    frames = []
    start = 0
    while start + win <= len(x):
        frame = np.zeros(nfft)
        frame[:win] = x[start:start + win] * ref_hann(win)
        frames.append(np.abs(np.fft.rfft(frame)) ** power)
        start += step
    return np.array(frames).T  # [freq, time]


def slaney_mel(f):
    return f * 3 / 200 if f < 1000 else 15 + 27 * np.log(f / 1000) / np.log(6.4)


def slaney_hz(m):
    return m * 200 / 3 if m < 15 else 1000 * np.exp((m - 15) * np.log(6.4) / 27)


def ref_mel_bank(sr, nfft, nfilter, lo, hi):
    step = (slaney_mel(hi) - slaney_mel(lo)) / (nfilter + 1)
    edges = [slaney_hz(slaney_mel(lo) + k * step) for k in range(nfilter + 2)]
    bank = np.zeros((nfilter, nfft // 2 + 1))
    for m in range(nfilter):
        left, centre, right = edges[m], edges[m + 1], edges[m + 2]
        for k in range(nfft // 2 + 1):
            f = k * sr / nfft
            if left < f <= centre:
                bank[m, k] = (f - left) / (centre - left)
            elif centre < f < right:
                bank[m, k] = (right - f) / (right - centre)
        bank[m] *= 2 / (right - left)
    return bank


def ref_nonsilent(x, cutoff_db, window, reset_interval):
    """DALI's nonsilent_region, one sample at a time: the float32 running sum of squares
    over the last ``window`` samples (add the new square, take the power, subtract the
    leaving square), restarted every ``reset_interval`` samples from the ``window - 1``
    before; the threshold ``max power * 10 ** (cutoff_db / 10)`` in float32."""
    f32 = np.float32
    n, w = len(x), min(window, len(x))
    interval = n if reset_interval == -1 else reset_interval
    power = np.empty(n, f32)
    total = f32(0)
    for k in range(n):
        if k % interval == 0:
            total = f32(0)
            for j in range(max(k - w + 1, 0), k):
                total = f32(total + x[j] * x[j])
        total = f32(total + x[k] * x[k])
        power[k] = total * (f32(1) / f32(w))
        if k + 1 >= w:
            total = f32(total - x[k + 1 - w] * x[k + 1 - w])
    loud = np.nonzero(power >= power.max() * f32(10) ** (f32(cutoff_db) * (f32(1) / f32(10))))[0]
    if len(loud) == 0:
        return 0, 0
    begin = max(loud[0] - (w - 1), 0)
    return begin, loud[-1] - begin + 1


# ---------------------------------------------------------------- ops


def test_pack_is_a_view_of_consecutive_rows_and_a_copy_otherwise():
    base = np.arange(20, dtype=np.float32)
    rows = [base[0:5], base[5:5], base[5:12], base[12:20]]
    packed, lengths = pack(np, rows, 0)
    assert np.shares_memory(packed, base) and lengths.tolist() == [5, 0, 7, 8]
    assert [r.tolist() for r in unpack(packed, lengths, 0)] == [r.tolist() for r in rows]
    gapped = [base[0:5], base[6:9]]
    packed, _ = pack(np, gapped, 0)
    assert not np.shares_memory(packed, base) and packed.tolist() == [0, 1, 2, 3, 4, 6, 7, 8]
    ft = [np.ones((3, 4)), np.zeros((3, 2))]  # [F, T] rows pack along time
    packed, lengths = pack(np, ft, 1)
    assert packed.shape == (6, 3) and lengths.tolist() == [4, 2]
    assert [u.shape for u in unpack(packed, lengths, 1)] == [(3, 4), (3, 2)]


def test_segment_max_and_span_with_empty_rows(device):
    xp = make_batch([np.zeros(1, np.float32)], device).xp
    values = xp.asarray(np.array([3.0, 1.0, 7.0, 2.0, -1.0, 0.5], np.float32))
    lengths = np.array([2, 0, 3, 1])
    assert to_host(segment_max(xp, values, lengths)).tolist() == [3.0, -np.inf, 7.0, 0.5]
    first, last = segment_span(xp, values, xp.asarray(np.array([1.0, 0.0, 1.5, 1.0], np.float32)), lengths)
    assert first.tolist() == [0, -1, 0, -1] and last.tolist() == [1, -1, 1, -1]


@pytest.mark.parametrize("border", ["zero", "clamp", "reflect"])
def test_preemphasis_filter(device, border):
    xs = signals()
    out = host_rows(ops.preemphasis_filter(0.9, border)(make_batch(xs, device)))
    for x, y in zip(xs, out):
        x = x.astype(np.float64)
        prev = {"zero": 0.0, "clamp": x[0], "reflect": x[1] if len(x) > 1 else x[0]}[border]
        ref = [x[0] - 0.9 * prev] + [x[t] - 0.9 * x[t - 1] for t in range(1, len(x))]
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reset_interval", [1024, -1])
def test_nonsilent_region_and_slice(device, reset_interval):
    rng = np.random.default_rng(3)
    xs = []
    for n, a, b in [(20000, 5000, 9000), (6000, 0, 300), (5000, 4000, 5000), (9000, 10, 8990)]:
        x = (rng.standard_normal(n) * 1e-5).astype(np.float32)
        x[a:b] += rng.standard_normal(b - a).astype(np.float32)
        xs.append(x)
    # a tail fading into the cutoff, where the float32 running sum's rounding decides the end
    xs.append((rng.standard_normal(30000) * np.exp(-np.arange(30000) / 3000)).astype(np.float32))
    op = ops.nonsilent_region(cutoff_db=-50, window_length=512, reset_interval=reset_interval)
    batch = op(make_batch(xs, device))
    for x, b, n in zip(xs, batch.data["begin"].tolist(), batch.data["length"].tolist()):
        assert (b, n) == ref_nonsilent(x, -50, 512, reset_interval)
    out = host_rows(ops.slice()(batch))
    for x, y, b, n in zip(xs, out, batch.data["begin"].tolist(), batch.data["length"].tolist()):
        np.testing.assert_array_equal(y, x[b:b + n])


def test_nonsilent_region_all_silent_and_fixed_reference(device):
    xs = [np.zeros(3000, np.float32), np.full(100, 1e-3, np.float32)]
    batch = ops.nonsilent_region(reference_power=1.0, cutoff_db=-40, window_length=64,
                                 reset_interval=-1)(make_batch(xs, device))
    assert batch.data["length"].tolist() == [0, 0]
    with pytest.raises(ConfigError, match="multiple of window_length"):
        ops.nonsilent_region(window_length=100)


@pytest.mark.parametrize("nfft,win,step,power,center,reflect", [
    (512, 320, 160, 2, True, True), (64, 64, 16, 1, True, False), (16, 11, 4, 2, True, True),
    (256, 200, 80, 2, False, True)])
def test_spectrogram(device, nfft, win, step, power, center, reflect):
    xs = [x for x in signals() if center or len(x) >= win]
    op = ops.spectrogram(nfft=nfft, window_length=win, window_step=step, power=power,
                         center_windows=center, reflect_padding=reflect)
    out = host_rows(op(make_batch(xs, device)))
    for x, s in zip(xs, out):
        ref = ref_spectrogram(x, nfft, win, step, power, center, reflect)
        assert s.shape == ref.shape and s.dtype == np.float32
        np.testing.assert_allclose(s, ref, rtol=2e-3, atol=2e-5 * ref.max())
    tf = host_rows(ops.spectrogram(nfft=nfft, window_length=win, window_step=step, power=power,
                                   center_windows=center, reflect_padding=reflect,
                                   layout="tf")(make_batch(xs, device)))
    for a, b in zip(out, tf):
        np.testing.assert_array_equal(a, b.T)


def test_spectrogram_rejects_rows_shorter_than_a_window(device):
    xs = signals([1000, 50, 600])
    op = ops.spectrogram(window_length=512, window_step=256, center_windows=False)
    with pytest.raises(FormatError, match="shorter than one window"):
        op(make_batch(xs, device))
    batch = op(make_batch(xs, device, on_error="skip"))
    assert [s.shape for s in host_rows(batch)] == [(257, 2), (257, 1)] and batch.index.tolist() == [0, 2]


@pytest.mark.parametrize("layout", ["ft", "tf"])
def test_mel_filter_bank_and_decibels(device, layout):
    xs = signals()
    spec = ops.spectrogram(nfft=512, window_length=400, window_step=160, layout=layout)
    mel = ops.mel_filter_bank(sample_rate=16000, nfilter=40, freq_low=20, freq_high=7600, layout=layout)
    batch = mel(spec(make_batch(xs, device)))
    bank = ref_mel_bank(16000, 512, 40, 20, 7600)
    mels = host_rows(batch)
    for x, m in zip(xs, mels):
        ref = bank @ ref_spectrogram(x, 512, 400, 160)
        m = m if layout == "ft" else m.T
        assert m.shape == ref.shape
        np.testing.assert_allclose(m, ref, rtol=1e-3, atol=1e-6 * ref.max())
    db = host_rows(ops.to_decibels(cutoff_db=-80)(batch))
    for m, d in zip(mels, db):
        ref = 10 * np.log10(np.maximum(m.astype(np.float64) / m.max(), 1e-8))
        np.testing.assert_allclose(d, ref, atol=1e-3)
    fixed = host_rows(ops.to_decibels(multiplier=20, reference=2.0)(make_batch([np.array([2.0, 0.2, 0.0], np.float32)],
                                                                                device)))
    np.testing.assert_allclose(fixed[0], [0.0, -20.0, -200.0], atol=1e-4)


@pytest.mark.parametrize("dct_type,normalize,lifter", [(2, False, 0), (2, True, 22), (3, True, 0), (1, False, 0),
                                                      (4, False, 0)])
def test_mfcc_matches_scipy_dct(device, dct_type, normalize, lifter):
    rng = np.random.default_rng(4)
    rows = [rng.standard_normal((40, n)).astype(np.float32) for n in (7, 1, 30)]
    out = host_rows(ops.mfcc(n_mfcc=13, dct_type=dct_type, normalize=normalize, lifter=lifter)(make_batch(rows, device)))
    for r, m in zip(rows, out):
        # DALI's unnormalized DCTs are scipy's without the factor 2
        ref = scipy.fft.dct(r.astype(np.float64), type=dct_type, axis=0, norm="ortho" if normalize else None)[:13]
        ref = ref if normalize else ref / 2
        if lifter:
            ref *= (1 + np.sin(np.pi * np.arange(1, 14) / lifter) * lifter / 2)[:, None]
        np.testing.assert_allclose(m, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("axes", [(1,), (0,), (0, 1), None])
def test_normalize_axes(device, axes):
    rng = np.random.default_rng(5)
    rows = [(rng.standard_normal((8, n)) * 3 + 7).astype(np.float32) for n in (50, 3, 20)]
    rows.append(np.ones((8, 4), np.float32))  # zero deviation gives 0
    out = host_rows(ops.normalize_axes(axes, epsilon=0.0, scale=2.0, shift=1.0)(make_batch(rows, device)))
    for r, y in zip(rows, out):
        r = r.astype(np.float64)
        ax = tuple(axes) if axes is not None else (0, 1)
        std = r.std(axis=ax, keepdims=True)
        ref = np.where(std > 0, 2 * (r - r.mean(axis=ax, keepdims=True)) / np.where(std > 0, std, 1), 0) + 1
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    batch_wide = host_rows(ops.normalize_axes((1,), batch=True, ddof=1)(make_batch(rows[:3], device)))
    everything = np.concatenate(rows[:3], axis=1).astype(np.float64)
    mean, std = everything.mean(axis=1, keepdims=True), everything.std(axis=1, ddof=1, keepdims=True)
    for r, y in zip(rows, batch_wide):
        np.testing.assert_allclose(y, (r - mean) / std, rtol=1e-4, atol=1e-4)


def test_pad_to_batch_max_fixed_shape_and_multiple(device):
    rows = [np.ones((4, n), np.float32) * (k + 1) for k, n in enumerate((5, 17, 2))]
    batch = ops.pad(axes=(1,), align=8, fill_value=-1.0)(make_batch(rows, device))
    out = to_host(batch.data["audio"])
    assert out.shape == (3, 4, 24) and batch.data["lengths"].tolist() == [5, 17, 2]
    for k, r in enumerate(rows):
        n = r.shape[1]
        np.testing.assert_array_equal(out[k, :, :n], r)
        assert (out[k, :, n:] == -1).all()
    fixed = ops.pad(axes=(-1,), shape=(40,))(make_batch(rows, device))
    assert to_host(fixed.data["audio"]).shape == (3, 4, 40)
    both = ops.pad(lengths="n")(make_batch([np.ones((2, 3)), np.ones((4, 1))], device))
    assert to_host(both.data["audio"]).shape == (2, 4, 3) and both.data["n"].tolist() == [[2, 3], [4, 1]]
    expected = np.zeros((2, 4, 3))
    expected[0, :2, :3] = expected[1, :4, :1] = 1
    np.testing.assert_array_equal(to_host(both.data["audio"]), expected)  # every padded element filled
    with pytest.raises(ConfigError, match="not padded"):
        ops.pad(axes=(1,))(make_batch([np.ones((2, 3)), np.ones((4, 1))], device))


def test_gpu_branches_with_numpy_standing_in_for_cupy(monkeypatch):
    """The ops' CuPy branches (one pass per batch, scatter_max, searchsorted spans, cuFFT
    row padding) run here with NumPy standing in for CuPy and must agree with the host
    branches. Only the array logic is checked; the gpu-marked tests run the real thing."""
    fake, fakex = types.ModuleType("cupy"), types.ModuleType("cupyx")
    fake.__getattr__ = lambda name: getattr(np, name)
    fakex.scatter_max = lambda a, rows, values: np.maximum.at(a, rows, values)
    # the one-thread-per-row kernel of nonsilent_region: a row-wise cumulative sum
    fake.ElementwiseKernel = lambda *_: lambda terms, width, sums, size: np.cumsum(terms, axis=1, out=sums)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupyx", fakex)
    xs = signals([16000, 4410, 777, 3, 39, 50000])
    xs[0][:500] *= 1e-4
    chain = [ops.preemphasis_filter(), ops.nonsilent_region(window_length=256), ops.slice(),
             ops.spectrogram(nfft=512, window_length=320, window_step=160),
             ops.mel_filter_bank(sample_rate=16000, nfilter=40), ops.to_decibels(cutoff_db=-80),
             ops.normalize_axes(axes=(1,)), ops.pad(axes=(1,), align=8)]
    host, emulated = make_batch(xs), make_batch(xs)
    emulated.device = Device("cuda", 0)
    assert emulated.xp is fake
    for op in chain:
        host, emulated = op(host), op(emulated)
        for a, b in zip(rows_of(host.data["audio"]), rows_of(emulated.data["audio"])):
            np.testing.assert_allclose(np.asarray(b), a, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(a).max())))
    assert host.data["lengths"].tolist() == np.asarray(emulated.data["lengths"]).tolist()
