"""A decoder that ``decode_video`` starts inside a video knows what a decoder that read
the file from its start knows, and NVDEC's pictures convert through DLPack (where the
pool threads allocate is tests/test_device_lint.py's).

The old-x264 stream is real encoder output: libx264 writes a lossless 4:4:4 stream
(High 4:4:4 Predictive, 8x8 intra prediction) with IDR pictures every 30 frames, and
its version note (a user-data-unregistered SEI message in the first packet only) is
rewritten to say core 142. FFmpeg then decodes the whole file with its correction for
x264 builds before 151, and a decoder started at a later IDR without the note decodes
those pictures differently: the test first checks that it does.
"""

from __future__ import annotations

import re
from pathlib import Path

import av
import numpy as np
import pytest
from test_video import decode, full_decode, write_video

from gpuio import _nal
from gpuio.errors import FormatError
from gpuio.formats import video
from gpuio.ops.video import annexb_packets, codec_header, decode_clip, device_frame

KEYINT = 30


def write_old_x264(path: Path, frames: int = 3 * KEYINT) -> None:
    """A lossless 4:4:4 x264 stream whose version note says core 142 (see the module docstring)."""
    write_video(path, "libx264", 64, 48, frames=frames, pix_fmt="yuv444p", seed=3,
                options={"x264-params": f"qp=0:keyint={KEYINT}:min-keyint={KEYINT}:scenecut=0"})
    data = path.read_bytes()
    notes = list(re.finditer(rb"x264 - core (\d{3})\b", data))
    assert len(notes) == 1, "x264 writes its version note once"
    a, b = notes[0].span(1)
    path.write_bytes(data[:a] + b"142" + data[b:])


def decode_from_second_idr(path: Path) -> np.ndarray:
    """Frames KEYINT.. decoded by a new FFmpeg decoder fed from the second IDR on, as a
    decoder that never saw the file's first packet."""
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        packets = [p for p in c.demux(stream) if p.size]
        keys = [k for k, p in enumerate(packets) if p.is_keyframe]
        ctx = av.CodecContext.create("h264", "r")
        ctx.extradata = stream.codec_context.extradata
        pictures = [f for p in packets[keys[1]:] for f in ctx.decode(p)] + list(ctx.decode(None))
    return np.stack([f.to_ndarray(format="rgb24") for f in sorted(pictures, key=lambda f: f.pts)])


