"""GPU code checked on a machine without a GPU (marker ``offline_gpu``; these run in CI
and never skip: a missing nvcc or an unreachable package index fails them).

- Every CUDA source compiles with nvcc for sm_80 and sm_90 with no warning, no spill
  and no stack frame (a stack frame means per-thread arrays left registers).
- The GPU wheels (kvikio, nvImageCodec, CuPy, PyNvVideoCodec; CUDA 13 and 12 builds)
  are installed once into a cached virtual environment beside the test environment,
  not into it, and ``tests/gpu_contract.py`` checks there every module, attribute,
  enum member and keyword gpuio's source uses, and runs the GPU code that needs no
  driver (see that file).
- ``backend="auto"`` and ``"kvikio"`` against a kvikio that is installed but cannot load.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpuio.ops._kernels import OPTIONS, SOURCE

pytestmark = pytest.mark.offline_gpu

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_80", "sm_90")

# pinned so that a new release changes this file (and the cache key) visibly
WHEELS = {
    "cu13": ["cupy-cuda13x==14.2.0", "cuda-pathfinder==1.9.0", "kvikio-cu13==26.10.0", "libkvikio-cu13==26.10.0",
             "rapids-logger==0.3.0", "nvidia-cufile==1.20.0.107", "nvidia-nvimgcodec-cu13==0.9.0.20",
             "pynvvideocodec==2.2.4"],
    "cu12": ["cupy-cuda12x==13.6.0", "fastrlock==0.8.3", "cuda-pathfinder==1.9.0", "kvikio-cu12==26.10.0",
             "libkvikio-cu12==26.10.0", "rapids-logger==0.3.0", "nvidia-cufile-cu12==1.14.1.1",
             "nvidia-nvimgcodec-cu12==0.9.0.20", "pynvvideocodec==2.2.4"],
}


def _cuda_sources() -> list[tuple[str, str, tuple[str, ...]]]:
    """(name, source, nvcc options) of every CUDA source: the kernels gpuio compiles at
    run time, one per build variant, and any ``.cu`` file in the project."""
    out = [(f"ops._kernels[{dtype}]", SOURCE, options) for dtype, options in OPTIONS.items()]
    for top in ("gpuio", "ops", "formats", "bench"):
        out += [(str(p.relative_to(ROOT)), p.read_text(), ()) for p in sorted((ROOT / top).rglob("*.cu"))]
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name,source,options", _cuda_sources(), ids=lambda v: v if isinstance(v, str) and
                         len(v) < 40 else "")
def test_cuda_source_compiles_clean(tmp_path, arch, name, source, options):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        pytest.fail("nvcc is not on PATH (CUDA 13.0's nvcc is expected here and on CI)")
    src = tmp_path / "kernel.cu"
    src.write_text(source)
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings",
           "-Xptxas", "-v,--warn-on-spills,--warn-on-local-memory-usage,--warning-as-error", *options,
           "-o", str(tmp_path / "kernel.cubin"), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} for {arch}:\n{log}"
    assert "warning" not in log.lower(), f"{name} for {arch}:\n{log}"
    frames = [int(n) for n in re.findall(r"(\d+) bytes stack frame", log)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert frames and spills, f"no ptxas report for {name}:\n{log}"
    assert frames == [0] * len(frames) and spills == [0] * len(spills), \
        f"{name} for {arch} keeps a stack frame or spills (arrays indexed at run time?):\n{log}"


def _venv(flavor: str) -> Path:
    """A virtual environment with the ``flavor`` GPU wheels (and the test environment's
    packages through ``--system-site-packages``), made once and kept in the cache."""
    pins = WHEELS[flavor]
    key = hashlib.sha1(" ".join([sys.version, *pins]).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("GPUIO_CONTRACT_DIR", Path.home() / ".cache" / "gpuio-contract"))
    target = cache / f"{flavor}-{key}"
    python = target / "bin" / "python"
    if (target / "complete").exists():
        return python
    building = cache / f"{flavor}-{key}.{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    t0 = time.monotonic()
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(building)],
             # the test environment's pip, run by the new environment's python, installs there
             [str(building / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-compile",
              "--disable-pip-version-check", "--quiet", "--only-binary=:all:", *pins]]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            pytest.fail(f"installing the {flavor} GPU wheels failed (package index unreachable?):\n"
                        f"{' '.join(cmd)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    for stale in cache.glob(f"{flavor}-*"):  # earlier pins' environments
        if stale != building:
            shutil.rmtree(stale, ignore_errors=True)
    building.rename(target)  # venv scripts name their folder; bin/python itself does not
    (target / "complete").write_text(f"{time.monotonic() - t0:.1f} s to install {' '.join(pins)}\n")
    return python


@pytest.mark.parametrize("flavor", list(WHEELS))
def test_gpu_wheels_have_what_gpuio_uses(flavor):
    # GPUIO_CONTRACT_PYTHON: an interpreter that already has the GPU packages (a GPU host,
    # which cannot reach a package index); then both flavors check what it has
    given = os.environ.get("GPUIO_CONTRACT_PYTHON")
    python = given or _venv(flavor)
    env = {k: v for k, v in os.environ.items() if given or k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    done = subprocess.run([str(python), str(ROOT / "tests" / "gpu_contract.py")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"the contract check crashed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    report = json.loads(lines[-1])
    assert report["problems"] == [], f"{flavor} ({report['versions']}):\n" + "\n".join(report["problems"])
    assert report["checked"] >= 30  # the scan found gpuio's uses
    assert report["ran"] == ["kvikio", "decode params", "region streams", "device arrays", "gpuio info"]


# Files that still pick CuPy's current stream outside ``with cp.cuda.Device(...)``
# (issue 9, defect 9); each must still have such a call, so that the list only shrinks.
STREAM_BEFORE_DEVICE: set[str] = set()


def _streams_outside_device(path: Path) -> list[int]:
    """Lines calling ``<cupy>.cuda.get_current_stream()`` outside a ``with`` block that
    enters ``<cupy>.cuda.Device(...)``. The current stream is per device: picked outside,
    it is device 0's (CuPy then refuses it on another device, or, worse, it is used)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def enters_device(node: ast.AST) -> bool:
        return isinstance(node, ast.With) and any(
            isinstance(item.context_expr, ast.Call) and ast.unparse(item.context_expr.func).endswith("cuda.Device")
            for item in node.items)

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("cuda.get_current_stream"):
            up = parents.get(node)
            while up is not None and not enters_device(up):
                up = parents.get(up)
            if up is None:
                bad.append(node.lineno)
    return bad


