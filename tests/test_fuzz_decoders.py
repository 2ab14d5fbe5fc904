"""Seeded regression fuzzing of gpuio's C code that reads untrusted bytes, through the
public entry points: the FLAC decoder (ops/_flac.c, ``ops.decode_audio``), the libjpeg
region decoder + resampler (ops/_jpeg.c, ``decode_image`` fused with a crop/resize
chain, ``decode_image_slice``) and the POSIX read loop (gpuio/storage/_readloop.c, ``Reader.read``
of files changed after indexing, cold batches read with O_DIRECT).

Each loop runs in a child Python, so a crash fails its test instead of ending pytest.
Every mutated input must either decode to the right shape or be a gpuio error; the valid
input next to it in the batch must still decode exactly. The inputs are small and the
mutations keep declared sizes modest: decompression bombs are not what these look for.
"""

from __future__ import annotations

import io
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpuio.errors import GpuioError

ROOT = Path(__file__).resolve().parents[1]


def run_child(function: str, *args: object, timeout: float = 60) -> str:
    """``function(*args)`` of this module in a child Python; its stdout. A non-zero exit
    (a negative one: killed by that signal, e.g. -11 for a segfault) fails the test."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            f"from tests.test_fuzz_decoders import {function}; {function}(*{args!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, (f"{function}{args} exited with {proc.returncode}\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def outcomes(stdout: str) -> dict[str, int]:
    """The child's last line, ``name=count ...``."""
    return {k: int(v) for k, v in (item.split("=") for item in stdout.split("\n")[-2].split())}


def flip_bits(rng: np.random.Generator, b: bytearray) -> None:
    for _ in range(int(rng.integers(1, 8))):
        b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))


def overwrite_bytes(rng: np.random.Generator, b: bytearray) -> None:
    for _ in range(int(rng.integers(1, 8))):
        b[int(rng.integers(len(b)))] = int(rng.choice([0, 0x7F, 0x80, 0xFF, int(rng.integers(256))]))


def truncate(rng: np.random.Generator, b: bytearray) -> None:
    del b[int(rng.integers(len(b))):]


def insert_bytes(rng: np.random.Generator, b: bytearray) -> None:
    at = int(rng.integers(len(b)))
    b[at:at] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()


def delete_bytes(rng: np.random.Generator, b: bytearray) -> None:
    at = int(rng.integers(len(b)))
    del b[at:at + int(rng.integers(1, 16))]


GENERIC = (flip_bits, overwrite_bytes, truncate, insert_bytes, delete_bytes)


# ---------------------------------------------------------------- FLAC (ops/_flac.c)


def flac_frames(buf: bytes, start: int) -> list[int]:
    """Offsets of the frame sync codes after the metadata."""
    b = np.frombuffer(buf, np.uint8)
    return [int(p) for p in np.flatnonzero((b[:-1] == 0xFF) & ((b[1:] & 0xFE) == 0xF8)) if p >= start]


def flac_header_length(b: bytearray, pos: int) -> int | None:
    """Bytes of the frame header at ``pos`` before its CRC-8."""
    if pos + 5 > len(b):
        return None
    lead = b[pos + 4]  # the coded number's first byte says how many follow (0x80-0xBF, 0xFF: invalid)
    more = 0 if lead < 0xC0 else next(n for n, top in enumerate((0xE0, 0xF0, 0xF8, 0xFC, 0xFE, 0x100), 1) if lead < top)
    return 5 + more + {6: 1, 7: 2}.get(b[pos + 2] >> 4, 0) + {12: 1, 13: 2, 14: 2}.get(b[pos + 2] & 15, 0)


def fix_flac_crcs(b: bytearray, frames: list[int], pos: int) -> None:
    """Recompute the CRC-8 and CRC-16 of the frame at ``pos`` (it ends where the next
    begins), so that its mutated header fields and subframes reach the decoder."""
    from tests.test_audio_flac import crc

    end = next((f for f in frames if f > pos), len(b))
    n = flac_header_length(b, pos)
    if n is None or pos + n >= len(b):
        return
    b[pos + n] = crc(b[pos:pos + n], 8, 0x07)
    if end - 2 > pos + n:
        b[end - 2:end] = crc(b[pos:end - 2], 16, 0x8005).to_bytes(2, "big")


