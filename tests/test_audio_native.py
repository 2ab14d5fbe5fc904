"""The C audio ops (``ops/_audio.c``) against the NumPy code they replace: the same
numbers, bit for bit, on rows of many lengths (empty, one sample, shorter than the
window, silent, loud, NaN); the mel filter bank (summed in another order than BLAS's)
within float32 rounding."""

import numpy as np
import pytest

from gpuio import ops
from gpuio.ops import audio, ragged, spectral

try:
    from gpuio.ops import _audio as native_audio
except ImportError:  # reported by require_built
    native_audio = None
from tests.test_audio_ops import make_batch
from tests.test_ops_cpu import require_built


def rows(seed=0):
    rng = np.random.default_rng(seed)
    out = [np.zeros(0, np.float32), np.full(1, 0.5, np.float32), np.zeros(3000, np.float32),
           (rng.standard_normal(100) * 0.1).astype(np.float32)]
    for n in (700, 5000, 33000, 160000):
        x = rng.standard_normal(n) * rng.uniform(1e-5, 1e-3)
        a, b = sorted(rng.integers(0, n, 2))
        x[a:b] += rng.standard_normal(b - a) * rng.uniform(0.01, 0.8)
        out.append(x.astype(np.float32))
    nan = (rng.standard_normal(4000) * 0.1).astype(np.float32)
    nan[1234] = np.nan
    return out + [nan]


def numpy_and_c(monkeypatch, op, xs):
    """``op`` on the rows with NumPy (the C module hidden), then with C."""
    require_built(native_audio, "gpuio.ops._audio", "is a C compiler installed")
    with monkeypatch.context() as m:
        for module in (audio, ragged, spectral):
            m.setattr(module, "_audio", None)
        reference = op(make_batch(xs))
    return reference, op(make_batch(xs))


@pytest.mark.parametrize("border", ["zero", "clamp", "reflect"])
def test_c_preemphasis_equals_numpy(monkeypatch, border):
    xs = rows()
    reference, fast = numpy_and_c(monkeypatch, ops.preemphasis_filter(0.97, border), xs)
    for x, a, b in zip(xs, reference.data["audio"], fast.data["audio"]):
        assert a.dtype == b.dtype == np.float32 and len(a) == len(b) == len(x)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cutoff_db,window,reference_power,reset_interval", [
    (-60.0, 2048, None, 8192), (-30.0, 64, None, 128), (-10.0, 1, None, 1), (-40.0, 256, 1e-3, -1),
    (-60.0, 512, 0.0, 8192), (-70.0, 100, None, 300)])
def test_c_nonsilent_region_equals_numpy(monkeypatch, cutoff_db, window, reference_power, reset_interval):
    xs = rows(seed=window)
    op = ops.nonsilent_region(cutoff_db, window, reference_power, reset_interval)
    reference, fast = numpy_and_c(monkeypatch, op, xs)
    assert reference.data["begin"].tolist() == fast.data["begin"].tolist()
    assert reference.data["length"].tolist() == fast.data["length"].tolist()
    found = np.array(fast.data["length"]) > 0
    assert found[4:-1].all()  # the loud rows
    if reference_power is None:  # as in DALI, NaN powers (x[1234] is NaN) are skipped for the largest
        assert fast.data["length"][-1] > 0


@pytest.mark.parametrize("nfft,win,step,center,reflect", [
    (512, 320, 160, True, True), (64, 64, 16, True, False), (16, 11, 4, True, True), (256, 200, 80, False, True)])
def test_c_frames_equal_numpy(monkeypatch, nfft, win, step, center, reflect):
    xs = [x for x in rows(seed=win) if len(x) >= win and not np.isnan(x).any()]
    xs += [np.arange(1, 1 + n, dtype=np.float32) for n in (1, 2, 3, win // 2 - 1, win // 2 + 1) if n >= (
        1 if center else win)]
    xs.append(np.linspace(-1, 1, 3 * win, dtype=np.float32)[::3])  # a strided view
    op = ops.spectrogram(nfft=nfft, window_length=win, window_step=step, center_windows=center,
                         reflect_padding=reflect)
    reference, fast = numpy_and_c(monkeypatch, op, xs)
    assert len(reference.data["audio"]) == len(fast.data["audio"]) == len(xs)
    for a, b in zip(reference.data["audio"], fast.data["audio"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("formula,normalize", [("slaney", True), ("htk", False)])
def test_c_mel_filter_bank_matches_numpy(monkeypatch, formula, normalize):
    specs = [np.abs(np.random.default_rng(n).standard_normal((257, n))).astype(np.float32) ** 2 for n in (1, 70, 900)]
    op = ops.mel_filter_bank(sample_rate=16000, nfilter=64, freq_low=20, mel_formula=formula, normalize=normalize)
    reference, fast = numpy_and_c(monkeypatch, op, specs)
    for a, b in zip(reference.data["audio"], fast.data["audio"]):
        assert a.shape == b.shape and b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=2e-6, atol=1e-6 * float(np.abs(a).max()))


@pytest.mark.parametrize("ddof,epsilon,scale,shift", [(0, 0.0, 1.0, 0.0), (1, 1e-5, 2.0, 0.5)])
def test_c_normalize_matches_numpy(monkeypatch, ddof, epsilon, scale, shift):
    rng = np.random.default_rng(ddof)
    packed = (rng.standard_normal((1500, 64)) * 4 - 30).astype(np.float32)
    packed[:, 3] = 7.0  # a constant feature: deviation 0, output 0
    ft = [packed[a:b].T for a, b in ((0, 1), (1, 201), (201, 1500))]  # "ft" rows, as the mel bank leaves them
    op = ops.normalize_axes(axes=(1,), ddof=ddof, epsilon=epsilon, scale=scale, shift=shift)
    reference, fast = numpy_and_c(monkeypatch, op, ft)
    for a, b in zip(reference.data["audio"], fast.data["audio"]):
        assert a.shape == b.shape and b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_c_ops_check_their_buffers():
    require_built(native_audio, "gpuio.ops._audio", "is a C compiler installed")
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="expected 40"):
        native_audio.preemphasis(x, np.zeros(9, np.float32), np.array([10]), 0.97, 1)
    with pytest.raises(ValueError, match="negative"):
        native_audio.nonsilent(x, np.array([12, -2]), 4, 8, 1e-6, np.nan, np.zeros(2, np.int64),
                               np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="reset interval 6"):
        native_audio.nonsilent(x, np.array([10]), 4, 6, 1e-6, np.nan, np.zeros(1, np.int64), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="border"):
        native_audio.preemphasis(x, np.zeros(10, np.float32), np.array([10]), 0.97, 3)
    window, counts = np.ones(4, np.float32), np.array([3])
    with pytest.raises(ValueError, match="float32"):
        native_audio.frames([x.astype(np.float64)], counts, window, 2, 0, 0, 4, np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="out"):
        native_audio.frames([x], counts, window, 2, 0, 0, 4, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="whole number"):
        native_audio.sparse_matmul(x, np.ones((4, 2), np.float32), 4, 2, np.zeros(5, np.float32))
