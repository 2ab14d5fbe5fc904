"""GPU code checked on a machine without a GPU (marker ``offline_gpu``; these run in CI
and never skip: a missing nvcc or an unreachable package index fails them).

- Every CUDA source compiles with nvcc for sm_80 and sm_90 with no warning, no spill
  and no stack frame (a stack frame means per-thread arrays left registers).
- The GPU wheels (kvikio, nvImageCodec, CuPy, PyNvVideoCodec; CUDA 13 and 12 builds,
  pinned in ``tests/gpu_wheels.txt``) are installed once into a cached virtual
  environment that sees the test environment's packages (``tests/contract_env.py``),
  and ``tests/gpu_contract.py`` checks there, against a stub libcuda, every module,
  attribute, enum member and keyword gpuio's source uses and the protocols of the
  objects it converts, and runs the GPU code that needs no driver (see that file).
- ``bench/gpu_wheels.sh`` fetches those pins for a GPU host.
- ``backend="auto"`` and ``"kvikio"`` against a kvikio that is installed but cannot load.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import contract_env
from test_device_lint import DEVICE_CONTEXTS
from gpuio.ops._kernels import OPTIONS, SOURCE

pytestmark = pytest.mark.offline_gpu

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_80", "sm_90")

WHEELS = contract_env.wheels()  # tests/gpu_wheels.txt: the pins, shared with bench/gpu_wheels.sh

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


def _stub_driver(folder: Path) -> Path:
    """``tests/libcuda_stub.c`` built as ``libcuda.so.1`` and ``libnvidia-encode.so.1`` in
    ``folder``: with it on LD_LIBRARY_PATH the driver-linked extensions load."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is not on PATH (the wheel contract builds a stub libcuda.so.1 with it)")
    lib = folder / "libcuda.so.1"
    done = subprocess.run([gcc, "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(lib),
                           str(ROOT / "tests" / "libcuda_stub.c")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.copy(lib, folder / "libnvidia-encode.so.1")
    return folder


def _contract(python: Path | str, env: dict[str, str]) -> dict:
    done = subprocess.run([str(python), str(ROOT / "tests" / "gpu_contract.py")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"the contract check crashed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return json.loads(lines[-1])


# the NVENC version the stub driver reports: PyNvVideoCodec then loads its NVENC 13.0 module
# for cu13 and its 12.1 module for cu12, so that both are checked
NVENC = {"cu13": "13.0", "cu12": "12.1"}


@pytest.mark.parametrize("flavor", list(WHEELS))
def test_gpu_wheels_have_what_gpuio_uses(flavor, tmp_path):
    # GPUIO_CONTRACT_PYTHON: an interpreter that already has the GPU packages (a GPU host,
    # which cannot reach a package index, with its real driver); then both flavors check what it has
    given = os.environ.get("GPUIO_CONTRACT_PYTHON")
    if given:
        report = _contract(given, dict(os.environ))
    else:
        try:
            python = contract_env.ensure(flavor)
        except contract_env.ContractEnvError as exc:
            pytest.fail(str(exc))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
        stub = str(_stub_driver(tmp_path))
        env.update(LD_LIBRARY_PATH=os.pathsep.join([stub, *filter(None, [env.get("LD_LIBRARY_PATH")])]),
                   GPUIO_STUB_NVENC=NVENC[flavor])
        report = _contract(python, env)
    assert report["problems"] == [], f"{flavor} ({report['versions']}):\n" + "\n".join(report["problems"])
    assert report["checked"] >= 30  # the scan found gpuio's uses
    assert report["conversions"] >= 2  # the decoders' frames and images gpuio converts
    assert report["ran"] == ["driver-linked imports", "kvikio", "decode params", "region streams", "cpu decode",
                             "device arrays", "gpuio info"]


def test_contract_env_serves_a_virtual_environment(tmp_path):
    """From a virtual environment that has gpuio only in its own site-packages (its base
    interpreter has none here), the contract environment imports this checkout's gpuio:
    ``venv --system-site-packages`` would expose the base interpreter's packages instead."""
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(outer)], check=True, timeout=120)
    py = str(outer / "bin" / "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True,
                             capture_output=True, text=True).stdout.strip()
    adds = "; ".join(f"site.addsitedir({d!r})" for d in contract_env.site_dirs())
    Path(purelib, "test-env.pth").write_text(f"import site; {adds}\n")
    probe = "import gpuio, gpuio.ops, gpuio.formats; print(gpuio.__file__, gpuio.ops.__file__, gpuio.formats.__file__)"
    made = subprocess.run([py, str(ROOT / "tests" / "contract_env.py"), "cu13", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=1800)
    assert made.returncode == 0, made.stdout + made.stderr
    python = made.stdout.strip().splitlines()[-1]
    done = subprocess.run([python, "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    files = [Path(f) for f in done.stdout.split()]
    assert files and all(f.is_relative_to(ROOT) for f in files), (files, ROOT)
    made_for = json.loads((Path(python).parents[1] / "complete").read_text())
    assert made_for["prefix"] == str(outer) and made_for["checkout"] == str(ROOT), made_for


def test_gpu_host_gets_the_contract_pins():
    """bench/gpu_wheels.sh fetches for a GPU host exactly the cu13 versions the contract
    checks (all but those the host has), and nothing else the contract pins, unpinned."""
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_wheels.sh"), "--list"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    fetched = [line.split()[1] for line in done.stdout.splitlines()]
    host = [line.split()[1] for line in contract_env.PINS.read_text().splitlines()
            if line.split()[:1] == ["cu13"] and line.split()[2:3] == ["host"]]
    assert host and sorted(r for r in fetched if "==" in r) == sorted(set(WHEELS["cu13"]) - set(host)), fetched
    pinned = {r.split("==")[0] for flavor in WHEELS.values() for r in flavor}
    assert not [r for r in fetched if "==" not in r and r in pinned], fetched


# Files that still pick CuPy's current stream outside ``with cp.cuda.Device(...)`` (the
# stream of whichever GPU the thread last entered); each must still have such a call, so
# that the list only shrinks.
STREAM_BEFORE_DEVICE: set[str] = set()


def _streams_outside_device(path: Path) -> list[int]:
    """Lines calling ``<cupy>.cuda.get_current_stream()`` outside a ``with`` block that
    enters ``<cupy>.cuda.Device(...)`` (directly, or through a function of the module that
    returns one), unless every call of the function around it, in the module, is inside
    such a block. The current stream is per device: picked outside, it is device 0's (CuPy
    then refuses it on another device, or, worse, it is used)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def is_device(call: ast.AST) -> bool:  # also ``<batch>.on_device()``
        return isinstance(call, ast.Call) and (ast.unparse(call.func).endswith("cuda.Device") or (
            isinstance(call.func, ast.Attribute) and call.func.attr in DEVICE_CONTEXTS))

    # functions that return a device: ``with self._on_device():`` enters it as well
    gives_device = {f.name for f in functions
                    if any(isinstance(n, ast.Return) and is_device(n.value) for n in ast.walk(f))}

    def enters_device(node: ast.AST) -> bool:
        return isinstance(node, ast.With) and any(
            is_device(item.context_expr) or (isinstance(item.context_expr, ast.Call) and
                                             _called_name(item.context_expr) in gives_device)
            for item in node.items)

    def inside_device(node: ast.AST, seen: frozenset = frozenset()) -> bool:
        up = parents.get(node)
        while up is not None and not enters_device(up):
            if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):  # held by every caller?
                calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and _called_name(c) == up.name]
                return bool(calls) and up.name not in seen and all(inside_device(c, seen | {up.name}) for c in calls)
            up = parents.get(up)
        return up is not None

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("cuda.get_current_stream") and not inside_device(node)]


def _called_name(call: ast.Call) -> str | None:
    """``f`` for ``f(...)``, ``self.f(...)`` and ``obj.f(...)``."""
    return call.func.id if isinstance(call.func, ast.Name) else \
        call.func.attr if isinstance(call.func, ast.Attribute) else None


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
        from gpuio.storage._kvikio import KvikioBackend

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