def mutate_flac(rng: np.random.Generator, buf: bytes, start: int) -> bytes:
    """Generic byte mutations, or header fields rewritten with the CRCs made valid again:
    frame block-size / rate / channel / bit-depth codes, subframe types, orders and
    wasted bits, residual partition orders and Rice parameters, tiny blocks, and
    STREAMINFO's channels, bits and total samples (up to 2**20)."""
    b, frames = bytearray(buf), flac_frames(buf, start)
    kind = int(rng.integers(len(GENERIC) + 5))
    if kind < len(GENERIC) or not frames:
        GENERIC[min(kind, len(GENERIC) - 1)](rng, b)
        return bytes(b)
    pos = int(rng.choice(frames))
    n = flac_header_length(b, pos) or 6
    if kind == len(GENERIC):  # frame header codes
        b[pos + 2] = int(rng.integers(256))
        b[pos + 3] = int(rng.integers(256)) & 0xFE
    elif kind == len(GENERIC) + 1 and pos + n + 1 < len(b):  # subframe type, order, wasted-bits flag
        b[pos + n + 1] = int(rng.integers(128))
    elif kind == len(GENERIC) + 2:  # residual coding, partition order, Rice parameters, LPC fields
        for _ in range(int(rng.integers(1, 6))):
            at = pos + n + 2 + int(rng.integers(12))
            if at < len(b):
                b[at] = int(rng.integers(256))
    elif kind == len(GENERIC) + 3:  # block-size code 6: 1-256 samples
        b[pos + 2] = 0x60 | (b[pos + 2] & 15)
    else:  # STREAMINFO: channels - 1, bits - 1, total samples
        info = int.from_bytes(b[18:26], "big")
        info ^= int(rng.integers(1, 256)) << 36
        info = info & ~((1 << 36) - 1) | int(rng.choice([1, 2, 191, 4096, int(rng.integers(1, 1 << 20))]))
        b[18:26] = info.to_bytes(8, "big")
    fix_flac_crcs(b, frames, pos)
    return bytes(b)


def fuzz_flac(seed: int, count: int) -> None:
    """Child: ``count`` mutated FLAC files through ``decode_audio``, each in a batch with a
    valid file that must still decode as it does alone."""
    from gpuio import ops
    from gpuio.ops import audio as audio_ops
    from tests.test_audio_data import make_batch
    from tests.test_audio_flac import written_flac

    assert audio_ops._flac is not None, "gpuio.ops._flac was not built"
    rng = np.random.default_rng(seed)
    valid = []
    for bps, channels in [(8, 1), (16, 2), (24, 2), (12, 3), (20, 1)]:  # every coding, written from the spec
        n = int(rng.integers(20, 2500))
        walk = np.cumsum(rng.normal(0, 2.0 ** (bps - 8), (n, channels)), axis=0)
        x = np.clip(walk, -2 ** (bps - 1), 2 ** (bps - 1) - 1).astype(np.int64)
        valid.append(bytes(written_flac(x, bps, 16000, rng)))
    starts = [audio_ops._FlacStream.parse(memoryview(v)).start for v in valid]
    counts = {"decoded": 0, "rejected": 0}
    wants: dict[tuple[bytes, str, bool], np.ndarray] = {}  # the valid files alone
    for it in range(count):
        k = int(rng.integers(len(valid)))
        bad, good = mutate_flac(rng, valid[k], starts[k]), valid[(k + 1) % len(valid)]
        dtype, downmix = str(rng.choice(["float32", "float64", "int16", "int32"])), bool(rng.integers(2))
        decode = ops.decode_audio(dtype=dtype, downmix=downmix)
        if (good, dtype, downmix) not in wants:
            wants[good, dtype, downmix] = decode(make_batch([np.frombuffer(good, np.uint8)])).data["audio"][0]
        want = wants[good, dtype, downmix]
        try:
            batch = decode(make_batch([np.frombuffer(bad, np.uint8), np.frombuffer(good, np.uint8)], on_error="skip"))
        except GpuioError:  # e.g. downmix=False over a batch that mixes channel counts
            counts["rejected"] += 1
            continue
        rows = batch.data["audio"]
        assert batch.index.tolist()[-1] == 1 and np.array_equal(rows[-1], want), f"iteration {it}: the valid row"
        counts["decoded" if len(rows) == 2 else "rejected"] += 1
        if len(rows) == 2:
            stream = audio_ops._FlacStream.parse(memoryview(bad))
            assert rows[0].dtype == np.dtype(dtype) and rows[0].ndim == (1 if downmix else 2), f"iteration {it}"
            if stream is not None:
                assert len(rows[0]) == stream.frames, f"iteration {it}"
    print(" ".join(f"{k}={v}" for k, v in counts.items()))