def test_current_stream_is_picked_inside_the_device():
    found = {}
    for top in ("gpuio", "ops", "formats"):
        for path in sorted((ROOT / top).rglob("*.py")):
            lines = _streams_outside_device(path)
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    new = {f: lines for f, lines in found.items() if f not in STREAM_BEFORE_DEVICE}
    assert not new, f"CuPy's current stream picked outside `with cp.cuda.Device(...)` (file: lines): {new}"
    fixed = STREAM_BEFORE_DEVICE - set(found)
    assert not fixed, f"{sorted(fixed)} no longer pick the stream outside the device: take them off the list"


# A kvikio that is installed but cannot load, failing the ways 26.10 does: cuda.pathfinder
# raises when libcufile is missing; without cuda.pathfinder, ctypes cannot load libkvikio.so.
FAKE_KVIKIO = {
    "libcufile": ('raise RuntimeError(\'Failure finding "libcufile.so.0": No such file: libcufile.so.0\')',
                  "nvidia-cufile"),
    "libkvikio": ('raise OSError("libkvikio.so: cannot open shared object file: No such file or directory")',
                  "libkvikio-cu13"),
}


@pytest.mark.parametrize("missing", list(FAKE_KVIKIO))
def test_kvikio_that_cannot_load(tmp_path, missing):
    body, package = FAKE_KVIKIO[missing]
    (tmp_path / "kvikio").mkdir()
    (tmp_path / "kvikio" / "__init__.py").write_text(body + "\n")
    script = textwrap.dedent(f"""
        import gpuio.device, pytest
        from gpuio.errors import DependencyError
        from gpuio import cli
        from gpuio.storage import Reader
        from gpuio._kvikio import KvikioBackend

        gpuio.device.gpu_count = lambda: 1  # as on a GPU machine: the backend choice is under test
        reader = Reader("cuda", backend="auto")
        assert reader.backend.name == "posix" and {missing!r} in reader.fallback, reader.fallback
        assert {package!r} in reader.fallback, reader.fallback
        for make in (lambda: Reader("cuda", backend="kvikio"), KvikioBackend):
            with pytest.raises(DependencyError, match={missing!r}) as err:
                make()
            assert {package!r} in str(err.value)
        cli.main(["info"])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.strip().startswith("kvikio"))
    assert "cannot be loaded" in line and missing in line and package in line, line
