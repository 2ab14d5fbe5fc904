"""Packaging, import hygiene, settings and device detection."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import gpuio
from gpuio import config
from gpuio.device import Device, parse_device, require
from gpuio.errors import ConfigError, DependencyError, GpuioError

REPO = Path(__file__).resolve().parents[1]
CUDA_MODULES = ("cupy", "kvikio", "nvidia", "torch", "cuda", "PyNvVideoCodec")


def test_import_loads_no_cuda_library():
    code = ("import sys, gpuio, gpuio.formats, gpuio.ops\n"
            f"bad = [m for m in sys.modules if m.split('.')[0] in {CUDA_MODULES!r}]\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_formats_and_ops_import_as_gpuio_subpackages():
    import gpuio.formats
    import gpuio.ops

    assert Path(gpuio.formats.__file__).parent == REPO / "formats"
    assert Path(gpuio.ops.__file__).parent == REPO / "ops"
    assert gpuio.ops is gpuio.__getattr__("ops")


def test_help_shows_formats_and_ops():
    import pydoc

    text = pydoc.render_doc(gpuio, renderer=pydoc.plaintext)
    submodules = text[text.index("SUBMODULES"):].split("\n\n")[0].split()
    assert {"formats", "ops"} <= set(submodules)


def _package_roots() -> dict[str, Path]:
    """Each import package of the distribution and its folder, as pyproject.toml maps them."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = project["package-dir"]
    roots = {}
    for package in project["packages"]:
        parent = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        roots[package] = REPO / dirs[parent] / Path(*package[len(parent):].split(".")[1:])
    return roots


def _gpuio_modules() -> dict[str, Path]:
    """Every Python module of the gpuio package, by dotted name, as installed (formats/, ops/,
    bench/ and the sub-packages too)."""
    modules = {}
    for package, root in _package_roots().items():
        for path in root.glob("*.py"):
            modules[".".join((package, path.stem)).removesuffix(".__init__")] = path
    return modules


