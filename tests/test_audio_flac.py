"""gpuio's FLAC decoder (ops/_flac.c) against libsndfile: FLACs written in tmp_path by
libsndfile (through soundfile) and by FFmpeg's encoder (through PyAV) in many settings,
each decoded bit for bit as soundfile.read decodes it, in every dtype; corrupt and cut
files are gpuio errors naming the byte of the bad frame."""

import io
import json

import av
import numpy as np
import pytest
import soundfile as sf

import gpuio
from gpuio import formats, ops
from gpuio.errors import FormatError, PipelineError
from gpuio.ops import audio as audio_ops
from tests.test_audio_data import make_batch

pytestmark = pytest.mark.skipif(audio_ops._flac is None, reason="gpuio.ops._flac was not built (no C compiler)")

DTYPES = ("float32", "float64", "int16", "int32")


def signal(n, channels, seed=0, kind="speech"):
    """float64 [n, channels] in [-1, 1]: noise bursts under an envelope (``speech``),
    zeros, full-scale white noise or a clipped square wave."""
    rng = np.random.default_rng(seed)
    if kind == "silence":
        return np.zeros((n, channels))
    if kind == "noise":
        return rng.uniform(-1, 1, (n, channels))
    if kind == "coarse":  # 8 significant bits in any sample width: wasted bits
        return np.round(rng.uniform(-1, 1, (n, channels)) * 100) / 128
    if kind == "clipping":
        t = np.arange(n)[:, None] / 16000
        return np.clip(3 * np.sign(np.sin(2 * np.pi * 220 * t * (1 + np.arange(channels)))), -1, 1)
    envelope = np.repeat(rng.uniform(0.01, 0.6, n // 800 + 1), 800)[:n, None]
    tone = 0.3 * np.sin(2 * np.pi * 300 * np.arange(n)[:, None] / 16000 * (1 + np.arange(channels)))
    return np.clip(rng.standard_normal((n, channels)) * envelope * 0.3 + tone * envelope, -1, 1)


def soundfile_flac(x, subtype="PCM_16", rate=16000, level=None):
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="FLAC", subtype=subtype, compression_level=level)
    return np.frombuffer(buf.getvalue(), np.uint8)


def ffmpeg_flac(x, rate=16000, fmt="s16", **options):
    """FFmpeg's FLAC encoder on int samples ``x`` [n, channels] (s32: 24 bits in the
    top of 32, or 32 bits with strict=experimental)."""
    layouts = {1: "mono", 2: "stereo", 6: "5.1"}
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as out:
        stream = out.add_stream("flac", rate=rate, layout=layouts[x.shape[1]])
        stream.codec_context.format = fmt
        stream.codec_context.options = {k: str(v) for k, v in options.items()}
        for i in range(0, len(x), 1000):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[i:i + 1000]).reshape(1, -1), format=fmt,
                                               layout=layouts[x.shape[1]])
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return np.frombuffer(buf.getvalue(), np.uint8)


def ints(x, bits):
    """float samples as ``bits``-bit integers, in the top of int16 (<= 16) or int32."""
    full = np.clip(np.round(x * 2.0 ** (bits - 1)), -2 ** (bits - 1), 2 ** (bits - 1) - 1)
    return full.astype(np.int16) if bits <= 16 else (full.astype(np.int64) << (32 - bits)).astype(np.int32)


def c_decode(buf, dtype, downmix, first=0, count=None):
    """gpuio.ops._flac on one file, asserting that it decoded it itself (no fallback)."""
    stream = audio_ops._FlacStream.parse(memoryview(buf))
    assert stream is not None
    count = stream.frames - first if count is None else count
    out = np.empty((count, 1 if downmix else stream.channels), dtype)
    [(status, done, _, error)] = audio_ops._flac.decode(
        [(buf, stream.start, first, count, stream.channels, stream.bits, out)], DTYPES.index(dtype), downmix)
    assert (status, done, error) == (0, count, None)
    return out


def reference(buf, dtype, downmix, first=0, count=-1):
    """What decode_audio gave through libsndfile: soundfile.read, channels averaged in float64."""
    x = sf.read(io.BytesIO(buf.tobytes()), dtype=dtype, always_2d=True, start=first,
                frames=count)[0]
    if downmix:
        mean = x.mean(axis=1, keepdims=True, dtype=np.float64)
        x = (mean if dtype.startswith("float") else np.rint(mean)).astype(dtype)
    return x