@pytest.fixture(scope="module", params=["mp4", "mkv"])
def old_x264(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("old_x264") / f"core142.{request.param}"
    write_old_x264(path)
    reference = full_decode(path)
    fresh = decode_from_second_idr(path)
    # the reproduction: without the note, pictures after a later IDR come out otherwise
    assert not np.array_equal(fresh[:KEYINT], reference[KEYINT:2 * KEYINT])
    return path, reference


@pytest.mark.parametrize("length,stride,step", [(8, 3, 7), (20, 1, 17), (3, 20, 11)])
def test_old_x264_clips_equal_decoding_the_whole_file(old_x264, length, stride, step):
    path, reference = old_x264
    index = video([path], sequence_length=length, stride=stride, step=step)
    starts = index.values["frame"]
    assert (starts > KEYINT).any() and ((starts % KEYINT) + (length - 1) * stride >= KEYINT).any()
    for i, frames in enumerate(decode(index, np.arange(len(index)))):  # parts on the pool
        f0 = int(starts[i])
        want = reference[f0: f0 + (length - 1) * stride + 1: stride]
        np.testing.assert_array_equal(frames, want, err_msg=f"clip {i} from frame {f0}")
        s = index[i]
        np.testing.assert_array_equal(decode_clip(s["data"], s["packets"], s["codec"]), want,
                                      err_msg=f"decode_clip, clip {i} from frame {f0}")


def test_old_x264_nvdec_bitstream_carries_the_note(old_x264):
    """What the GPU path hands NVDEC for a clip starting at a later IDR holds the version
    note: FFmpeg, given only that bitstream (no extradata), decodes the whole file's frames."""
    path, reference = old_x264
    index = video([path], sequence_length=4, stride=5, step=KEYINT)
    for i in range(1, len(index)):
        sample = index[i]
        header = codec_header(sample["codec"])
        assert any(b"x264 - core 142" in unit for unit in header.state)
        table = np.asarray(sample["packets"])
        ctx = av.CodecContext.create("h264", "r")
        got = {}
        for unit, frame in zip(annexb_packets(sample["data"], table, sample["codec"]), table[:, 2].tolist()):
            packet = av.Packet(unit)
            packet.pts = frame
            got.update((p.pts, p.to_ndarray(format="rgb24")) for p in ctx.decode(packet))
        got.update((p.pts, p.to_ndarray(format="rgb24")) for p in ctx.decode(None))
        f0 = int(sample["frame"])
        for j in range(4):
            np.testing.assert_array_equal(got[f0 + 5 * j], reference[f0 + 5 * j], err_msg=f"frame {f0 + 5 * j}")


def test_a_clip_at_the_file_start_carries_no_state(old_x264):
    path, _ = old_x264
    index = video([path], sequence_length=4, step=KEYINT)
    assert codec_header(index[0]["codec"]).state == ()
    assert len(codec_header(index[1]["codec"]).state) == 1  # the note; SPS and PPS are the header's


@pytest.mark.parametrize("encoder,codec,options", [
    ("libx264", "h264", {}),
    ("libx265", "hevc", {"x265-params": "log-level=error"}),
])
def test_stream_state_keeps_the_latest_unit_of_each_kind(tmp_path, encoder, codec, options):
    """On a real encoder's units: parameter sets come back in decoding order, each the
    latest of its kind and id, the user-data note as one-message SEI (x264's, which is
    one such message, byte for byte); units equal to the header's are left out."""
    path = tmp_path / "v.mp4"
    write_video(path, encoder, 64, 48, frames=4, options=options)
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        extradata = stream.codec_context.extradata
        first = bytes(next(p for p in c.demux(stream) if p.size))
    header = _nal.header_units(codec, extradata)
    size = _nal.length_size(codec, extradata)
    in_band = [first[a:a + n] for a, n in _nal.units(first, 0, len(first), size)]
    kinds = [_nal.nal_type(codec, u) for u in header]
    sets = [u for u, k in zip(header, kinds) if k in ((7, 8) if codec == "h264" else (32, 33, 34))]

    state = _nal.StreamState(codec)
    for unit in reversed(header):  # PPS before SPS: they still come back SPS first
        state.add(unit)
    for unit in in_band:
        state.add(unit)
    got = state.units()
    assert got[:len(sets)] == tuple(sets)
    notes = got[len(sets):]
    assert notes and all(_nal.nal_type(codec, u) in (6, 39) for u in notes)
    if codec == "h264":
        assert notes == tuple(u for u in in_band if _nal.nal_type(codec, u) == 6)  # x264's SEI as written
    else:
        assert any(b"x265" in u for u in notes)  # hvcC holds x265's note

    state.add(header[0])  # the same again: nothing changes
    assert state.units() == got
    known = _nal.StreamState(codec, header)
    for unit in in_band:
        known.add(unit)
    assert known.units() == (() if codec == "hevc" else tuple(u for u in in_band if _nal.nal_type(codec, u) == 6))


def test_an_index_without_stream_state_is_refused_clearly(old_x264):
    """A codec field of an index an older gpuio saved (no stream state) would decode
    these files wrong: it is refused with what to do."""
    path, _ = old_x264
    blob = video([path], sequence_length=4, step=KEYINT)[1]["codec"]
    text, _, rest = blob.partition(b"\n")
    old = re.sub(rb',"state":\[[0-9,]*\]', b"", text) + b"\n" + codec_header(blob).extradata
    with pytest.raises(FormatError, match="older gpuio.*index the videos again"):
        codec_header(old)
    with pytest.raises(FormatError, match="stream-state lengths"):
        codec_header(text.replace(b'"state":[', b'"state":[99999,') + b"\n" + rest)


# ---- NVDEC host side ---------------------------------------------------------------------------

class DLPackOnly:
    """A decoded picture as PyNvVideoCodec 2.2.4's DecodedFrame exposes it: DLPack only,
    no ``__cuda_array_interface__``, no buffer protocol."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, *args, **kwargs):
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_a_dlpack_only_picture_converts_without_a_copy():
    picture = np.arange(48 * 64 * 3, dtype=np.uint8).reshape(48, 64, 3)
    got = device_frame(np, DLPackOnly(picture))
    assert got.dtype == np.uint8 and np.shares_memory(got, picture)
    np.testing.assert_array_equal(got.reshape(48, 64, 3), picture)
    assert np.asarray(DLPackOnly(picture)).dtype == object  # what asarray makes of it instead