def test_flac_mutations_decode_or_are_gpuio_errors():
    got = outcomes(run_child("fuzz_flac", 7, 300))
    assert got["decoded"] > 10 and got["rejected"] > 100


def decorrelation_extremes() -> list[bytes]:
    """CRC-valid stereo FLACs (left/side, side/right, mid/side) whose residuals are the
    int32 extremes: the decorrelation's sums leave int32 (reported in notes/fuzz F1)."""
    from tests.test_audio_flac import BitWriter, crc

    n, out = 16, []
    info = ((16000 << 44) | (1 << 41) | (23 << 36) | n).to_bytes(8, "big")
    head = b"fLaC\x80\x00\x00\x22" + n.to_bytes(2, "big") * 2 + bytes(6) + info + bytes(16)
    for assignment in (8, 9, 10):
        h = BitWriter()
        for value, width in ((0b11111111111110, 14), (0, 2), (6, 4), (0, 4), (assignment, 4), (6, 3), (0, 1)):
            h.put(value, width)
        header = h.bytes() + bytes([0, n - 1])
        header += bytes([crc(header, 8, 0x07)])
        w = BitWriter()
        for value in (2 ** 31 - 1, -2 ** 31):  # FIXED order 0, Rice2, one partition, k = 30
            for field, width in ((8 << 1, 8), (1, 2), (0, 4), (30, 5)):
                w.put(field, width)
            w.rice(np.full(n, value, np.int64), 30)
        frame = header + w.bytes()
        out.append(head + frame + crc(frame, 16, 0x8005).to_bytes(2, "big"))
    return out


def decode_decorrelation_extremes() -> None:
    """Child: the files above decode (to wrapped samples) without a crash."""
    from gpuio import ops
    from tests.test_audio_data import make_batch

    for dtype in ("float32", "int16", "int32"):
        for downmix in (True, False):
            bufs = [np.frombuffer(b, np.uint8) for b in decorrelation_extremes()]
            rows = ops.decode_audio(dtype=dtype, downmix=downmix)(make_batch(bufs)).data["audio"]
            assert [len(r) for r in rows] == [16, 16, 16]
    print("decoded=3")


def test_flac_decorrelation_at_int32_extremes_does_not_crash():
    assert outcomes(run_child("decode_decorrelation_extremes"))["decoded"] == 3


@pytest.mark.parametrize("offset, duration", [(float("nan"), 0.0), (float("inf"), 0.0), (0.0, float("inf"))])
def test_audio_offset_and_duration_that_are_not_finite_are_format_errors(offset, duration):
    import soundfile as sf

    from gpuio import ops
    from gpuio.errors import FormatError
    from tests.test_audio_data import make_batch

    b = io.BytesIO()
    sf.write(b, np.zeros((1000, 1)), 16000, format="FLAC")
    batch = make_batch([np.frombuffer(b.getvalue(), np.uint8)], offset=np.array([offset]),
                       duration=np.array([duration]))
    with pytest.raises(FormatError):
        ops.decode_audio()(batch)


