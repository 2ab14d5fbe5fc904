"""Audio data: NeMo manifests, audio file trees, decode_audio (WAV, FLAC, OGG written
by soundfile in tmp_path), segments, downmix, resampling, bad files, and the whole
Jasper-style pipeline through gpuio.Loader on the CPU and the GPU."""

import io
import json
import os

import numpy as np
import pytest
import soundfile as sf

import gpuio
from gpuio import formats, ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device
from gpuio.errors import DataError, FormatError, PipelineError, StorageError
from gpuio.ops.audio import AUDIO_EXTENSIONS
from tests.conftest import to_host

RATE = 16000


def tone(seconds, rate=RATE, freq=440.0, channels=1, amp=0.5):
    t = np.arange(round(seconds * rate)) / rate
    mono = amp * np.sin(2 * np.pi * freq * t)
    if channels == 1:
        return mono.astype(np.float32)
    return np.stack([mono * (c + 1) / channels for c in range(channels)], axis=1).astype(np.float32)


def encode(x, fmt="WAV", subtype="PCM_16", rate=RATE):
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return np.frombuffer(buf.getvalue(), np.uint8)


def make_batch(bufs, device="cpu", on_error="raise", **extra):
    index = np.arange(len(bufs))
    dev = Device("cuda", 0) if device == "cuda" else Device("cpu")
    return Batch({"data": list(bufs), **extra}, index, sample_seeds(0, 0, index), dev, on_error=on_error)


def pcm16(x):
    """What a PCM_16 file gives back for float samples ``x``."""
    return np.clip(np.round(x * 32768), -32768, 32767) / 32768


# ---------------------------------------------------------------- formats


def test_manifest_fields_relative_paths_and_shared_files(tmp_path):
    (tmp_path / "wavs").mkdir()
    sf.write(tmp_path / "wavs" / "a.flac", tone(1.0), RATE)
    sf.write(tmp_path / "b.wav", tone(0.5), RATE)
    other = tmp_path / "elsewhere"
    other.mkdir()
    sf.write(other / "c.wav", tone(0.25), RATE)
    lines = [{"audio_filepath": "wavs/a.flac", "duration": 1.0, "text": "héllo"},
             {"audio_filepath": "b.wav", "duration": 0.5, "text": "world", "offset": 0.1},
             {"audio_filepath": "wavs/a.flac", "duration": 0.3, "offset": 0.2, "text": "segment"},
             {"audio_filepath": str(other / "c.wav"), "text": ""}]
    path = tmp_path / "meta" / "train.json"
    path.parent.mkdir()
    path.write_text("\n".join(json.dumps(e) for e in lines).replace("wavs/", "../wavs/").replace('"b.wav', '"../b.wav')
                    + "\n\n")
    index = formats.manifest(path)
    assert len(index) == 4 and len(index.files) == 3  # a.flac listed once
    assert index.values["duration"][:3].tolist() == [1.0, 0.5, 0.3] and np.isnan(index.values["duration"][3])
    assert index.values["offset"].tolist() == [0.0, 0.1, 0.2, 0.0]
    assert [index.values["text"][i] for i in range(4)] == ["héllo", "world", "segment", ""]
    assert index.extent(0) == (str(tmp_path / "wavs" / "a.flac"), 0, os.path.getsize(tmp_path / "wavs" / "a.flac"))
    assert index.extent(2).file == index.extent(0).file
    assert index[3]["data"] == (other / "c.wav").read_bytes()
    index.save(tmp_path / "m.idx")
    again = gpuio.SampleIndex.load(tmp_path / "m.idx")
    assert again[1]["text"] == "world" and again[2]["offset"] == 0.2 and again.extent(1) == index.extent(1)


@pytest.mark.parametrize("line,match", [
    ("not json", "not a JSON object"), ('{"duration": 1}', "audio_filepath"),
    ('{"audio_filepath": "a.wav", "duration": "long"}', "'duration' must be a number"),
    ('{"audio_filepath": "a.wav", "offset": -1}', "'offset' must be"),
    ('{"audio_filepath": "a.wav", "text": 3}', "'text' must be a string")])
def test_manifest_bad_lines_name_line_and_byte(tmp_path, line, match):
    sf.write(tmp_path / "a.wav", tone(0.1), RATE)
    first = '{"audio_filepath": "a.wav", "duration": 0.1}\n'
    path = tmp_path / "m.json"
    path.write_text(first + line + "\n")
    with pytest.raises(FormatError, match=match) as err:
        formats.manifest(path)
    assert err.value.path == str(path) and err.value.sample == "line 2" and err.value.offset == len(first)


