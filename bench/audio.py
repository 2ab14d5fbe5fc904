"""Speech feature pipeline benchmark: ``python bench/audio.py --help``.

The Jasper-style pipeline, decode -> preemphasis_filter -> nonsilent_region + slice ->
spectrogram (nfft 512, 20 ms windows every 10 ms) -> mel_filter_bank (64 filters) ->
to_decibels (natural log, as Jasper) -> normalize per feature -> pad (multiple of 16),
batches of 64 clips of 1-20 s at 16 kHz (FLAC by default), written once with soundfile
into the gpuio cache folder with a NeMo manifest. Competitors, measured in one run in
interleaved rounds (each round: one epoch of each; the best round counts):

- gpuio on the CPU (``gpuio.Loader`` over ``formats.manifest``, ``threads`` = cores);
  on FLAC also with libsndfile decoding instead of ``ops/_flac.c`` (gpuio before it);
- DALI's CPU pipeline (``device_id=None``, ``num_threads`` = cores) with the same ops;
- a torch DataLoader (``num_workers`` = cores) whose dataset reads each file with
  soundfile and computes the same features with NumPy and scipy.fft, one clip at a time;
- on a machine with a GPU: gpuio on the GPU, and torchaudio's MelSpectrogram on the GPU
  on padded batches (decoded by soundfile in DataLoader workers; no silence trimming).

``--decode`` instead times decoding alone: one batch, one thread, gpuio's FLAC decoder
against libsndfile's (the same op without it) and DALI's ``decoders.audio``.

``--agreement`` instead compares gpuio's mel spectrograms with DALI's CPU operators and
librosa's on 16 of the clips, and the whole pipeline's features with DALI's (a one-off
check; DALI and librosa are not dependencies).

Prints samples/s and audio-seconds/s per competitor and gpuio's ratio to each, and for
the competitors that compute in this process (gpuio, DALI) the CPU time per sample
(``time.process_time``, all threads): on a machine shared with other work, CPU time is
the steadier measure of cost, wall time the one a training job sees.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import gpuio
from gpuio import ops
from gpuio.bench._common import cache_dir, machine, print_table, write_json

RATE = 16000
NFFT, WINDOW, STEP, MELS, ALIGN = 512, 320, 160, 64, 16
LOG_MULTIPLIER, LOG_REFERENCE, LOG_CUTOFF = math.log(10.0), 1.0, math.log(1e-20)  # Jasper's natural-log dB


def make_dataset(count: int, fmt: str, seed: int = 0, tonal: bool = False) -> str:
    """``count`` clips of 1-20 s (speech-like noise bursts between quiet edges; with
    ``tonal``, six tones under the bursts' envelope over faint noise, which FLAC codes
    with LPC where it codes the noise as FIXED order 0) and a NeMo manifest; returns
    the manifest path. Generated on first use."""
    import soundfile as sf

    root = os.path.join(cache_dir(), f"sample-audio-{count}-{fmt}-{seed}" + ("-tonal" if tonal else ""))
    manifest = os.path.join(root, "manifest.json")
    if os.path.exists(os.path.join(root, ".complete")):
        return manifest
    os.makedirs(root, exist_ok=True)
    print(f"generating {count} {fmt} clips in {root}", file=sys.stderr)
    rng = np.random.default_rng(seed)
    with open(manifest, "w") as f:
        for k in range(count):
            n = int(rng.uniform(1.0, 20.0) * RATE)
            envelope = np.repeat(rng.uniform(0.02, 0.5, size=n // 1600 + 1), 1600)[:n]
            x = rng.standard_normal(n) * envelope
            if tonal:
                t = np.arange(n) / RATE
                x = 0.002 * x + envelope / 6 * sum(np.sin(2 * np.pi * rng.uniform(100, 3000) * t + rng.uniform(0, 6))
                                                   for _ in range(6))
            quiet = int(rng.uniform(0.05, 0.5) * RATE)
            x[:quiet] *= 1e-4
            x[-quiet:] *= 1e-4
            name = f"clip{k:05d}.{fmt}"
            sf.write(os.path.join(root, name), np.clip(x, -1, 1).astype(np.float32), RATE)
            f.write(json.dumps({"audio_filepath": name, "duration": n / RATE, "text": f"clip {k}"}) + "\n")
    open(os.path.join(root, ".complete"), "w").close()
    return manifest


def gpuio_ops() -> list[Any]:
    return [ops.decode_audio(), ops.preemphasis_filter(), ops.nonsilent_region(), ops.slice(),
            ops.spectrogram(nfft=NFFT, window_length=WINDOW, window_step=STEP),
            ops.mel_filter_bank(sample_rate=RATE, nfilter=MELS),
            ops.to_decibels(multiplier=LOG_MULTIPLIER, reference=LOG_REFERENCE, cutoff_db=LOG_CUTOFF),
            ops.normalize_axes(axes=(1,)), ops.pad(axes=(1,), align=ALIGN)]


@contextlib.contextmanager
def flac_decoder(libsndfile: bool) -> Iterator[None]:
    """Inside, with ``libsndfile``: FLAC decoded by libsndfile, as where
    ``ops/_flac.c`` is not built (gpuio's figures before it)."""
    from gpuio.ops import audio as audio_ops

    with audio_ops.flac_by_libsndfile() if libsndfile else contextlib.nullcontext():
        yield


def gpuio_loader(manifest: str, batch: int, device: str, threads: int,
                 libsndfile: bool = False) -> Callable[[], Iterator[Any]]:
    index = gpuio.formats.manifest(manifest)
    loader = gpuio.Loader(index, batch, fields=["data", "duration", "offset"], ops=gpuio_ops(), device=device,
                          output="numpy", threads=threads)

    def run() -> Iterator[Any]:
        with flac_decoder(libsndfile):
            for b in loader:
                yield b["audio"]
        if device != "cpu":
            import cupy

            cupy.cuda.get_current_stream().synchronize()

    return run


def dali_cpu(paths: list[str], batch: int, threads: int) -> Callable[[], Iterator[Any]]:
    from nvidia.dali import fn, pipeline_def

    # synchronous: a pipelined DALI would compute the next epoch while other competitors run
    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, exec_async=False, exec_pipelined=False)
    def pipe():
        data, _ = fn.readers.file(files=paths, name="reader")
        return dali_features(data)[0]

    p = pipe()
    p.build()
    steps = math.ceil(len(paths) / batch)

    def run() -> Iterator[Any]:
        for _ in range(steps):
            (out,) = p.run()
            yield out

    return run