# ---------------------------------------------------------------- JPEG (ops/_jpeg.c)


def jpeg_segments(b: bytearray) -> list[tuple[int, int]]:
    """(offset, marker) of the segments before the first scan."""
    out, pos = [], 2
    while pos + 4 <= len(b) and b[pos] == 0xFF:
        out.append((pos, b[pos + 1]))
        if b[pos + 1] == 0xDA:
            break
        pos += 2 + int.from_bytes(b[pos + 2:pos + 4], "big")
    return out


def mutate_jpeg(rng: np.random.Generator, buf: bytes) -> bytes:
    """Generic byte mutations, a cut that keeps an EOI, or rewritten header fields: SOF
    dimensions (up to 4096), sampling factors and precision, segment lengths, an EXIF
    orientation with a bogus IFD, RST markers in the scan."""
    b = bytearray(buf)
    segments = jpeg_segments(b)
    sof = [pos for pos, marker in segments if marker in (0xC0, 0xC1, 0xC2)]
    kind = int(rng.integers(len(GENERIC) + 6))
    if kind < len(GENERIC):
        GENERIC[kind](rng, b)
    elif kind == len(GENERIC):  # complete-looking: cut, then EOI
        del b[int(rng.integers(2, len(b))):]
        b += b"\xff\xd9"
    elif kind == len(GENERIC) + 1 and sof:  # declared height and width
        sizes = [0, 1, 7, 8, 9, 16, 17, 255, 4096, int(rng.integers(1, 4097))]
        b[sof[0] + 5:sof[0] + 9] = int(rng.choice(sizes)).to_bytes(2, "big") + int(rng.choice(sizes)).to_bytes(2, "big")
    elif kind == len(GENERIC) + 2 and sof:  # sampling factors or precision
        at = sof[0] + 11 + 3 * int(rng.integers(max(b[sof[0] + 9], 1)))
        if rng.random() < 0.3:
            b[sof[0] + 4] = int(rng.choice([0, 12, 16]))
        elif at < len(b):
            b[at] = int(rng.choice([0x00, 0x11, 0x12, 0x21, 0x22, 0x14, 0x41, 0x44, 0x33, 0xFF]))
    elif kind == len(GENERIC) + 3 and segments:  # a segment's length
        pos = segments[int(rng.integers(len(segments)))][0]
        b[pos + 2:pos + 4] = int(rng.choice([0, 1, 2, 3, 0xFFFF, int(rng.integers(65536))])).to_bytes(2, "big")
    elif kind == len(GENERIC) + 4:  # EXIF: orientation 0-9, IFD offset anywhere
        ifd = int(rng.choice([8, 0xFFFFFFF0, int(rng.integers(100))]))
        tiff = (b"MM\x00\x2a" + ifd.to_bytes(4, "big") + b"\x00\x01\x01\x12\x00\x03\x00\x00\x00\x01"
                + int(rng.integers(10)).to_bytes(2, "big") + b"\x00\x00")
        app1 = b"Exif\x00\x00" + tiff[:int(rng.integers(len(tiff) + 1))]
        b[2:2] = b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1
    else:  # restart markers dropped into the data
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(len(b) - 1))
            b[at:at + 2] = bytes([0xFF, 0xD0 + int(rng.integers(8))])
    return bytes(b)


def valid_jpegs(rng: np.random.Generator) -> list[bytes]:
    """Baseline 4:2:0 / 4:4:4, progressive, grayscale, CMYK, restart intervals; 1x1 and
    odd sizes."""
    import cv2
    from PIL import Image

    def pillow(image: Image.Image, **options: object) -> bytes:
        out = io.BytesIO()
        image.save(out, "JPEG", **options)
        return out.getvalue()

    out = []
    for h, w in [(1, 1), (7, 13), (33, 17), (64, 48)]:
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        out += [pillow(image, quality=90), pillow(image, progressive=True), pillow(image.convert("L")),
                pillow(image, subsampling=0), pillow(image.convert("CMYK")),
                cv2.imencode(".jpg", np.asarray(image), [cv2.IMWRITE_JPEG_RST_INTERVAL, 1])[1].tobytes()]
    return out