def test_manifest_missing_audio_file_and_empty_manifest(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{"audio_filepath": "gone.wav", "duration": 1}\n')
    with pytest.raises(StorageError, match="cannot read sound file named in manifest") as err:
        formats.manifest(path)
    assert err.value.path == str(tmp_path / "gone.wav")
    path.write_text("\n")
    with pytest.raises(DataError, match="no samples"):
        formats.manifest(path)


def test_manifest_naming_a_directory_or_fifo_names_it(tmp_path):
    """As in the other formats: not a regular file is a DataError naming it (a FIFO
    must not block the indexing), the manifest itself too."""
    (tmp_path / "dir.wav").mkdir()
    os.mkfifo(tmp_path / "fifo.wav")
    sf.write(tmp_path / "a.wav", tone(0.1), RATE)
    for name, kind in (("dir.wav", "a directory"), ("fifo.wav", "a device, FIFO or socket")):
        path = tmp_path / "m.json"
        path.write_text(f'{{"audio_filepath": "a.wav"}}\n{{"audio_filepath": "{name}"}}\n')
        with pytest.raises(DataError, match=f"must be a regular file, this is {kind}") as err:
            formats.manifest(path)
        assert err.value.path == str(tmp_path / name) and "m.json" in str(err.value)
        with pytest.raises(DataError, match=f"a manifest must be a regular file, this is {kind}") as err:
            formats.manifest(tmp_path / name)
        assert err.value.path == str(tmp_path / name)


def test_filetree_with_audio_extensions(tmp_path):
    for cls, n in (("no", 2), ("yes", 3)):
        (tmp_path / cls).mkdir()
        for k in range(n):
            sf.write(tmp_path / cls / f"{k}.{['wav', 'flac', 'ogg'][k]}", tone(0.1 * (k + 1)), RATE)
    (tmp_path / "yes" / "notes.txt").write_text("not audio")
    index = formats.filetree(tmp_path, extensions=AUDIO_EXTENSIONS)
    assert len(index) == 5 and index.values["label"].tolist() == [0, 0, 1, 1, 1]


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("fmt,subtype,tol", [("WAV", "PCM_16", 0), ("WAV", "FLOAT", 0), ("FLAC", "PCM_16", 0),
                                             ("FLAC", "PCM_24", 0), ("OGG", "VORBIS", 0.05),
                                             ("OGG", "OPUS", 0.05), ("MP3", "MPEG_LAYER_III", 0.05)])
def test_decode_formats(device, fmt, subtype, tol):
    clips = [tone(s, freq=f) for s, f in ((0.7, 440.0), (0.05, 1000.0), (1.3, 250.0))]
    batch = ops.decode_audio()(make_batch([encode(x, fmt, subtype) for x in clips], device))
    assert to_host(batch.data["sample_rate"]).tolist() == [RATE] * 3
    for x, y in zip(clips, batch.data["audio"]):
        y = to_host(y)
        assert y.dtype == np.float32 and y.shape == x.shape
        if tol:
            assert np.sqrt(np.mean((y - x) ** 2)) < tol
        elif subtype == "FLOAT":
            np.testing.assert_array_equal(y, x)
        else:
            bits = 15 if subtype == "PCM_16" else 23
            np.testing.assert_allclose(y, x, atol=1.0 / 2 ** bits)


def test_decode_stereo_downmix_dtype_and_segments(device):
    stereo = tone(0.5, channels=2)
    buf = encode(stereo, "FLAC")
    mixed = to_host(ops.decode_audio()(make_batch([buf], device)).data["audio"][0])
    np.testing.assert_allclose(mixed, pcm16(stereo).mean(axis=1), atol=1e-6)
    both = to_host(ops.decode_audio(downmix=False)(make_batch([buf], device)).data["audio"][0])
    np.testing.assert_allclose(both, pcm16(stereo), atol=1e-6)
    ints = to_host(ops.decode_audio(downmix=False, dtype="int16")(make_batch([buf], device)).data["audio"][0])
    assert ints.dtype == np.int16 and np.array_equal(ints, np.round(pcm16(stereo) * 32768).astype(np.int16))
    mixed_ints = to_host(ops.decode_audio(dtype="int16")(make_batch([buf], device)).data["audio"][0])
    np.testing.assert_array_equal(mixed_ints, np.rint(ints.astype(np.float64).mean(axis=1)).astype(np.int16))
    mono = tone(1.0)
    segment = ops.decode_audio()(make_batch([encode(mono, "FLAC")] * 3, device,
                                            offset=np.array([0.25, 0.0, 0.9]),
                                            duration=np.array([0.5, np.nan, 0.5])))
    got = [to_host(a) for a in segment.data["audio"]]
    np.testing.assert_allclose(got[0], pcm16(mono)[4000:12000], atol=1e-6)
    assert len(got[1]) == RATE and len(got[2]) == 1600  # to the end; clipped to the file


def test_decode_resamples_with_resample_poly(device):
    x44 = tone(0.5, rate=44100, freq=1000.0)
    batch = ops.decode_audio(sample_rate=RATE)(make_batch([encode(x44, "WAV", "FLOAT", 44100),
                                                           encode(tone(0.5), "WAV", "FLOAT")], device))
    assert to_host(batch.data["sample_rate"]).tolist() == [RATE, RATE]
    y = to_host(batch.data["audio"][0])
    ref = tone(0.5, freq=1000.0)
    assert len(y) == len(ref)
    inner = slice(200, -200)  # away from the filter's edges
    snr = 10 * np.log10(np.sum(ref[inner] ** 2) / np.sum((y[inner] - ref[inner]) ** 2))
    assert snr > 50
    np.testing.assert_array_equal(to_host(batch.data["audio"][1]), tone(0.5))


def test_bad_audio_is_a_format_error_or_skipped(device):
    good = encode(tone(0.5), "WAV")
    flac = encode(tone(2.0, freq=3000.0), "FLAC")
    bad = [np.frombuffer(b"this is not audio at all" * 20, np.uint8), good[: len(good) // 2], flac[: len(flac) // 2]]
    for buf, match in zip(bad, ["not an audio file", "WAV file cut short", "cut short|cannot decode"]):
        with pytest.raises(FormatError, match=match) as err:
            ops.decode_audio()(make_batch([good, buf], device))
        assert err.value.sample == 1
    batch = ops.decode_audio()(make_batch([good, *bad, good], device, on_error="skip"))
    assert batch.index.tolist() == [0, 4] and [i for i, _ in batch.errors] == [1, 2, 3]
    assert all(len(to_host(a)) == RATE // 2 for a in batch.data["audio"])
    with pytest.raises(FormatError, match="outside the file"):
        ops.decode_audio()(make_batch([good], device, offset=np.array([3.0]), duration=np.array([1.0])))


# ---------------------------------------------------------------- the pipeline through the loader


def jasper(rate=RATE):
    return [ops.decode_audio(), ops.preemphasis_filter(), ops.nonsilent_region(), ops.slice(),
            ops.spectrogram(nfft=512, window_length=320, window_step=160),
            ops.mel_filter_bank(sample_rate=rate, nfilter=64), ops.to_decibels(),
            ops.normalize_axes(axes=(1,)), ops.pad(axes=(1,), align=16)]


def test_loader_runs_the_jasper_pipeline_on_a_manifest(tmp_path, device):
    rng = np.random.default_rng(0)
    entries, names = [], []
    for k in range(7):
        x = (rng.standard_normal(round(rng.uniform(0.2, 1.5) * RATE)) * 0.1).astype(np.float32)
        x[:1000] *= 1e-4
        name = f"u{k}.{'flac' if k % 2 else 'wav'}"
        names.append(name)
        sf.write(tmp_path / name, x, RATE)
        entries.append({"audio_filepath": name, "duration": len(x) / RATE, "text": f"utterance {k}"})
    (tmp_path / "bad.wav").write_bytes(b"RIFF but not really")
    entries.insert(3, {"audio_filepath": "bad.wav", "duration": 1.0, "text": "bad"})
    (tmp_path / "m.json").write_text("\n".join(json.dumps(e) for e in entries))
    index = formats.manifest(tmp_path / "m.json")
    loader = gpuio.Loader(index, 4, ops=jasper(), device=device, output="numpy", on_error="skip")
    batches = list(loader)
    assert loader.stats()["skipped"] == 1 and "sample 3" in loader.stats()["errors"][0]
    texts = [t for b in batches for t in b["text"]]
    assert texts == [f"utterance {k}" for k in range(7)]
    # the loader's features equal the ops run on the decoded clips directly
    direct = jasper()[1:]
    for b, rows in zip(batches, (names[:3], names[3:7])):
        feats, lengths = to_host(b["audio"]), to_host(b["lengths"])
        assert feats.shape[0] == len(rows) and feats.shape[1] == 64 and feats.shape[2] % 16 == 0
        ref = Batch({"audio": [sf.read(tmp_path / p, dtype="float32")[0] for p in rows]}, np.arange(len(rows)),
                    sample_seeds(0, 0, np.arange(len(rows))))
        for op in direct:
            ref = op(ref)
        np.testing.assert_array_equal(lengths, ref.data["lengths"])
        np.testing.assert_allclose(feats, ref.data["audio"], atol=2e-3)
    with pytest.raises(PipelineError, match="bad.wav"):
        list(gpuio.Loader(index, 4, ops=jasper(), device=device, output="numpy"))