def check(buf, dtypes=DTYPES):
    """Every dtype, with and without downmix, bit for bit as libsndfile, through the
    C decoder and through decode_audio."""
    for dtype in dtypes:
        for downmix in (True, False):
            ref = reference(buf, dtype, downmix)
            got = c_decode(buf, dtype, downmix)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            np.testing.assert_array_equal(got, ref, err_msg=f"{dtype} downmix={downmix}")
    batch = ops.decode_audio(dtype=dtypes[0], downmix=False)(make_batch([buf, buf]))
    for row in batch.data["audio"]:
        np.testing.assert_array_equal(row, reference(buf, dtypes[0], False))


@pytest.mark.parametrize("subtype", ["PCM_16", "PCM_24", "PCM_S8"])
@pytest.mark.parametrize("channels", [1, 2, 6])
def test_libsndfile_files_decode_as_libsndfile_does(subtype, channels):
    for level, kind, n in [(None, "speech", 30001), (0.0, "speech", 9000), (1.0, "speech", 20000),
                           (0.5, "noise", 5000), (0.5, "silence", 7000), (0.5, "clipping", 6000),
                           (0.5, "coarse", 5000)]:
        check(soundfile_flac(signal(n, channels, seed=n, kind=kind), subtype, level=level))


@pytest.mark.parametrize("level", range(13))
def test_ffmpeg_compression_levels(level):
    for channels, fmt, bits in [(1, "s16", 16), (2, "s16", 16), (2, "s32", 24), (6, "s16", 16)]:
        x = ints(signal(12345, channels, seed=level), bits)
        buf = ffmpeg_flac(x, fmt=fmt, compression_level=level)
        check(buf, ("int32", "float32"))
        np.testing.assert_array_equal(c_decode(buf, "int16" if bits == 16 else "int32", False), x)


@pytest.mark.parametrize("options", [
    {"lpc_type": "none"}, {"lpc_type": "fixed"}, {"lpc_type": "levinson"},
    {"lpc_type": "cholesky", "lpc_passes": 3},
    {"max_prediction_order": 32, "lpc_coeff_precision": 15, "compression_level": 12},
    {"min_prediction_order": 1, "max_prediction_order": 1},
    {"ch_mode": "indep"}, {"ch_mode": "left_side"}, {"ch_mode": "right_side"}, {"ch_mode": "mid_side"},
    {"exact_rice_parameters": 1, "max_partition_order": 8},
    {"frame_size": 17}, {"frame_size": 1000}, {"frame_size": 4608}, {"frame_size": 192}, {"frame_size": 16},
])
@pytest.mark.parametrize("fmt,bits", [("s16", 16), ("s32", 24)])
def test_ffmpeg_encoder_options(options, fmt, bits):
    for kind in ("speech", "noise", "silence", "clipping", "coarse"):
        x = ints(signal(7001, 2, kind=kind), bits)
        buf = ffmpeg_flac(x, fmt=fmt, **options)
        if "frame_size" in options:  # STREAMINFO's largest block size
            assert int.from_bytes(buf[10:12].tobytes(), "big") == options["frame_size"]
        check(buf)


@pytest.mark.parametrize("rate", [8000, 11025, 12000, 16000, 22050, 37800, 44100, 48000, 88200, 96000, 192000])
def test_every_sample_rate_code(rate):
    """The frame header's rate codes: the table, kHz in 8 bits, Hz and tens of Hz in 16."""
    x = ints(signal(3000, 1, seed=rate), 16)
    buf = ffmpeg_flac(x, rate=rate)
    check(buf, ("int16",))
    batch = ops.decode_audio()(make_batch([buf]))
    assert batch.data["sample_rate"].tolist() == [rate]


@pytest.mark.parametrize("n", [1, 2, 5, 15, 16, 17, 100, 4095])
def test_clips_shorter_than_a_block(n):
    for channels in (1, 2):
        check(soundfile_flac(signal(n, channels, seed=n), "PCM_16"))
        check(ffmpeg_flac(ints(signal(n, channels, seed=n), 16)))