def fuzz_jpeg(seed: int, count: int) -> None:
    """Child: ``count`` batches of mutated JPEGs (and a valid one) through ``decode_image``
    fused with a crop/resize chain (CPU: one header call and one decode_resample call per
    batch, DCT-scaled where the output is small) and through ``decode_image_slice``."""
    from gpuio import ops
    from gpuio.batch import Batch, sample_seeds
    from gpuio.ops import decode as decode_ops

    assert decode_ops._jpeg is not None, "gpuio.ops._jpeg was not built"
    rng = np.random.default_rng(seed)
    valid = valid_jpegs(rng)
    counts = {"decoded": 0, "rejected": 0}
    for it in range(count):
        n = int(rng.integers(1, 4))
        bufs = [mutate_jpeg(rng, valid[int(rng.integers(len(valid)))]) for _ in range(n)]
        bufs.append(valid[int(rng.integers(len(valid)))])
        color, size = str(rng.choice(["rgb", "gray"])), int(rng.choice([1, 5, 16]))
        channels = 1 if color == "gray" else 3
        index = np.arange(n + 1)
        data = {"data": [np.frombuffer(b, np.uint8) for b in bufs]}
        if rng.random() < 0.7:
            chain = [ops.random_resized_crop(size), ops.flip(), ops.normalize()] if rng.random() < 0.5 else \
                [ops.resize(shorter=size), ops.center_crop(size), ops.normalize(0, 1, layout="HWC", dtype="uint8")]
            shape = (channels, size, size) if chain[-1].layout == "CHW" else (size, size, channels)
            batch = ops.Compose([ops.decode_image(color=color), *chain])(
                Batch(data, index, sample_seeds(seed, it, index), on_error="skip"))
            images = batch.data["image"]
            assert all(img.shape == shape and np.isfinite(img).all() for img in images), f"iteration {it}"
        else:
            data["crop_anchor"] = [tuple(rng.random(2).tolist()) for _ in index]
            data["crop_shape"] = [tuple(rng.random(2).tolist()) for _ in index]
            batch = ops.decode_image_slice(color=color)(Batch(data, index, sample_seeds(seed, it, index),
                                                              on_error="skip"))
            images = batch.data["image"]
            assert all(img.ndim == 3 and img.shape[2] == channels and img.dtype == np.uint8 for img in images), \
                f"iteration {it}"
        assert batch.index.tolist()[-1] == n, f"iteration {it}: the valid image was rejected"
        counts["decoded"] += len(images) - 1
        counts["rejected"] += n + 1 - len(images)
    print(" ".join(f"{k}={v}" for k, v in counts.items()))


def test_jpeg_mutations_decode_or_are_gpuio_errors():
    got = outcomes(run_child("fuzz_jpeg", 11, 250))
    assert got["decoded"] > 50 and got["rejected"] > 50


def decode_huge_cut_jpeg() -> None:
    """Child: a 3 KB baseline JPEG cut before its EOI whose SOF declares 65500 x 65500,
    with 4 GiB of address space: not region-decodable, so it is decoded whole."""
    from PIL import Image

    from gpuio import ops
    from gpuio.batch import Batch, sample_seeds
    from gpuio.errors import FormatError

    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(b, "JPEG")
    data = bytearray(b.getvalue())
    sof = next(pos for pos, marker in jpeg_segments(data) if marker == 0xC0)
    data[sof + 5:sof + 9] = (65500).to_bytes(2, "big") * 2
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30 if hard == resource.RLIM_INFINITY else min(4 << 30, hard), hard))
    batch = Batch({"data": [np.frombuffer(bytes(data[:-2]), np.uint8)]}, np.arange(1), sample_seeds(0, 0, np.arange(1)),
                  on_error="skip")
    try:
        batch = ops.Compose([ops.decode_image(), ops.center_crop(3), ops.normalize()])(batch)
    except FormatError:
        pass
    else:
        assert len(batch.errors) == 1
    print("rejected=1")


