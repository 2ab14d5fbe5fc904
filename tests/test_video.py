"""formats.video and ops.decode_video: every clip against decoding the whole file.

Videos are written in tmp_path by PyAV's encoders (libx264, libx265, libvpx-vp9,
libsvtav1): odd sizes, B-frames, open GOPs, a variable frame rate, interleaved audio.
"""

from __future__ import annotations

import fractions
import os

import av
import numpy as np
import pytest
from checkers import check_exactly_once, check_resume
from conftest import to_host

import gpuio
from gpuio import ops
from gpuio.errors import ConfigError, DataError, FormatError, PipelineError, StorageError
from gpuio.formats import video
from gpuio.index import SampleIndex
from gpuio.ops.video import _annexb, annexb_packets, codec_header, decode_clip

FRAMES = 40


def write_video(path, codec: str, width: int, height: int, *, frames: int = FRAMES, pix_fmt: str = "yuv420p",
                options: dict[str, str] | None = None, vfr: bool = False, audio: str | None = None,
                seed: int = 0, colors: tuple[int, int] | None = None) -> None:
    """A short clip of moving gradients and noise (so that P/B-frames carry data);
    ``colors=(AVColorSpace, AVColorRange)`` tags the stream and converts to them."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        stream.time_base = fractions.Fraction(1, 1000) if vfr else fractions.Fraction(1, 30)
        stream.options = options or {}
        if colors is not None:
            stream.codec_context.colorspace, stream.codec_context.color_range = colors
        sound = out.add_stream(audio, rate=48000) if audio else None
        t = 0
        yy, xx = np.mgrid[0:height, 0:width]
        for i in range(frames):
            img = np.stack([(xx * 3 + i * 5) % 256, (yy * 4 + i * 2) % 256, (xx + yy + i * 9) % 256], -1)
            img = (img + rng.integers(0, 24, img.shape)).clip(0, 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            if colors is not None:
                frame = frame.reformat(format=pix_fmt, dst_colorspace=colors[0], dst_color_range=colors[1])
            frame.pts = t if vfr else i
            t += int(rng.integers(15, 60)) if vfr else 1
            out.mux(stream.encode(frame))
            if sound is not None:
                chunk = av.AudioFrame.from_ndarray(rng.standard_normal((1, 1600)).astype(np.float32) * 0.1,
                                                   format="fltp", layout="mono")
                chunk.sample_rate, chunk.pts = 48000, i * 1600
                out.mux(sound.encode(chunk))
        out.mux(stream.encode())
        if sound is not None:
            out.mux(sound.encode())


# name -> (class folder, encoder, width, height, options)
VIDEOS = {
    "h264_bframes_audio.mp4": ("a", "libx264", 66, 50, dict(options={"bf": "3", "g": "12"}, audio="aac")),
    "h264_444_odd.mkv": ("a", "libx264", 65, 47, dict(pix_fmt="yuv444p", options={"bf": "2", "g": "10"})),
    "hevc_vfr_opengop.mp4": ("b", "libx265", 64, 48, dict(vfr=True, options={
        "x265-params": "keyint=12:min-keyint=12:bframes=3:open-gop=1:log-level=error"})),
    "vp9_audio.webm": ("b", "libvpx-vp9", 64, 48, dict(options={"g": "12"}, audio="libopus")),
    "av1.mkv": ("c", "libsvtav1", 64, 48, dict(options={"g": "12", "svtav1-params": "log-level=0"})),
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    for k, (name, (cls, codec, w, h, kw)) in enumerate(VIDEOS.items()):
        (root / cls).mkdir(exist_ok=True)
        write_video(root / cls / name, codec, w, h, seed=k, **kw)
    return root


def full_decode(path, size=None) -> np.ndarray:
    """Every frame of the file, decoded from its start by PyAV: [N, H, W, 3]."""
    resize = {} if size is None else {"height": size[0], "width": size[1]}
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24", **resize) for f in c.decode(video=0)])


def decode(index: SampleIndex, rows, device: str = "cpu", size=None) -> list[np.ndarray]:
    """Clips ``rows`` through the Loader with decode_video, as NumPy arrays."""
    loader = gpuio.Loader(index.take(rows), len(rows), ops=[ops.decode_video(size)], device=device,
                          output="numpy", threads=2)
    (batch,) = list(loader)
    frames = batch["frames"]
    return [to_host(f) for f in frames]


# ---- the index ------------------------------------------------------------------------

@pytest.mark.parametrize("length,stride,step", [(4, 3, None), (5, 1, 3), (1, 1, 7), (3, 9, 2)])
def test_clip_rule_labels_and_spans(tree, length, stride, step):
    index = video(tree, sequence_length=length, stride=stride, step=step)
    paths = sorted(str(p) for p in tree.rglob("*.*"))
    assert list(index.files) == paths
    assert index.meta["classes"] == ["a", "b", "c"]
    want_frames, want_files = [], []
    for f in range(len(paths)):
        starts = list(range(0, FRAMES - (length - 1) * stride, step or length))
        want_frames += starts
        want_files += [f] * len(starts)
    np.testing.assert_array_equal(index.values["frame"], want_frames)
    np.testing.assert_array_equal(index.values["file"], want_files)
    labels = {p: "abc".index(os.path.basename(os.path.dirname(p))) for p in paths}
    np.testing.assert_array_equal(index.values["label"], [labels[paths[f]] for f in want_files])
    ext = index.extents["data"]
    sizes = np.array([os.path.getsize(p) for p in paths])
    assert (ext.length < sizes[ext.file]).all()  # a clip reads its packets, not the file
    for i in range(len(index)):
        table = index.values["packets"][i]
        assert table[0, 0] == 0 and (table[:, 0] + table[:, 1]).max() == ext.length[i]
        assert sorted(table[table[:, 3] >= 0, 3].tolist()) == list(range(length))


def test_audio_packets_inside_a_span_are_skipped(tree):
    index = video([tree / "a" / "h264_bframes_audio.mp4"], sequence_length=8)
    gaps = 0
    for i in range(len(index)):
        table = index.values["packets"][i]
        by_offset = table[np.argsort(table[:, 0])]
        gaps += int((by_offset[1:, 0] > by_offset[:-1, 0] + by_offset[:-1, 1]).sum())
    assert gaps > 0  # interleaved audio sits between the video packets the clip reads


def test_save_and_load(tree, tmp_path):
    index = video(tree, sequence_length=3, stride=2)
    index.save(tmp_path / "videos.npz")
    loaded = SampleIndex.load(tmp_path / "videos.npz")
    assert loaded.fields == index.fields and loaded.meta == index.meta
    for i in (0, len(index) // 2, len(index) - 1):
        a, b = index[i], loaded[i]
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    rows = [0, len(index) - 1]
    for x, y in zip(decode(index, rows), decode(loaded, rows)):
        np.testing.assert_array_equal(x, y)


def test_file_list_and_plain_list(tree, tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text("c/av1.mkv 7\nb/vp9_audio.webm 3\n")
    index = video(tree, sequence_length=10, stride=2, file_list=listing)
    assert [os.path.basename(p) for p in index.files] == ["av1.mkv", "vp9_audio.webm"]
    np.testing.assert_array_equal(index.values["label"], [7, 7, 7, 3, 3, 3])
    plain = video([tree / "c" / "av1.mkv", tree / "b" / "vp9_audio.webm"], sequence_length=10, stride=2)
    np.testing.assert_array_equal(plain.values["label"], [0, 0, 0, 1, 1, 1])


# ---- decoding ---------------------------------------------------------------------------

@pytest.mark.parametrize("length,stride,step", [(4, 3, 2), (6, 1, 5), (2, 17, 3)])
def test_every_clip_equals_decoding_the_whole_file(tree, device, length, stride, step):
    index = video(tree, sequence_length=length, stride=stride, step=step)
    reference = {f: full_decode(p) for f, p in enumerate(index.files)}
    clips = decode(index, np.arange(len(index)), device)
    for i, frames in enumerate(clips):
        f, f0 = int(index.values["file"][i]), int(index.values["frame"][i])
        want = reference[f][f0: f0 + (length - 1) * stride + 1: stride]
        assert frames.shape == want.shape and frames.dtype == np.uint8
        if device == "cpu":
            np.testing.assert_array_equal(frames, want, err_msg=f"clip {i}: {index.files[f]} from frame {f0}")
        else:  # NVDEC's pictures are exact; its YUV -> RGB rounds differently from swscale's
            diff = np.abs(frames.astype(int) - want)
            assert diff.mean() < 1.5 and diff.max() <= 12, f"clip {i}: {index.files[f]} from frame {f0}"


def test_nvdec_bitstream_decodes_to_the_same_frames(tree):
    """What the GPU path feeds NVDEC (Annex B, parameter sets in band) decodes, with
    FFmpeg and no extradata, to the frames of the clip."""
    index = video(tree, sequence_length=3, stride=5, step=11)
    for i in range(len(index)):
        sample = index[i]
        header = codec_header(sample["codec"])
        units = annexb_packets(sample["data"], sample["packets"], sample["codec"])
        if header.decoder in ("h264", "hevc"):
            assert all(u.startswith(b"\0\0\0\1") for u in units)
        bare = header._replace(extradata=b"")
        ctx = av.CodecContext.create(header.decoder, "r")
        ctx.colorspace, ctx.color_range = bare.colorspace, bare.color_range
        got = {}
        table = sample["packets"]
        for unit, (_, _, frame, slot) in zip(units, table.tolist()):
            packet = av.Packet(unit)
            packet.pts = frame
            for picture in ctx.decode(packet):
                got[picture.pts] = picture.to_ndarray(format="rgb24")
        for picture in ctx.decode(None):
            got[picture.pts] = picture.to_ndarray(format="rgb24")
        want = decode_clip(sample["data"], table, sample["codec"])
        kept = sorted(table[table[:, 3] >= 0, 2:4].tolist(), key=lambda r: r[1])
        np.testing.assert_array_equal(np.stack([got[f] for f, _ in kept]), want, err_msg=index.files[sample["file"]])


def test_nvdec_bitstream_with_a_nal_length_past_its_packet_names_the_sample(tree):
    index = video(tree, sequence_length=3, stride=5, step=11)
    i = next(i for i in range(len(index)) if codec_header(index[i]["codec"]).decoder == "h264"
             and codec_header(index[i]["codec"]).extradata[:1] == b"\x01")  # avcC: length-prefixed NAL units
    sample = index[i]
    table = np.asarray(sample["packets"])
    data = bytearray(sample["data"])
    data[int(table[0, 0]): int(table[0, 0]) + 4] = b"\xff\xff\xff\xff"  # the first NAL unit's length field
    with pytest.raises(FormatError, match=rf"sample {i}: frame {table[0, 2]}: a NAL unit of \d+ bytes runs past"):
        _annexb(bytes(data), table, codec_header(sample["codec"]), sample=i)


def test_resize_in_the_same_pass(tree, device):
    index = video([tree / "a" / "h264_bframes_audio.mp4"], sequence_length=3, stride=4)
    want = full_decode(index.files[0], size=(24, 34))
    for i, frames in enumerate(decode(index, np.arange(len(index)), device, size=(24, 34))):
        f0 = int(index.values["frame"][i])
        expected = want[f0: f0 + 9: 4]
        if device == "cpu":
            np.testing.assert_array_equal(frames, expected)
        else:
            assert np.abs(frames.astype(int) - expected).mean() < 3


def test_loader_stacks_shuffles_shards_and_resumes(tree):
    same_size = [tree / "b" / "hevc_vfr_opengop.mp4", tree / "b" / "vp9_audio.webm", tree / "c" / "av1.mkv"]
    index = video(same_size, sequence_length=4, stride=2, step=3)
    loader = gpuio.Loader(index, 5, ops=[ops.decode_video()], shuffle=True, seed=3, threads=2)
    batch = next(iter(loader))
    assert tuple(batch["frames"].shape) == (5, 4, 48, 64, 3)
    assert "packets" not in batch and "codec" not in batch
    assert batch["label"].tolist() == index.values["label"][batch["index"].numpy()].tolist()
    loader.close()

    def make(**kw):
        settings = dict(batch_size=4, ops=[ops.decode_video(size=(16, 16))], shuffle=True, seed=1, threads=2,
                        fields=["data", "label", "frame", "packets", "codec"], output="numpy")
        settings.update(kw)
        return gpuio.Loader(index, settings.pop("batch_size"), **settings)

    check_exactly_once(make, len(index), world_size=2, last_batch="partial")
    check_resume(make, epochs=1)


# ---- bad input ------------------------------------------------------------------------------

def test_corrupt_packet_names_file_and_frame(tree, tmp_path):
    path = tmp_path / "corrupt.mp4"
    path.write_bytes((tree / "a" / "h264_bframes_audio.mp4").read_bytes())
    index = video([path], sequence_length=4, stride=3)
    table = index.values["packets"][1]
    offset, size, frame, _ = table[table[:, 3] == 2][0]
    with open(path, "r+b") as f:  # the slice data of a kept P/B-frame
        f.seek(index.extent(1).offset + int(offset) + 4)
        f.write(np.random.default_rng(0).integers(0, 256, int(size) - 4, dtype=np.uint8).tobytes())
    with pytest.raises(PipelineError, match=rf"file {path}.*frame {frame}\b"):
        decode(index, [0, 1, 2])
    loader = gpuio.Loader(index, 8, ops=[ops.decode_video()], on_error="skip", output="numpy", threads=2)
    batches = list(loader)
    kept = [int(i) for b in batches for i in b["index"]]
    assert 1 not in kept and len(kept) == len(index) - 1
    assert loader.stats()["skipped"] == 1 and f"frame {frame}" in loader.stats()["errors"][0]


def remux_faststart(src, dst) -> None:
    """``src`` with its ``moov`` box in front (the packets stay the same)."""
    with av.open(str(src)) as inp, av.open(str(dst), "w", options={"movflags": "faststart"}) as out:
        stream = out.add_stream_from_template(inp.streams.video[0])
        for packet in inp.demux(inp.streams.video[0]):
            if packet.size:
                packet.stream = stream
                out.mux(packet)


@pytest.mark.parametrize("name", ["cut.mp4", "cut_faststart.mp4", "cut.mkv"])
def test_file_cut_short_is_an_index_error(tree, tmp_path, name):
    src = tree / ("a/h264_bframes_audio.mp4" if name.endswith("mp4") else "c/av1.mkv")
    if "faststart" in name:
        remux_faststart(src, tmp_path / "whole.mp4")
        assert len(video([tmp_path / "whole.mp4"], sequence_length=2)) == FRAMES // 2
        src = tmp_path / "whole.mp4"
    data = src.read_bytes()
    (tmp_path / name).write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(FormatError, match=rf"{name}.*cut short"):
        video([tmp_path / name], sequence_length=2)


def test_file_without_video_is_an_index_error(tmp_path):
    path = tmp_path / "sound.m4a"
    with av.open(str(path), "w") as out:
        sound = out.add_stream("aac", rate=8000)
        chunk = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        chunk.sample_rate = 8000
        out.mux(sound.encode(chunk))
        out.mux(sound.encode())
    with pytest.raises(FormatError, match=rf"{path}: no video stream"):
        video([path], sequence_length=1)



def test_missing_directory_or_fifo_names_the_file(tmp_path):
    (tmp_path / "dir.mp4").mkdir()
    os.mkfifo(tmp_path / "fifo.mp4")
    with pytest.raises(StorageError, match="No such file") as err:
        video([tmp_path / "missing.mp4"], sequence_length=1)
    assert err.value.path == str(tmp_path / "missing.mp4")
    with pytest.raises(DataError, match="a video file must be a regular file, this is a directory") as err:
        video([tmp_path / "dir.mp4"], sequence_length=1)
    assert err.value.path == str(tmp_path / "dir.mp4")
    with pytest.raises(DataError, match="this is a device, FIFO or socket") as err:
        video([tmp_path / "fifo.mp4"], sequence_length=1)  # must not wait for a writer
    assert err.value.path == str(tmp_path / "fifo.mp4")

def test_settings_are_checked(tree):
    for bad in (dict(sequence_length=0), dict(sequence_length=2, stride=0), dict(sequence_length=2, step=-1)):
        with pytest.raises(ConfigError):
            video(tree, **bad)
    with pytest.raises(gpuio.errors.DataError, match="no samples"):
        video(tree, sequence_length=FRAMES + 1)
    with pytest.raises(ConfigError, match="size"):
        ops.decode_video(size=(0, 4))


@pytest.mark.parametrize("codec,options", [
    ("libx264", {"bf": "2", "g": "8"}),
    ("libx265", {"x265-params": "keyint=8:min-keyint=8:bframes=2:open-gop=0:log-level=error"}),
    ("libx264", {"bf": "2", "g": "8", "x264-params": "repeat-headers=1"}),  # parameter sets in band
    ("libx265", {"x265-params": "keyint=8:min-keyint=8:bframes=2:open-gop=0:repeat-headers=1:log-level=error"}),
])
def test_clips_across_idr_pictures_decode_in_parts(tmp_path, codec, options):
    """A clip spanning several IDR pictures decodes as independent parts (in parallel in
    the op), each ending at its last kept frame, also where parameter sets come in band
    (a part's decoder is given those seen before it); the frames still equal the whole file's."""
    path = tmp_path / "gops.mp4"
    write_video(path, codec, 64, 48, frames=44, options=options, seed=5)
    index = video([path], sequence_length=6, stride=7, step=3)
    reference = full_decode(path)
    sample = index[0]
    table = np.asarray(sample["packets"])
    clip = ops.video._Clip(sample["data"], table, sample["codec"], None, None, 0)
    assert len(clip.parts) > 2 and sum(b - a for a, b, _ in clip.parts) < len(table)
    for i, frames in enumerate(decode(index, np.arange(len(index)))):
        f0 = int(index.values["frame"][i])
        np.testing.assert_array_equal(frames, reference[f0: f0 + 36: 7], err_msg=f"clip {i} from frame {f0}")
        s = index[i]
        np.testing.assert_array_equal(decode_clip(s["data"], s["packets"], s["codec"]), frames)
