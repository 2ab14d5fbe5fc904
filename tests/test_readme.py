"""Every Python example in README.md runs, on the CPU, against small datasets written here.

The test changes only what needs a GPU or the user's data, nothing else: ``device="cuda"``
becomes ``"cpu"`` and the ``/data/...`` paths become datasets made in ``tmp_path`` with real
encoders. The blocks run in order in one namespace, as a reader goes down the page. The
"Coming from DALI" section's DALI blocks are DALI's code, shown for comparison: DALI is not
a test dependency, so they are left out (each is followed by a gpuio block that runs).
"""

from __future__ import annotations

import re
from pathlib import Path

import av
import numpy as np
import pytest
import simplejpeg

import gpuio

README = Path(__file__).resolve().parents[1] / "README.md"
DALI = "from nvidia.dali"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def on_the_cpu(code: str, data: dict[str, Path]) -> str:
    code = code.replace('device="cuda"', 'device="cpu"')
    for path, local in data.items():
        code = code.replace(f'"{path}"', repr(str(local)))
    return code


def jpeg_tree(root: Path, count: int = 16) -> Path:
    rng = np.random.default_rng(0)
    for i in range(count):
        (root / f"class_{i % 2}").mkdir(parents=True, exist_ok=True)
        img = rng.integers(0, 256, (int(rng.integers(24, 40)), int(rng.integers(24, 40)), 3), dtype=np.uint8)
        (root / f"class_{i % 2}" / f"{i:03d}.jpg").write_bytes(simplejpeg.encode_jpeg(img, quality=90))
    return root


def video_tree(root: Path, frames: int = 80) -> Path:
    for c in range(2):
        (root / f"class_{c}").mkdir(parents=True, exist_ok=True)
        with av.open(str(root / f"class_{c}" / "clip.mp4"), "w") as out:
            stream = out.add_stream("libx264", rate=30)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            for i in range(frames):
                img = np.full((48, 64, 3), (i * 6 + c * 100) % 256, dtype=np.uint8)
                out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
            out.mux(stream.encode())
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("readme")
    return {"/data/imagenet/train": jpeg_tree(tmp / "imagenet" / "train"), "/data/videos": video_tree(tmp / "videos")}


@pytest.mark.slow
def test_every_python_example_in_the_readme_runs(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # index.save("train.idx") writes here
    blocks = [b for b in python_blocks() if DALI not in b]
    assert len(blocks) >= 5 and len(python_blocks()) - len(blocks) == 2
    namespace: dict = {}
    for k, block in enumerate(blocks):
        code = on_the_cpu(block, data)
        assert "/data/" not in code, f"README block {k} reads a path the test does not make"
        exec(compile(code, f"README.md python block {k}", "exec"), namespace)
    # the last values each example left behind are what its comments say
    assert (tmp_path / "train.idx").exists()
    assert tuple(namespace["frames"].shape) == (8, 16, 48, 64, 3) and str(namespace["frames"].dtype) == "torch.uint8"


def test_the_readme_lists_every_setting():
    text = README.read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `(GPUIO_\w+)` \|", text, flags=re.M))
    assert set(rows) == set(gpuio.config.DEFAULTS)
    assert all(env == f"GPUIO_{name.upper()}" for name, env in rows.items())