def test_jpeg_declaring_a_huge_size_is_a_gpuio_error():
    assert outcomes(run_child("decode_huge_cut_jpeg"))["rejected"] == 1


# ---------------------------------------------------------------- reads (gpuio/storage/_readloop.c)


def fuzz_reads(seed: int, count: int, root: str) -> None:
    """Child: ``count`` batches read from files under ``root`` (ext4 or tmpfs) that shrink,
    grow, vanish or turn into directories after indexing, mostly evicted from the page
    cache so that long reads take the O_DIRECT path; unaligned extents, some past the
    end. A read that succeeds gives the file's bytes."""
    import gpuio
    from gpuio.storage import _posix
    from gpuio.index import Extents, SampleIndex
    from gpuio.storage import Reader

    assert _posix._readloop is not None, "gpuio.storage._readloop was not built"
    rng = np.random.default_rng(seed)
    counts = {"read": 0, "rejected": 0}
    for it in range(count):
        folder = Path(root) / f"{it}"
        folder.mkdir()
        sizes = [int(rng.choice([0, 1, 4095, 4096, 4097, 70000, int(rng.integers(300000))]))
                 for _ in range(int(rng.integers(1, 5)))]
        paths = [folder / f"{k}.bin" for k in range(len(sizes))]
        for path, size in zip(paths, sizes):
            path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        file = rng.integers(0, len(sizes), int(rng.integers(1, 10)))
        offsets = [int(rng.integers(sizes[f] + 1)) if rng.random() < 0.9 else sizes[f] + 5000 for f in file.tolist()]
        lengths = [int(rng.integers(sizes[f] - o + 1)) if rng.random() < 0.85 and o <= sizes[f]
                   else int(rng.integers(1, 100000)) for f, o in zip(file.tolist(), offsets)]
        index = SampleIndex([str(p) for p in paths], {"data": Extents(file, np.array(offsets), np.array(lengths))})
        victim = paths[int(rng.integers(len(paths)))]
        change = int(rng.integers(5))
        if change == 1:
            os.truncate(victim, int(rng.integers(victim.stat().st_size + 1)))
        elif change == 2:
            with open(victim, "ab") as f:
                f.write(b"\xab" * int(rng.integers(1, 10000)))
        elif change == 3:
            victim.unlink()
            if rng.random() < 0.5:
                victim.mkdir()
        for path in paths:
            if path.is_file() and rng.random() < 0.8:  # cold: the batch may go around the page cache
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        rows = rng.integers(0, len(file), int(rng.integers(1, 2 * len(file) + 1)))
        with gpuio.config.override(o_direct=bool(rng.random() < 0.3), io_threads=int(rng.choice([1, 4, 16])),
                                   merge_gap=int(rng.choice([0, 5000])), task_size=int(rng.choice([4096, 1 << 20]))):
            with Reader("cpu") as reader:
                try:
                    got = reader.read(index, rows)
                except GpuioError:
                    counts["rejected"] += 1
                    continue
        counts["read"] += 1
        for row, value in zip(rows.tolist(), got):
            path, offset, length = paths[int(file[row])], offsets[row], lengths[row]
            want = path.read_bytes()[offset:offset + length] if length else b""
            assert bytes(value) == want and len(want) == length, f"iteration {it}, row {row}"
    print(" ".join(f"{k}={v}" for k, v in counts.items()))


@pytest.mark.parametrize("where", ["tmp_path", "/dev/shm"])
def test_reads_of_changed_files_give_the_bytes_or_gpuio_errors(tmp_path, where):
    if where == "/dev/shm" and not os.path.isdir(where):
        pytest.skip("no /dev/shm here")
    root = tmp_path if where == "tmp_path" else Path(where) / f"gpuio-fuzz-{os.getpid()}"
    root.mkdir(exist_ok=True)
    try:
        got = outcomes(run_child("fuzz_reads", 5, 80, str(root)))
    finally:
        if where != "tmp_path":
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    assert got["read"] > 10 and got["rejected"] > 10