def _compiled_modules() -> set[str]:
    """The C extensions pyproject.toml builds (they import no gpuio module)."""
    import tomllib

    return {m["name"] for m in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
            ["ext-modules"]}


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The gpuio modules a module imports anywhere in it (functions too), except under
    ``if TYPE_CHECKING:``. ``from a import b`` is an import of ``a.b`` when that is a module."""
    found: set[str] = set()
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known}


def test_no_import_cycles_among_gpuio_modules():
    modules = _gpuio_modules()
    compiled = _compiled_modules()
    known = set(modules) | compiled
    graph = {m: _imports(ast.parse(p.read_text()), m, p.name == "__init__.py", known) - {m}
             for m, p in modules.items()}
    graph.update({c: set() for c in compiled})
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert {"gpuio.index", "gpuio.storage.reader", "gpuio.pipeline.loader", "gpuio.cli", "gpuio.formats.tfrecord",
            "gpuio.bench.images", "gpuio.ops._jpeg", "gpuio.storage._readloop"} <= known


def _private_uses(tree: ast.AST, module: str, modules: set[str]) -> list[str]:
    """Where ``module`` takes a private name (``_x``) out of another module: ``from m import
    _x`` of anything but a private module, or ``m._x`` on a module it imported."""
    imported: dict[str, str] = {}  # local name -> module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    imported[a.asname or a.name] = full
                elif a.name.startswith("_") and node.module != module:
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in modules:
                    imported[a.asname] = a.name
    own = _defined_private_names(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        base = node.value.id if isinstance(node.value, ast.Name) else None
        if base in imported and imported[base] != module:  # another module's private name
            found.append(f"line {node.lineno}: {base}.{node.attr}")
        elif base not in imported and base not in ("self", "cls") and node.attr not in own \
                and node.attr not in _PUBLIC_BY_CONVENTION:  # another class's private attribute
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


# underscore names that are public API of the standard library's objects
_PUBLIC_BY_CONVENTION = {"_exit", "_fields", "_asdict", "_replace", "_make", "_field_defaults", "_getframe"}


def _defined_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines itself: functions, classes, assignments
    (``_x = ...``, ``self._x = ...``) and ``__slots__`` entries."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
            names.add(node.value)  # __slots__ entries, setattr names
    return {n for n in names if n.startswith("_")}


def test_no_module_takes_another_module_s_private_names():
    """A module may import a private module of the package (``gpuio.storage._posix``), but
    never a private name out of another module (``from gpuio.ops.decode import _bytes``,
    ``decode._jpeg``): what is shared has a public name in its one home."""
    modules = _gpuio_modules()
    known = set(modules) | _compiled_modules()
    found = {name: uses for name, path in sorted(modules.items())
             if (uses := _private_uses(ast.parse(path.read_text()), name, known))}
    assert not found, "private names taken from other modules: " + "; ".join(
        f"{name} ({', '.join(uses)})" for name, uses in found.items())


@pytest.mark.slow
def test_built_wheel_installs_formats_and_ops(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("gpuio-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "gpuio/formats/__init__.py" in names and "gpuio/ops/__init__.py" in names
    assert not any(n.startswith(("formats/", "ops/", "tests/", "bench/")) for n in names)
    assert {"gpuio/ops/_jpeg.pyi", "gpuio/storage/_readloop.pyi"} <= set(names)  # the C modules' stubs ship
    # A fresh venv that sees this environment's packages (numpy, simplejpeg ...) through a
    # .pth file, whichever interpreter runs the tests (a venv's or the system's): the
    # venv's own site-packages, holding only the installed wheel, comes first.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if os.path.isdir(p) and Path(p).name in ("site-packages", "dist-packages")]
    Path(site, "outer-env.pth").write_text("\n".join(ours) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", site,
                    str(wheel)], check=True, capture_output=True)
    code = "import gpuio.formats, gpuio.ops, gpuio; print(gpuio.formats.__file__)"
    out = subprocess.run([str(py), "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(site)


def test_config_defaults_env_and_override(monkeypatch):
    assert config.get("io_threads") >= 16
    monkeypatch.setenv("GPUIO_IO_THREADS", "40")
    monkeypatch.setenv("GPUIO_BUFFER_BUDGET", "2GiB")
    monkeypatch.setenv("GPUIO_O_DIRECT", "yes")
    assert config.get("io_threads") == 40
    assert config.get("buffer_budget") == 2 << 30
    assert config.get("o_direct") is True
    with config.override(io_threads=8, backend="POSIX"):
        assert config.get("io_threads") == 8
        assert config.get("backend") == "posix"
        with config.override(io_threads=9):
            assert config.get("io_threads") == 9
        assert config.get("io_threads") == 8
    assert config.get("io_threads") == 40
    assert set(config.settings()) == set(config.DEFAULTS)


def test_read_parts_also_reads_its_former_environment_variable(monkeypatch):
    monkeypatch.delenv("GPUIO_READ_PARTS", raising=False)
    monkeypatch.setenv("GPUIO_READ_STREAMS", "7")
    assert config.get("read_parts") == 7
    monkeypatch.setenv("GPUIO_READ_PARTS", "5")
    assert config.get("read_parts") == 5  # the current name wins over the former one
    monkeypatch.delenv("GPUIO_READ_PARTS")
    monkeypatch.setenv("GPUIO_READ_STREAMS", "many")
    with pytest.raises(ConfigError, match="GPUIO_READ_STREAMS='many'"):
        config.get("read_parts")
    with pytest.raises(ConfigError, match="unknown setting 'read_streams'"):  # code uses the current name only
        with config.override(read_streams=2):
            pass


def test_config_errors_name_the_setting(monkeypatch):
    with pytest.raises(ConfigError, match="unknown setting 'io_thread'.*io_threads"):
        config.get("io_thread")
    with pytest.raises(ConfigError, match="choose one of auto, posix, kvikio"):
        with config.override(backend="nvme"):
            pass
    with pytest.raises(ConfigError, match="non-negative integer"):
        with config.override(io_threads=-1):
            pass
    monkeypatch.setenv("GPUIO_IO_THREADS", "many")
    with pytest.raises(ConfigError, match="GPUIO_IO_THREADS='many'"):
        config.get("io_threads")


def test_device_parsing_and_missing_extra():
    assert parse_device("cpu") == Device("cpu")
    assert parse_device("cuda") == Device("cuda", 0)
    assert str(parse_device("CUDA:3")) == "cuda:3"
    with pytest.raises(ConfigError, match="'gpu'"):
        parse_device("gpu")
    if importlib.util.find_spec("PyNvVideoCodec") is None:
        with pytest.raises(DependencyError, match=r"pip install 'gpuio\[video\]'"):
            require("PyNvVideoCodec")
    assert issubclass(DependencyError, GpuioError) and issubclass(DependencyError, ImportError)


def test_gpu_count_matches_device_nodes():
    nodes = [p for p in os.listdir("/dev") if p.startswith("nvidia") and p[6:].isdigit()]
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert gpuio.gpu_count() == len(nodes)


def _public_modules() -> list[str]:
    import pkgutil

    import gpuio.formats
    import gpuio.ops

    names = ["gpuio", "gpuio.formats", "gpuio.ops"]
    for package in (gpuio, gpuio.formats, gpuio.ops):
        names += [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)
                  if not m.name.startswith("_") and f"{package.__name__}.{m.name}" not in names]
    return names


def test_every_public_function_class_and_method_has_a_docstring():
    import inspect

    missing, seen = [], set()
    for module_name in _public_modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if id(obj) in seen or not (inspect.isclass(obj) or inspect.isfunction(obj)) \
                    or not obj.__module__.startswith("gpuio"):
                continue
            seen.add(id(obj))
            if not inspect.getdoc(obj):
                missing.append(f"{module_name}.{name}")
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if attr.startswith("_") and attr != "__call__":
                        continue
                    fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                    if inspect.isfunction(fn) and not inspect.getdoc(getattr(obj, attr)):
                        missing.append(f"{module_name}.{name}.{attr}")
    assert not missing, f"no docstring: {missing}"