def test_32_bit_streams_decode_to_the_encoded_samples():
    """libsndfile 1.2.2 does not open 32-bit FLAC; gpuio gives the encoded samples
    (float: x / 2**31). Stereo here is coded as independent channels."""
    rng = np.random.default_rng(0)
    for channels in (1, 2):
        x = rng.integers(-2 ** 31, 2 ** 31, (5000, channels), dtype=np.int64).astype(np.int32)
        x[:1000] //= 2 ** 20  # quiet: predictable, so LPC subframes too
        buf = ffmpeg_flac(x, fmt="s32", strict="experimental", ch_mode="indep")
        assert (int.from_bytes(buf[18:26].tobytes(), "big") >> 36 & 31) + 1 == 32
        np.testing.assert_array_equal(c_decode(buf, "int32", False), x)
        np.testing.assert_array_equal(c_decode(buf, "float64", False), x / 2.0 ** 31)
        np.testing.assert_array_equal(c_decode(buf, "float32", False), x.astype(np.float32) * np.float32(2.0 ** -31))


def test_segments_and_resampling_match_libsndfile():
    buf = soundfile_flac(signal(50000, 2, seed=3), "PCM_24")
    for first, count in [(0, 1), (4095, 2), (4096, 4096), (12345, 20000), (49999, 1), (50000, 0)]:
        for dtype in DTYPES:
            np.testing.assert_array_equal(c_decode(buf, dtype, True, first, count),
                                          reference(buf, dtype, True, first, count))
    offset, duration = np.array([0.5, 0.0]), np.array([1.25, np.nan])
    got = ops.decode_audio(sample_rate=8000)(make_batch([buf, buf], offset=offset, duration=duration))
    audio_ops_flac, audio_ops._flac = audio_ops._flac, None  # the libsndfile path, as without a compiler
    try:
        ref = ops.decode_audio(sample_rate=8000)(make_batch([buf, buf], offset=offset, duration=duration))
    finally:
        audio_ops._flac = audio_ops_flac
    assert [len(a) for a in got.data["audio"]] == [10000, 25000]
    for a, b in zip(got.data["audio"], ref.data["audio"]):
        np.testing.assert_array_equal(a, b)


def frame_offsets(buf):
    """Byte offsets of the file's frames: the sync codes at which a prefix of the file
    decodes to the end of a frame (the decoder then says the data ends there)."""
    stream = audio_ops._FlacStream.parse(memoryview(buf))
    found = []
    for pos in np.flatnonzero((buf[:-1] == 0xFF) & (buf[1:] == 0xF8)).tolist():
        out = np.empty((stream.frames, 1), np.float32)
        [(status, _, at, error)] = audio_ops._flac.decode(
            [(buf[:pos], stream.start, 0, stream.frames, stream.channels, stream.bits, out)], 0, True)
        if pos >= stream.start and status == 1 and at == pos and "ends before" in error:
            found.append(pos)
    return found


def crc(data, bits, poly):
    """FLAC's CRC-8 (poly 0x07) or CRC-16 (poly 0x8005): MSB first, initial 0."""
    c, top, mask = 0, 1 << (bits - 1), (1 << bits) - 1
    for byte in data:
        c ^= byte << (bits - 8)
        for _ in range(8):
            c = ((c << 1) ^ poly if c & top else c << 1) & mask
    return c


def coded_number(v):
    """FLAC's UTF-8-like coding of a frame or sample number (up to 36 bits)."""
    if v < 0x80:
        return bytes([v])
    n = next(n for n in range(2, 8) if v < 1 << (5 * n + 1 if n < 7 else 36))
    lead = (0xFF << (8 - n) & 0xFF) | v >> 6 * (n - 1)
    return bytes([lead] + [0x80 | (v >> 6 * k & 0x3F) for k in range(n - 2, -1, -1)])


def variable_block_size(buf, offsets, block):
    """The same stream re-framed as a variable-block-size one: each frame header says
    the blocking-strategy bit 1 and its first sample's number, CRCs recomputed."""
    out = bytearray(buf[:offsets[0]].tobytes())
    for k, (start, end) in enumerate(zip(offsets, offsets[1:] + [len(buf)])):
        frame = buf[start:end].tobytes()
        lead = frame[4]
        old = 1 if lead < 0x80 else 8 - (~lead & 0xFF).bit_length()  # bytes of the frame number
        extra = {6: 1, 7: 2}.get(frame[2] >> 4, 0) + {12: 1, 13: 2, 14: 2}.get(frame[2] & 15, 0)
        header = frame[:1] + b"\xf9" + frame[2:4] + coded_number(k * block) + frame[4 + old:4 + old + extra]
        header += bytes([crc(header, 8, 0x07)])
        body = header + frame[4 + old + extra + 1:-2]
        out += body + crc(body, 16, 0x8005).to_bytes(2, "big")
    return np.frombuffer(bytes(out), np.uint8)