def dali_features(data: Any) -> tuple[Any, Any, Any]:
    """DALI's operators for the pipeline on encoded clips: (features, begin, length)."""
    from nvidia.dali import fn, types

    audio, _ = fn.decoders.audio(data, downmix=True, dtype=types.FLOAT)
    audio = fn.preemphasis_filter(audio)
    begin, length = fn.nonsilent_region(audio)
    audio = fn.slice(audio, begin, length, axes=[0])
    spec = fn.spectrogram(audio, nfft=NFFT, window_length=WINDOW, window_step=STEP)
    mel = fn.mel_filter_bank(spec, sample_rate=RATE, nfilter=MELS)
    mel = fn.to_decibels(mel, multiplier=LOG_MULTIPLIER, reference=LOG_REFERENCE, cutoff_db=LOG_CUTOFF)
    mel = fn.normalize(mel, axes=[1])
    return fn.pad(mel, axes=[1], align=ALIGN), begin, length


def chain_agreement(encoded: list[np.ndarray]) -> dict[str, Any]:
    """The whole pipeline (decode to pad) from gpuio and DALI: on how many clips the
    nonsilent regions are equal (both add the window powers in float32 in the same order,
    so they should be on all), and the largest difference of the normalized features
    of those."""
    from nvidia.dali import fn, pipeline_def

    from gpuio.batch import Batch, sample_seeds

    index = np.arange(len(encoded))
    batch = Batch({"data": list(encoded)}, index, sample_seeds(0, 0, index))
    for op in gpuio_ops():
        batch = op(batch)

    @pipeline_def(batch_size=len(encoded), num_threads=1, device_id=None)
    def pipe():
        return dali_features(fn.external_source(source=lambda: encoded, batch=True))

    p = pipe()
    p.build()
    feats, begin, length = p.run()
    same = [int(np.array(begin[i])) == b and int(np.array(length[i])) == n for i, (b, n) in
            enumerate(zip(batch.data["begin"].tolist(), batch.data["length"].tolist()))]
    errors = [float(np.abs(ours[:, : np.array(feats[i]).shape[1]] - np.array(feats[i])).max())
              for i, ours in enumerate(batch.data["audio"]) if same[i]]
    return {"case": "whole pipeline (decode to pad), normalized features", "vs_dali_abs": max(errors, default=0.0),
            "note": f"nonsilent region equal to DALI's on {same.count(True)} of {len(same)} clips "
                    f"(others left out)"}


