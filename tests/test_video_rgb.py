"""decode_video's YUV 4:2:0 -> RGB24 in C (ops/_video.c) against PyAV's swscale.

The C conversion writes straight into the clip's array; it is used only where it gives
the bytes of ``VideoFrame.to_ndarray(format="rgb24")``, which ops.video checks once per
colour setting on every (Y, U, V) triple. Frames here are made by PyAV (random planes)
and by libx264 in tmp_path (full range, BT.709 tags).
"""

from __future__ import annotations

import av
import numpy as np
import pytest
from test_video import decode, full_decode, write_video

import gpuio.ops.video as video_ops
from gpuio.formats import video

pytestmark = pytest.mark.skipif(video_ops._video is None, reason="gpuio.ops._video was not built (no C compiler)")

# (pixel format, AVColorSpace, AVColorRange): unspecified/limited, BT.709 limited, JPEG full, BT.2020 full
SETTINGS = [("yuv420p", 2, 0), ("yuv420p", 1, 1), ("yuvj420p", 2, 2), ("yuv420p", 9, 2)]


def random_frame(width: int, height: int, setting: tuple[str, int, int], seed: int = 0) -> av.VideoFrame:
    fmt, colorspace, color_range = setting
    frame = av.VideoFrame(width, height, fmt)
    frame.colorspace, frame.color_range = colorspace, color_range
    rng = np.random.default_rng(seed)
    for plane in frame.planes:
        data = np.frombuffer(plane, np.uint8)
        data[:] = rng.integers(0, 256, data.shape)
    return frame


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("width,height", [(2, 2), (16, 2), (66, 50), (70, 36), (1918, 8), (4098, 4)])
def test_direct_conversion_equals_pyav_at_even_sizes(setting, width, height):
    frame = random_frame(width, height, setting, seed=width * height)
    coefficients = video_ops._direct_rgb(frame)
    assert coefficients is not None, f"the C conversion is not used for {setting}"
    got = np.full((height, width, 3), 7, np.uint8)
    video_ops._yuv420_rgb24(frame, got, coefficients)
    np.testing.assert_array_equal(got, frame.to_ndarray(format="rgb24"))


def test_odd_sizes_and_other_formats_are_left_to_swscale():
    assert video_ops._direct_rgb(av.VideoFrame(65, 48, "yuv420p")) is None
    assert video_ops._direct_rgb(av.VideoFrame(64, 49, "yuv420p")) is None
    assert video_ops._direct_rgb(av.VideoFrame(64, 48, "yuv444p")) is None
    assert video_ops._direct_rgb(av.VideoFrame(64, 48, "nv12")) is None


def test_the_check_refuses_coefficients_that_differ(monkeypatch):
    right = video_ops._rgb_coefficients

    def off_by_one(colorspace: int, full_range: bool) -> tuple[int, ...]:
        c = right(colorspace, full_range)
        return c[:7] + (c[7] + 1,)  # V's share of red, one unit off

    assert video_ops._checked_coefficients("yuv420p", 2, 0) == right(2, False)
    monkeypatch.setattr(video_ops, "_rgb_coefficients", off_by_one)
    assert video_ops._checked_coefficients("yuv420p", 2, 0) is None
    monkeypatch.undo()
    assert video_ops._checked_coefficients("yuv420p", 14, 1) is None  # ICtCp: swscale refuses it


def test_output_checks_its_size():
    frame = random_frame(16, 4, SETTINGS[0])
    with pytest.raises(ValueError, match="do not fit"):
        video_ops._yuv420_rgb24(frame, np.empty((4, 14, 3), np.uint8), video_ops._direct_rgb(frame))
    with pytest.raises(TypeError, match="bytes-like"):  # a strided array is not a contiguous buffer
        video_ops._yuv420_rgb24(frame, np.empty((4, 32, 3), np.uint8)[:, ::2], video_ops._direct_rgb(frame))


def test_full_range_bt709_clips_equal_decoding_the_whole_file(tmp_path):
    path = tmp_path / "bt709_full.mp4"
    write_video(path, "libx264", 96, 64, frames=24, options={"bf": "2", "g": "8"}, seed=3, colors=(1, 2))
    with av.open(str(path)) as c:
        first = next(c.decode(video=0))
        assert (int(first.colorspace), int(first.color_range)) == (1, 2)  # the tags reach the decoder
        assert video_ops._direct_rgb(first) is not None
    index = video([path], sequence_length=5, stride=3, step=4)
    reference = full_decode(path)
    for i, frames in enumerate(decode(index, np.arange(len(index)))):
        f0 = int(index.values["frame"][i])
        np.testing.assert_array_equal(frames, reference[f0: f0 + 13: 3], err_msg=f"clip {i} from frame {f0}")