def test_variable_block_size_streams():
    good = soundfile_flac(signal(20000, 2, seed=4), "PCM_24")
    variable = variable_block_size(good, frame_offsets(good), 4096)
    assert variable[frame_offsets(good)[0] + 1] == 0xF9 and len(variable) > len(good)  # sample numbers take more bytes
    check(variable)
    np.testing.assert_array_equal(c_decode(variable, "int32", False), c_decode(good, "int32", False))


class BitWriter:
    """MSB-first bits, for the FLAC writer below."""

    def __init__(self):
        self.parts = []

    def put(self, value, width):
        if width:
            self.parts.append(format(int(value) & (1 << width) - 1, f"0{width}b"))

    def rice(self, values, k):
        for u in np.where(values >= 0, 2 * values, -2 * values - 1).tolist():
            self.parts.append("0" * (u >> k) + "1" + (format(u & (1 << k) - 1, f"0{k}b") if k else ""))

    def bytes(self):
        bits = "".join(self.parts)
        bits += "0" * (-len(bits) % 8)
        return int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""


def write_subframe(w, x, bps, rng):
    """One subframe of int samples ``x`` in a randomly chosen coding: CONSTANT,
    VERBATIM, FIXED 0-4 or LPC 1-32 (random precision, shift and coefficients), wasted
    bits, Rice or Rice2 partitions of a random order, some partitions escaped."""
    n = len(x)
    nonzero = x[x != 0]
    wasted = int(np.min([(int(v) & -int(v)).bit_length() - 1 for v in nonzero])) if len(nonzero) else 0
    wasted = min(wasted, bps - 1) if rng.random() < 0.7 else 0
    x = x >> wasted
    sbps = bps - wasted
    kinds = ["verbatim", "fixed", "lpc"] + (["constant"] * 3 if np.all(x == x[0]) else [])
    kind = kinds[rng.integers(len(kinds))]
    order = int(rng.integers(0, 5)) if kind == "fixed" else int(rng.integers(1, 33)) if kind == "lpc" else 0
    order = min(order, n - 1)  # libFLAC takes no predictor as long as the block
    code = {"constant": 0, "verbatim": 1, "fixed": 8 + order, "lpc": 31 + order}[kind]
    w.put(code << 1 | (wasted > 0), 8)
    if wasted:
        w.put(1, wasted)  # wasted - 1 zeros, then a one
    if kind == "constant":
        w.put(x[0], sbps)
        return
    if kind == "verbatim":
        for v in x.tolist():
            w.put(v, sbps)
        return
    for v in x[:order].tolist():
        w.put(v, sbps)
    if kind == "fixed":
        residual = np.diff(x, order)
    else:
        precision = int(rng.integers(1, 16))
        coefs = rng.integers(-(1 << precision - 1), 1 << precision - 1, order)
        shift = min(precision - 1 + int(order - 1).bit_length(), 15)
        w.put(precision - 1, 4)
        w.put(shift, 5)
        for c in coefs.tolist():
            w.put(c, precision)
        prediction = sum(int(c) * x[order - 1 - j:n - 1 - j] for j, c in enumerate(coefs.tolist()))
        residual = x[order:] - (np.asarray(prediction, dtype=np.int64) >> shift)
    method = int(rng.integers(0, 2))
    orders = [p for p in range(9) if n % (1 << p) == 0 and (n >> p) >= order]
    porder = orders[rng.integers(len(orders))]
    w.put(method, 2)
    w.put(porder, 4)
    escape, pos = (31 if method else 15), 0
    for part in range(1 << porder):
        values = residual[pos:pos + (n >> porder) - (order if part == 0 else 0)]
        pos += len(values)
        need = max([int(v).bit_length() + 1 for v in values.tolist()] + [0]) if np.any(values) else 0
        k = min(max(int(np.log2(np.mean(np.abs(values)) + 1)) if len(values) else 0, 0), escape - 1)
        if rng.random() < 0.2 or 2 * np.abs(values).max(initial=0) >> k > 4000:
            w.put(escape, 5 if method else 4)
            w.put(need, 5)
            for v in values.tolist():
                w.put(v, need)
        else:
            w.put(k, 5 if method else 4)
            w.rice(values, k)