def numpy_features(x: np.ndarray) -> np.ndarray:
    """The pipeline for one clip with NumPy and scipy.fft (the DataLoader competitor)."""
    import scipy.fft

    from gpuio.ops.spectral import hann_window, mel_filters

    y = np.empty_like(x)
    y[0] = x[0] * (1 - 0.97)
    y[1:] = x[1:] - 0.97 * x[:-1]
    c = np.concatenate([[0.0], np.cumsum(y.astype(np.float64) ** 2)])
    i = np.arange(len(y))
    power = (c[i + 1] - c[np.maximum(i - 2047, 0)]) / 2048
    loud = np.nonzero(power >= power.max() * 1e-6)[0]
    begin = max(loud[0] - 2047, 0)
    y = y[begin: loud[-1] + 1]
    padded = np.pad(y, (WINDOW // 2, WINDOW - WINDOW // 2), mode="reflect")
    n = len(y) // STEP + 1
    frames = np.lib.stride_tricks.as_strided(padded, (n, WINDOW), (STEP * 4, 4)) * hann_window(WINDOW)
    spec = np.abs(scipy.fft.rfft(frames, n=NFFT, axis=1)) ** 2
    mel = spec @ mel_filters(RATE, NFFT, MELS, 0, RATE / 2, "slaney", True).T.astype(np.float32)
    mel = LOG_MULTIPLIER * np.log10(np.maximum(mel / LOG_REFERENCE, 10 ** (LOG_CUTOFF / LOG_MULTIPLIER)))
    mel = (mel - mel.mean(axis=0)) / np.maximum(mel.std(axis=0), 1e-12)
    return np.ascontiguousarray(mel.T, dtype=np.float32)


class SoundfileDataset:
    """Reads a clip with soundfile; ``features`` turns it into the pipeline's output."""

    def __init__(self, paths: list[str], features: Callable[[np.ndarray], Any] | None) -> None:
        self.paths, self.features = paths, features

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        import soundfile as sf

        x, _ = sf.read(self.paths[i], dtype="float32")
        return self.features(x) if self.features is not None else x


def _pad_collate(rows: list[np.ndarray]) -> tuple[Any, Any]:
    import torch

    longest = -(-max(r.shape[-1] for r in rows) // ALIGN) * ALIGN
    out = np.zeros((len(rows), *rows[0].shape[:-1], longest), dtype=np.float32)
    for k, r in enumerate(rows):
        out[k, ..., : r.shape[-1]] = r
    return torch.from_numpy(out), torch.tensor([r.shape[-1] for r in rows])


def torch_dataloader(paths: list[str], batch: int, workers: int) -> Callable[[], Iterator[Any]]:
    import torch

    loader = torch.utils.data.DataLoader(SoundfileDataset(paths, numpy_features), batch_size=batch,
                                         num_workers=workers, collate_fn=_pad_collate,
                                         persistent_workers=workers > 0)

    def run() -> Iterator[Any]:
        for feats, _ in loader:
            yield feats

    return run


def torchaudio_gpu(paths: list[str], batch: int, workers: int) -> Callable[[], Iterator[Any]]:
    import torch
    import torchaudio

    loader = torch.utils.data.DataLoader(SoundfileDataset(paths, None), batch_size=batch, num_workers=workers,
                                         collate_fn=_pad_collate, persistent_workers=workers > 0)
    mel = torchaudio.transforms.MelSpectrogram(RATE, n_fft=NFFT, win_length=WINDOW, hop_length=STEP,
                                               n_mels=MELS, norm="slaney", mel_scale="slaney").cuda()

    def run() -> Iterator[Any]:
        for audio, lengths in loader:
            x = audio.cuda(non_blocking=True)
            x = torch.cat([x[:, :1] * (1 - 0.97), x[:, 1:] - 0.97 * x[:, :-1]], dim=1)
            m = torch.log(mel(x).clamp_min(1e-20))
            frames = (lengths.cuda() // STEP + 1)[:, None, None]
            valid = torch.arange(m.shape[-1], device="cuda")[None, None, :] < frames
            mean = (m * valid).sum(-1, keepdim=True) / frames
            std = (((m - mean) * valid) ** 2).sum(-1, keepdim=True).div(frames).sqrt()
            yield ((m - mean) / std.clamp_min(1e-12)) * valid
        torch.cuda.synchronize()

    return run


AGREEMENT_CASES = [(512, 320, 160, 64, "slaney"), (512, 400, 160, 80, "htk"), (1024, 1024, 256, 128, "slaney")]


def agreement(paths: list[str]) -> list[dict[str, Any]]:
    """Mel spectrograms (decode -> spectrogram -> mel_filter_bank) of ``paths`` from
    gpuio, DALI's CPU operators and (when installed) librosa given DALI's Hann window:
    per parameter set, the largest error relative to each clip's largest value."""
    from nvidia.dali import fn, pipeline_def

    from gpuio.batch import Batch, sample_seeds
    from gpuio.ops.spectral import hann_window

    encoded = [np.fromfile(p, dtype=np.uint8) for p in paths]
    rows = []
    for nfft, window, step, mels, formula in AGREEMENT_CASES:
        index = np.arange(len(encoded))
        batch = Batch({"data": list(encoded)}, index, sample_seeds(0, 0, index))
        for op in (ops.decode_audio(), ops.spectrogram(nfft=nfft, window_length=window, window_step=step),
                   ops.mel_filter_bank(sample_rate=RATE, nfilter=mels, mel_formula=formula)):
            batch = op(batch)

        @pipeline_def(batch_size=len(encoded), num_threads=1, device_id=None)
        def pipe():
            data = fn.external_source(source=lambda: encoded, batch=True)
            audio, _ = fn.decoders.audio(data, downmix=True)
            spec = fn.spectrogram(audio, nfft=nfft, window_length=window, window_step=step)
            return fn.mel_filter_bank(spec, sample_rate=RATE, nfilter=mels, mel_formula=formula)

        p = pipe()
        p.build()
        (dali,) = p.run()
        row = {"case": f"nfft {nfft}, window {window}, step {step}, {mels} mels, {formula}",
               "vs_dali": max(float(np.abs(ours - np.array(dali[i])).max() / np.abs(ours).max())
                              for i, ours in enumerate(batch.data["audio"]))}
        try:
            import librosa
            import soundfile as sf
        except ImportError:
            row["note"] = "librosa not installed"
        else:
            row["vs_librosa"] = max(float(np.abs(ours - ref).max() / np.abs(ours).max()) for ours, ref in (
                (ours, librosa.feature.melspectrogram(
                    y=sf.read(path, dtype="float32")[0], sr=RATE, n_fft=nfft, hop_length=step, win_length=window,
                    window=hann_window(window), n_mels=mels, htk=formula == "htk", norm="slaney"))
                for ours, path in zip(batch.data["audio"], paths)))
        rows.append(row)
    rows.append(chain_agreement(encoded))
    return rows


def decode_times(paths: list[str], batch: int, rounds: int) -> list[dict[str, Any]]:
    """CPU ms to decode one batch (the first ``batch`` clips, bytes in memory, float32
    mono out, one thread, ``time.process_time``, best of ``rounds`` interleaved):
    gpuio's ``decode_audio`` (FLAC through ``ops/_flac.c``), the same op with
    libsndfile decoding (as where the extension is not built), and DALI's
    ``decoders.audio`` on the CPU."""
    from gpuio.batch import Batch, sample_seeds

    encoded = [np.fromfile(p, dtype=np.uint8) for p in paths[:batch]]
    index = np.arange(len(encoded))
    decode = ops.decode_audio()

    def gpuio_decode(libsndfile: bool) -> Callable[[], Any]:
        def run() -> Any:
            with flac_decoder(libsndfile):
                return decode(Batch({"data": list(encoded)}, index, sample_seeds(0, 0, index)))
        return run

    runs: dict[str, Callable[[], Any]] = {"gpuio decode_audio": gpuio_decode(False),
                                         "gpuio decode_audio, libsndfile": gpuio_decode(True)}
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        pass
    else:
        @pipeline_def(batch_size=len(encoded), num_threads=1, device_id=None, exec_async=False,
                      exec_pipelined=False)
        def pipe():
            data = fn.external_source(source=lambda: encoded, batch=True)
            return fn.decoders.audio(data, downmix=True, dtype=types.FLOAT)[0]

        dali = pipe()
        dali.build()
        runs["dali decoders.audio"] = dali.run
    best = {name: math.inf for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            c0 = time.process_time()
            run()
            best[name] = min(best[name], time.process_time() - c0)
    mine = best["gpuio decode_audio"]
    return [{"competitor": name, "cpu_ms_per_batch": 1000 * t, "gpuio_cpu_ratio": t / mine}
            for name, t in best.items()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=256, help="clips in the sample dataset")
    parser.add_argument("--format", default="flac", choices=["flac", "wav"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best counts")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--agreement", action="store_true",
                        help="instead: compare mel spectrograms with DALI's and librosa's (16 clips)")
    parser.add_argument("--decode", action="store_true",
                        help="instead: CPU ms to decode one batch, gpuio vs libsndfile vs DALI (one thread)")
    parser.add_argument("--tonal", action="store_true",
                        help="clips of tones over faint noise (LPC-coded in FLAC) instead of noise bursts")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    manifest = make_dataset(args.count, args.format, tonal=args.tonal)
    index = gpuio.formats.manifest(manifest)
    paths = list(index.files)
    if args.agreement:
        rows = agreement(paths[:16])
        print_table(rows, [("case", "parameters", ""), ("vs_dali", "max rel. error vs DALI", ".1e"),
                           ("vs_dali_abs", "max abs. error vs DALI", ".1e"), ("vs_librosa", "vs librosa", ".1e"),
                           ("note", "note", "")])
        write_json(args.out, {"machine": machine(), "agreement": rows})
        return {"agreement": rows}
    if args.decode:
        rows = decode_times(paths, args.batch, args.rounds)
        print(f"decode one batch of {args.batch} {args.format} clips, one thread, best of {args.rounds}")
        print_table(rows, [("competitor", "competitor", ""), ("cpu_ms_per_batch", "cpu ms/batch", ".1f"),
                           ("gpuio_cpu_ratio", "gpuio x (cpu)", ".2f")])
        write_json(args.out, {"machine": machine(), "decode": rows})
        return {"decode": rows}
    seconds = float(index.values["duration"].sum())
    competitors: dict[str, Callable[[], Callable[[], Iterator[Any]]]] = {
        "gpuio cpu": lambda: gpuio_loader(manifest, args.batch, "cpu", args.threads),
        "dali cpu": lambda: dali_cpu(paths, args.batch, args.threads),
        "torch DataLoader + numpy": lambda: torch_dataloader(paths, args.batch, args.threads),
    }
    if args.format == "flac":
        competitors["gpuio cpu, libsndfile flac"] = lambda: gpuio_loader(manifest, args.batch, "cpu", args.threads,
                                                                        libsndfile=True)
    if gpuio.cuda_available():
        competitors["gpuio gpu"] = lambda: gpuio_loader(manifest, args.batch, "cuda", args.threads)
        competitors["torchaudio gpu"] = lambda: torchaudio_gpu(paths, args.batch, args.threads)
    runs, missing = {}, {}
    for name, build in competitors.items():
        try:
            runs[name] = build()
            for _ in runs[name]():  # warm-up epoch: workers, plans, page cache
                pass
        except ImportError as exc:
            missing[name] = f"not installed ({exc.name or exc})"
            runs.pop(name, None)
    best = {name: math.inf for name in runs}
    cpu = {name: math.inf for name in runs}  # this process's CPU seconds (threads, not worker processes)
    for _ in range(args.rounds):
        for name, run in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in run():
                pass
            best[name] = min(best[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    rows = []
    for name in competitors:
        if name in missing:
            rows.append({"competitor": name, "note": missing[name]})
            continue
        t = best[name]
        row = {"competitor": name, "samples_per_s": args.count / t, "audio_s_per_s": seconds / t, "epoch_s": t}
        if "DataLoader" not in name and "torchaudio" not in name:  # their work is in worker processes
            row["cpu_ms_per_sample"] = 1000 * cpu[name] / args.count
        rows.append(row)
    for kind in ("cpu", "gpu"):
        mine = best.get(f"gpuio {kind}")
        for r in rows:
            if mine and r.get("epoch_s") and not r["competitor"].startswith("gpuio") and \
                    (kind == "gpu") == r["competitor"].endswith("gpu"):
                r["gpuio_ratio"] = r["epoch_s"] / mine
                if r.get("cpu_ms_per_sample") and kind == "cpu":
                    r["gpuio_cpu_ratio"] = r["cpu_ms_per_sample"] / (1000 * cpu[f"gpuio {kind}"] / args.count)
    info = machine()
    print(f"machine: {info['cpu']} ({info['cores']} cores), gpus: {info['gpus']}")
    print(f"dataset: {args.count} {args.format} clips, {seconds:.0f} s of audio at {RATE} Hz, batch {args.batch}, "
          f"best of {args.rounds} interleaved rounds")
    print_table(rows, [("competitor", "competitor", ""), ("samples_per_s", "samples/s", ".1f"),
                       ("audio_s_per_s", "audio s/s", ".0f"), ("gpuio_ratio", "gpuio x", ".2f"),
                       ("cpu_ms_per_sample", "cpu ms/sample", ".2f"), ("gpuio_cpu_ratio", "gpuio x (cpu)", ".2f"),
                       ("note", "note", "")])
    payload = {"machine": info, "count": args.count, "format": args.format, "batch": args.batch,
               "audio_seconds": seconds, "rounds": args.rounds, "rows": rows}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
