"""The gpuio command and the storage benchmark run end to end on tiny datasets."""

from __future__ import annotations

import json

import gpuio
from gpuio._bench import storage
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
    for method in ("gpuio", "naive loop", "np.fromfile", "sequential (ceiling)",
                   "gpuio cpu (Loader + ops.Compose)", "torch DataLoader + Pillow"):
        assert method in text
    images = json.loads((tmp_path / "r-images.json").read_text())["results"]
    assert all(r["images_s"] > 0 for r in images if r["name"].startswith(("gpuio", "torch")))
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["cache"], r["method"]) for r in rows} >= {("warm", "gpuio"), ("cold", "gpuio")}
    assert all(r["GB/s"] > 0 for r in rows)


def test_bench_on_a_missing_path_is_a_gpuio_error(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "nope"), "--repeat", "1"]) == 1
    assert "not a directory" in capsys.readouterr().err


def test_storage_bench_covers_three_datasets(tmp_path):
    result = storage.run(str(tmp_path), size="tiny", batch=16, repeat=1, caches=("warm",))
    datasets = {r["dataset"] for r in result["rows"]}
    assert datasets == {"small files", "large files", "packed records"}
    gpuio_rows = [r for r in result["rows"] if r["method"] == "gpuio"]
    assert len(gpuio_rows) == 3 and all(r["seconds"] > 0 for r in gpuio_rows)