def written_flac(x, bps, rate, rng):
    """A FLAC stream of int samples ``x`` [n, channels] written here from RFC 9639 in
    variable-size blocks (8-bit, 16-bit and table block-size codes), every channel
    assignment, bit depth and rate code, random subframe codings."""
    n, channels = x.shape
    blocks, pos = [], 0
    while pos < n:
        size = int(rng.choice([16, 17, 192, 255, 256, 512, 576, 1000, 1024, 1152, 2048, 2304, 4096, 4608, 8192, 16384]))
        blocks.append(min(size, n - pos))
        pos += blocks[-1]
    total = x.shape[0]
    info = ((rate << 44) | ((channels - 1) << 41) | ((bps - 1) << 36) | total).to_bytes(8, "big")
    streaminfo = (min(blocks).to_bytes(2, "big") + max(blocks).to_bytes(2, "big") + bytes(6) + info + bytes(16))
    out = bytearray(b"fLaC" + bytes([0x80, 0, 0, 34]) + streaminfo)
    bs_codes = {192: 1, 576: 2, 1152: 3, 2304: 4, 4608: 5, 256: 8, 512: 9, 1024: 10, 2048: 11, 4096: 12, 8192: 13}
    rate_codes = {88200: 1, 176400: 2, 192000: 3, 8000: 4, 16000: 5, 22050: 6, 24000: 7, 32000: 8, 44100: 9,
                  48000: 10, 96000: 11}
    bits_codes = {8: 1, 12: 2, 16: 4, 20: 5, 24: 6}
    pos = 0
    for size in blocks:
        block = x[pos:pos + size].astype(np.int64)
        assign = int(rng.integers(0, 4)) if channels == 2 else 0
        bs = bs_codes.get(size, 6 if size <= 256 else 7)
        sr = rng.choice([0, rate_codes.get(rate, 0), 12 if rate % 1000 == 0 and rate < 256000 else 0,
                         13 if rate < 65536 else 0, 14 if rate % 10 == 0 else 0])
        head = BitWriter()
        head.put(0b11111111111110, 14)
        head.put(1, 2)  # reserved 0, variable block size
        head.put(bs, 4)
        head.put(sr, 4)
        head.put(channels - 1 if assign == 0 else 7 + assign, 4)
        head.put(bits_codes[bps] if rng.random() < 0.5 else 0, 3)
        head.put(0, 1)
        header = head.bytes() + coded_number(pos)
        header += (size - 1).to_bytes(1 if bs == 6 else 2, "big") if bs in (6, 7) else b""
        header += {12: (rate // 1000).to_bytes(1, "big"), 13: rate.to_bytes(2, "big"),
                   14: (rate // 10).to_bytes(2, "big")}.get(sr, b"")
        header += bytes([crc(header, 8, 0x07)])
        left, right = block[:, 0], block[:, -1]
        signals = {0: [(block[:, c], bps) for c in range(channels)],
                   1: [(left, bps), (left - right, bps + 1)],  # left / side
                   2: [(left - right, bps + 1), (right, bps)],  # side / right
                   3: [((left + right) >> 1, bps), (left - right, bps + 1)]}[assign]  # mid / side
        w = BitWriter()
        for signal_, sbps in signals:
            write_subframe(w, signal_, sbps, rng)
        frame = header + w.bytes()
        out += frame + crc(frame, 16, 0x8005).to_bytes(2, "big")
        pos += size
    return np.frombuffer(bytes(out), np.uint8)


@pytest.mark.parametrize("bps", [8, 12, 16, 20, 24])
@pytest.mark.parametrize("channels", [1, 2, 3])
def test_every_coding_written_here_from_the_spec(bps, channels):
    """Codings that encoders seldom write (escaped partitions, FIXED 3-4, LPC up to
    order 32, wasted bits under predictors, 12- and 20-bit samples, every rate code):
    the decoder gives back the samples written, and libsndfile's samples where it
    reads the file (8, 16 and 24 bits)."""
    rng = np.random.default_rng(bps * 10 + channels)
    for rate in (16000, 44100, 12000, 11025):
        n = int(rng.integers(3000, 20000))
        walk = np.cumsum(rng.normal(0, 2.0 ** (bps - 8), (n, channels)), axis=0)
        x = np.clip(walk, -2 ** (bps - 1), 2 ** (bps - 1) - 1).astype(np.int64)
        x[n // 3:n // 2] = x[n // 3]  # constant stretches
        x[n // 2:2 * n // 3] &= ~np.int64(15)  # wasted bits
        buf = written_flac(x, bps, rate, rng)
        got = c_decode(buf, "int32", False)
        np.testing.assert_array_equal(got, (x << 32 - bps).astype(np.int32))
        mean = (x / 2.0 ** (bps - 1)).mean(axis=1, keepdims=True)
        np.testing.assert_array_equal(c_decode(buf, "float64", True), mean)
        if bps in (8, 16, 24):
            check(buf)


def test_corrupt_and_cut_files_name_the_bad_frame(tmp_path):
    good = soundfile_flac(signal(20000, 1, seed=1))
    offsets = frame_offsets(good)
    assert len(offsets) == 5  # 4 frames of 4096 samples and one of 3616
    third = offsets[2]
    cases = []
    for at in (third + 1, third + 3, third + 40, offsets[3] - 1):  # header fields, subframe, CRC-16 footer
        bad = good.copy()
        bad[at] ^= 0x10
        cases.append((bad, third, "CRC|reserved|sync|residual|partition|subframe|predictor|wasted"))
    cases.append((good[:offsets[3] - 1], third, "ends inside a frame|residual runs past"))  # cut mid-frame
    cases.append((good[:offsets[3]], offsets[3], "ends before the last frame"))  # cut between frames
    for bad, at, match in cases:
        with pytest.raises(FormatError, match=match) as err:
            ops.decode_audio()(make_batch([good, bad]))
        assert err.value.sample == 1 and err.value.offset == at and f"at byte {at}" in str(err.value)
    batch = ops.decode_audio()(make_batch([good] + [b for b, _, _ in cases] + [good], on_error="skip"))
    assert batch.index.tolist() == [0, len(cases) + 1] and len(batch.errors) == len(cases)
    # through the loader, the error names the file as well
    (tmp_path / "good.flac").write_bytes(good.tobytes())
    (tmp_path / "bad.flac").write_bytes(cases[0][0].tobytes())
    (tmp_path / "m.json").write_text("\n".join(json.dumps({"audio_filepath": name, "duration": 1.25, "text": name})
                                               for name in ("good.flac", "bad.flac")))
    loader = gpuio.Loader(formats.manifest(tmp_path / "m.json"), 2, ops=[ops.decode_audio()], output="numpy")
    with pytest.raises(PipelineError, match=rf"bad\.flac.*at byte {third}"):
        list(loader)


def test_files_the_decoder_does_not_take_go_to_libsndfile():
    """No STREAMINFO total (a stream written without seeking back) and non-FLAC bytes
    are not parsed as FLAC streams; libsndfile keeps them."""
    buf = soundfile_flac(signal(3000, 1)).copy()
    buf[21:26] = np.frombuffer(bytes([buf[21] & 0xF0, 0, 0, 0, 0]), np.uint8)  # total samples 0: unknown
    assert audio_ops._FlacStream.parse(memoryview(buf)) is None
    assert audio_ops._FlacStream.parse(memoryview(np.frombuffer(b"RIFF" * 20, np.uint8))) is None


def test_a_declared_length_the_bytes_cannot_hold_is_an_error():
    """A tiny file whose STREAMINFO declares 2**30 samples is refused before the batch
    buffer is sized by it."""
    buf = soundfile_flac(signal(100, 1)).copy()
    info = int.from_bytes(buf[18:26].tobytes(), "big") >> 36 << 36 | 1 << 30
    buf[18:26] = np.frombuffer(info.to_bytes(8, "big"), np.uint8)
    with pytest.raises(FormatError, match="declares 1073741824 samples") as err:
        ops.decode_audio()(make_batch([buf]))
    assert err.value.offset == 18 and err.value.sample == 0


def test_frames_unlike_streaminfo_go_to_libsndfile():
    """STREAMINFO says 24 bits, the frames say 16: the C decoder hands the file back
    (status 2) and decode_audio gives libsndfile's samples."""
    buf = soundfile_flac(signal(5000, 2, seed=9), "PCM_16").copy()
    info = int.from_bytes(buf[18:26].tobytes(), "big") & ~(31 << 36) | 23 << 36
    buf[18:26] = np.frombuffer(info.to_bytes(8, "big"), np.uint8)
    stream = audio_ops._FlacStream.parse(memoryview(buf))
    out = np.empty((stream.frames, 1), np.float32)
    [(status, _, _, _)] = audio_ops._flac.decode(
        [(buf, stream.start, 0, stream.frames, stream.channels, stream.bits, out)], 0, True)
    assert status == 2
    for dtype in DTYPES:
        batch = ops.decode_audio(dtype=dtype, downmix=False)(make_batch([buf]))
        np.testing.assert_array_equal(batch.data["audio"][0], reference(buf, dtype, False))
