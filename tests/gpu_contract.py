"""What gpuio uses of CuPy, kvikio, nvImageCodec and PyNvVideoCodec, checked against the
installed packages on a machine without a GPU (run by tests/test_offline_gpu.py in the
environment of ``tests/contract_env.py``, with the stub driver of ``tests/libcuda_stub.c``
on LD_LIBRARY_PATH, so that the extensions linked against libcuda load; every driver call
fails there, as with no GPU). It checks the gpuio of this checkout, and says so otherwise.

``python tests/gpu_contract.py`` prints a JSON report: ``problems`` (each a line that
names the use and what is missing), ``checked`` (how many uses were resolved) and
``conversions`` (how many conversions of the libraries' objects were checked).

The uses come from gpuio's source (``scan``): every attribute chain and call rooted at
the names gpuio gives these modules (``cp``/``cupy``, ``kvikio``, ``nvimgcodec``,
``nvc``), the keyword arguments of those calls (and whether the library marks them
deprecated), and the modules gpuio imports (``require("...")``,
``import_module("...")``), so that a new use is checked without editing this file.
Methods called on objects the libraries return are not visible to the scan; they are
listed in ``METHODS``. The objects the decoders hand back are checked for the array
protocol of the call that converts them (``CONVERSIONS``). Then the parts of gpuio's GPU
code that need no driver run for real: kvikio loading and configuration, cuFile open
errors, ``gpuio info``, the nvImageCodec decode parameters and region code streams, a
decode of real JPEGs on nvImageCodec's CPU backend with gpuio's calls, and the CuPy
arrays gpuio builds on raw pointers.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("gpuio", "ops", "formats")
# the names gpuio's code gives these modules -> the module
ALIASES = {"cp": "cupy", "cupy": "cupy", "kvikio": "kvikio", "nvimgcodec": "nvidia.nvimgcodec",
           "nvc": "PyNvVideoCodec"}
# methods of objects the libraries return (the scan only sees module attributes):
# "module.Class.method" -> keywords gpuio passes
METHODS = {
    "nvidia.nvimgcodec.Decoder.decode": ("params", "cuda_stream"),
    "nvidia.nvimgcodec.CodeStream.get_sub_code_stream": ("region",),
    "nvidia.nvimgcodec.CodeStream.height": (),
    "nvidia.nvimgcodec.CodeStream.width": (),
    "kvikio.CuFile.pread": (),
    "kvikio.CuFile.close": (),
    "cupy.ndarray.set": ("stream",),
    "cupy.cuda.Stream.wait_event": (),
    "cupy.cuda.Stream.record": (),
    "cupy.cuda.Stream.synchronize": (),
    "cupy.cuda.Event.record": (),
    "cupy.cuda.Event.synchronize": (),
    "cupy.cuda.Event.done": (),
    "cupy.cuda.MemoryPointer.copy_to_host_async": (),
}


# Every place gpuio converts an object a GPU library hands back, as (file, function,
# variable) -> the object's class. ``check_conversions`` finds each conversion call on that
# variable (there, or in a function of the same file it is passed to) and checks that the
# class has the protocol the call reads; and every device
# conversion (CuPy, torch) of a variable in a file that uses a decoder library must be
# listed here or in ``HOST_ARRAYS``, so that a new conversion site is not missed.
CONVERSIONS = {
    ("ops/video.py", "_decode_clip_nvdec.keep", "picture"): "PyNvVideoCodec.DecodedFrame",  # NVDEC's frames
    ("ops/decode.py", "decode_gpu", "img"): "nvidia.nvimgcodec.Image",  # nvImageCodec's images
}
# device conversions in those files whose variable holds a NumPy array (decoded on the CPU)
HOST_ARRAYS = {("ops/decode.py", "upload", "img")}
DECODERS = ("nvc", "nvimgcodec")  # the names gpuio gives the decoder libraries
_BUFFER = "buffer protocol"
# what a converting call reads, as alternatives of protocols all needed. CuPy's asarray takes
# __cuda_array_interface__ (or CuPy's own hook) and sends anything else through numpy.array,
# which makes an object array of a device object: it never reads __dlpack__.
_CUPY_TAKES = [("__cuda_array_interface__",), ("__cupy_get_ndarray__",)]
_DLPACK = [("__dlpack__", "__dlpack_device__")]
_NUMPY_TAKES = [("__array_interface__",), ("__array__",), (_BUFFER,)]
READS = {("cupy", "asarray"): _CUPY_TAKES, ("cupy", "array"): _CUPY_TAKES,
         ("cupy", "ascontiguousarray"): _CUPY_TAKES, ("numpy", "asarray"): _NUMPY_TAKES,
         ("numpy", "array"): _NUMPY_TAKES, ("numpy", "ascontiguousarray"): _NUMPY_TAKES,
         ("numpy", "frombuffer"): [(_BUFFER,)], ("torch", "as_tensor"): _CUPY_TAKES[:1] + _NUMPY_TAKES,
         ("", "memoryview"): [(_BUFFER,)], ("*", "from_dlpack"): _DLPACK,
         ("", "_cuda_view"): _CUPY_TAKES[:1]}  # ops/decode.py: the interface's pointer, wrapped with no wait
_ROOTS = {"cp": "cupy", "cupy": "cupy", "np": "numpy", "numpy": "numpy", "torch": "torch"}


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """``("cupy", ["cuda", "Stream"])`` for ``cp.cuda.Stream``; None if not rooted at an alias."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in ALIASES and parts:
        return ALIASES[node.id], parts[::-1]
    return None


def scan(root: Path = ROOT) -> dict[str, Any]:
    """Uses in gpuio's source: ``{"modules": [...], "uses": [{"module", "attrs", "keywords", "where"}]}``."""
    modules: set[str] = set()
    uses: dict[tuple[str, str], dict[str, Any]] = {}
    for top in SOURCES:
        for path in sorted((root / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            inner: set[int] = set()  # attribute nodes inside a longer chain
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                    fn = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                    if fn in ("require", "import_module") and node.args and isinstance(node.args[0], ast.Constant) \
                            and str(node.args[0].value).split(".")[0] in {m.split(".")[0] for m in ALIASES.values()}:
                        modules.add(str(node.args[0].value))
                if isinstance(node, ast.Attribute):
                    inner.add(id(node.value))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Attribute) or id(node) in inner:
                    continue
                found = _chain(node)
                if found is None:
                    continue
                key = (found[0], ".".join(found[1]))
                use = uses.setdefault(key, {"module": found[0], "attrs": found[1], "keywords": set(),
                                            "where": f"{path.relative_to(root)}:{node.lineno}"})
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    found = _chain(node.func)
                    if found is not None:
                        use = uses[(found[0], ".".join(found[1]))]
                        use["keywords"].update(k.arg for k in node.keywords if k.arg is not None)
    return {"modules": sorted(modules),
            "uses": [dict(u, keywords=sorted(u["keywords"])) for u in uses.values()]}


def _parameters(obj: Any) -> set[str] | None:
    """Parameter names of a callable: from its signature, else from the signatures and
    ``Args:`` sections in its docstrings (Cython and pybind11 objects); None if unknown."""
    try:
        params = inspect.signature(obj).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
                return None
            # ``**kwargs`` takes any name: the ones its docstring documents (cupy.ElementwiseKernel's
            # options=), else any
            documented = _documented(obj)
            return {p.name for p in params if p.kind is not p.VAR_KEYWORD} | documented if documented else {"**"}
        return {p.name for p in params}
    except (TypeError, ValueError):
        pass
    return _documented(obj) or None


def _documented(obj: Any) -> set[str]:
    """The parameter names in ``obj``'s docstrings: their signatures and ``Args:`` sections."""
    docs = [getattr(obj, "__doc__", None) or ""]
    if inspect.isclass(obj):
        docs.append(getattr(obj.__init__, "__doc__", None) or "")
    names: set[str] = set()
    for doc in docs:
        for params in re.findall(r"^\s*(?:\d+\.\s*)?[\w.]+\((.*)\)", doc, re.M):
            names.update(re.findall(r"(?:^|,)\s*\*{0,2}(\w+)\s*(?=[:=,]|$)", params))
        section = re.search(r"Args:\n((?:\s+.*\n?)+)", doc)
        if section:
            names.update(re.findall(r"^\s+(\w+) \(", section.group(1), re.M))
    return names - {"self", "kwargs"}


def _resolve(module: Any, attrs: list[str]) -> Any:
    obj = module
    for a in attrs:
        obj = getattr(obj, a)
    return obj


def check_uses(report: dict[str, Any]) -> None:
    found = scan()
    loaded = {}
    for name in sorted(set(ALIASES.values()) | set(found["modules"])):
        try:
            loaded[name] = importlib.import_module(name)
        except Exception as exc:  # any import failure is a finding to report
            report["problems"].append(f"import {name}: {type(exc).__name__}: {exc}")
    uses = found["uses"] + [{"module": m, "attrs": a, "keywords": list(kw), "where": "tests/gpu_contract.py METHODS"}
                            for key, kw in METHODS.items()
                            for m, a in [_split(key)]]
    for use in uses:
        module = loaded.get(use["module"])
        if module is None:
            continue
        name = f"{use['module']}.{'.'.join(use['attrs'])} ({use['where']})"
        try:
            obj = _resolve(module, use["attrs"])
        except AttributeError as exc:
            report["problems"].append(f"{name}: {exc}")
            continue
        report["checked"] += 1
        doc = (getattr(obj, "__doc__", None) or "").split("Args:")[0]
        if ".. deprecated::" in doc:  # e.g. cupy.cuda.ExternalStream in CuPy 14
            report["problems"].append(f"{name}: deprecated: {doc.split('.. deprecated::')[1].strip()[:200]}")
        if use["keywords"]:
            params = _parameters(obj)
            if params is None:
                report["problems"].append(f"{name}: cannot read its parameters to check {use['keywords']}")
            elif "**" not in params:
                missing = [k for k in use["keywords"] if k not in params]
                if missing:
                    report["problems"].append(f"{name}: no keyword {missing}; it takes {sorted(params)}")


def _own_nodes(fn: ast.AST) -> list[ast.AST]:
    """The nodes of a function's body, less those of the functions defined inside it."""
    inner = {id(n) for f in ast.walk(fn) if f is not fn and isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    return [n for n in ast.walk(fn) if id(n) not in inner]


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, Any]]:
    """Every function under ``tree`` with its qualified name (``outer.inner``, ``Class.method``)."""
    out = []
    for node in ast.iter_child_nodes(tree):
        defines = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        name = f"{prefix}{node.name}" if defines else None
        if name and not isinstance(node, ast.ClassDef):
            out.append((name, node))
        out += _functions(node, f"{name}." if name else prefix)
    return out


def _conversions(root: Path = ROOT) -> tuple[list[dict[str, Any]], dict[tuple[str, str], Any]]:
    """The calls that convert a variable (their first argument) into an array, with the
    file, the innermost function around them and what they read; and the functions, as
    (file, function name) -> (definition, its own nodes)."""
    found, functions = [], {}
    for top in SOURCES:
        for path in sorted((root / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            rel = str(path.relative_to(root))
            decoders = any(isinstance(n, ast.Name) and n.id in DECODERS for n in ast.walk(tree))
            for qualname, fn in _functions(tree):
                nodes = _own_nodes(fn)
                functions[rel, qualname] = (fn, nodes)
                for node in nodes:
                    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Name):
                        continue
                    if isinstance(node.func, ast.Name):
                        module, name = "", node.func.id
                    elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
                        module, name = _ROOTS.get(node.func.value.id, "?"), node.func.attr
                    else:
                        continue
                    reads = READS.get((module, name)) or (READS["*", name] if name == "from_dlpack" else None)
                    if reads is not None:  # from_dlpack of an array module passed in (xp) counts as a device one
                        found.append({"where": f"{rel}:{node.lineno}", "call": ast.unparse(node), "reads": reads,
                                      "site": (rel, qualname, node.args[0].id), "decoders": decoders,
                                      "device": module in ("cupy", "torch") or name == "from_dlpack"})
    return found, functions


def _reached(site: tuple[str, str, str], calls: list[dict[str, Any]], functions: dict, depth: int = 0) -> list:
    """The conversion calls that take the variable of ``site``: in its function, and in
    the functions of the same file it is passed to (a helper that converts it)."""
    path, fn, var = site
    out = [c for c in calls if c["site"] == site]
    for node in functions[path, fn][1] if (path, fn) in functions and depth < 3 else []:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        # the function the name means: one defined in this function or an enclosing one, or at the top
        scopes = [fn.rsplit(".", k)[0] + "." for k in range(fn.count(".") + 1)] + [""]  # innermost first
        callee = next((scope + node.func.id for scope in scopes if (path, scope + node.func.id) in functions), None)
        if callee is None:
            continue
        definition = functions[path, callee][0]
        params = [a.arg for a in definition.args.posonlyargs + definition.args.args]
        for i, arg in enumerate(node.args):
            if isinstance(arg, ast.Name) and arg.id == var and i < len(params):
                out += _reached((path, callee, params[i]), calls, functions, depth + 1)
    return out


def _has_buffer(cls: type) -> bool:
    """Whether instances of ``cls`` export the buffer protocol (a C-level slot)."""
    if sys.version_info >= (3, 12):
        return hasattr(cls, "__buffer__")
    import ctypes

    offset = 20 * ctypes.sizeof(ctypes.c_void_p)  # PyTypeObject.tp_as_buffer, Python 3.8 to 3.11

    def slot(t: type) -> int | None:
        return ctypes.c_void_p.from_address(id(t) + offset).value

    if not slot(bytes) or slot(int):
        raise RuntimeError("cannot read tp_as_buffer on this Python: the type layout is not the one assumed")
    return bool(slot(cls))


def check_conversions(report: dict[str, Any]) -> None:
    """Each listed conversion reads a protocol its object's class has; no device
    conversion in a decoder file is unlisted."""
    calls, functions = _conversions()
    reached = {site: _reached(site, calls, functions) for site in CONVERSIONS}
    listed = {c["site"] for found in reached.values() for c in found} | set(CONVERSIONS) | HOST_ARRAYS
    for call in calls:
        if call["device"] and call["decoders"] and call["site"] not in listed:
            report["problems"].append(f"{call['where']} {call['call']}: converts {call['site'][2]!r} in a file that "
                                      "uses a decoder library; list its class in tests/gpu_contract.py CONVERSIONS "
                                      "(or HOST_ARRAYS if it is a NumPy array)")
    for site, qualname in CONVERSIONS.items():
        module_name, cls_name = qualname.rsplit(".", 1)
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError, RuntimeError) as exc:
            report["problems"].append(f"{qualname} (converted in {site[0]}): {type(exc).__name__}: {exc}")
            continue
        has = {p for p in ("__cuda_array_interface__", "__cupy_get_ndarray__", "__dlpack__", "__dlpack_device__",
                           "__array_interface__", "__array__") if hasattr(cls, p)} | ({_BUFFER} if _has_buffer(cls)
                                                                                        else set())
        here = reached[site]
        if not here:
            report["problems"].append(f"{site[0]}: no conversion of {site[2]!r} in {site[1]}() any more; "
                                      "update tests/gpu_contract.py CONVERSIONS")
        for call in here:
            report["conversions"] += 1
            if not any(set(need) <= has for need in call["reads"]):
                report["problems"].append(
                    f"{call['where']} {call['call']}: reads {' or '.join('+'.join(n) for n in call['reads'])}, "
                    f"but {qualname} has {', '.join(sorted(has)) or 'no array protocol'}"
                    + ("; convert it with from_dlpack" if set(_DLPACK[0]) <= has else ""))


def _split(key: str) -> tuple[str, list[str]]:
    """``"nvidia.nvimgcodec.Decoder.decode"`` -> ``("nvidia.nvimgcodec", ["Decoder", "decode"])``."""
    for module in sorted(set(ALIASES.values()), key=len, reverse=True):
        if key.startswith(module + "."):
            return module, key[len(module) + 1:].split(".")
    raise ValueError(key)


def run_gpuio(report: dict[str, Any]) -> None:
    """Run the parts of gpuio's GPU code that need no driver."""
    steps = [("driver-linked imports", _import_extensions), ("kvikio", _kvikio), ("decode params", _decode_params),
             ("region streams", _region_streams), ("cpu decode", _cpu_decode), ("device arrays", _device_arrays),
             ("gpuio info", _info)]
    for name, step in steps:
        try:
            step()
            report["ran"].append(name)
        except Exception as exc:  # each failure is a finding to report
            report["problems"].append(f"running {name}: {type(exc).__name__}: {exc}")


# the packages whose extension modules link or load the CUDA driver, all imported
EXTENSION_PACKAGES = ("PyNvVideoCodec", "kvikio", "nvidia.nvimgcodec")


def _import_extensions() -> None:
    """Every extension module of those packages built for this interpreter loads (against
    the stub driver here), so that their classes are the real ones. PyNvVideoCodec's two
    NVENC builds register the same classes: its package loads the one for the driver's
    NVENC version (the test runs cu13 with 13.0 and cu12 with 12.1), the other is skipped."""
    import importlib.machinery

    suffixes = [s for s in importlib.machinery.EXTENSION_SUFFIXES if s != ".so"]  # .so alone: any Python's
    failed, loaded = [], 0
    for package in EXTENSION_PACKAGES:
        folder = Path(list(importlib.util.find_spec(package).submodule_search_locations)[0])
        for path in sorted(folder.rglob("*.so")):
            suffix = next((x for x in suffixes if path.name.endswith(x)), None)
            stem = path.name[:-len(suffix)] if suffix else ""
            if suffix is None or re.fullmatch(r"PyNvVideoCodec_\d+", stem):
                continue
            name = ".".join([package, *path.relative_to(folder).parent.parts, stem])
            try:
                importlib.import_module(name)
                loaded += 1
            except ImportError as exc:
                failed.append(f"{name}: {exc}")
    assert not failed, failed
    assert loaded >= 3, f"only {loaded} extension modules found in {EXTENSION_PACKAGES}"


def _kvikio() -> None:
    from gpuio.storage._kvikio import KvikioBackend, compat_mode_active, kvikio_problem
    from gpuio.errors import StorageError

    assert kvikio_problem() is None, kvikio_problem()
    import kvikio

    for compat in ("on", "auto"):  # AUTO: kvikio decides (compat where there is no GPU)
        backend = KvikioBackend(threads=3, task_size=1 << 20, compat=compat)
        assert backend.compat is compat_mode_active() and (backend.compat or compat == "auto"), compat
        assert kvikio.defaults.get("num_threads") == 3 and kvikio.defaults.get("task_size") == 1 << 20
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "data.bin")
            with open(path, "wb") as f:
                f.write(b"x" * 100)
            handle = backend._open(path)
            handle.close()
            try:
                backend._open(os.path.join(tmp, "missing.bin"))
            except StorageError as exc:
                assert "missing.bin" in str(exc), exc
            else:
                raise AssertionError("opening a missing file did not raise StorageError")
        backend.close()
    if not _driver():  # with a driver, kvikio would take the made-up address for host memory
        _failing_pread()


def _driver() -> bool:
    import cupy as cp

    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except cp.cuda.runtime.CUDARuntimeError:
        return False


def _failing_pread() -> None:
    """A pread that kvikio refuses (here: no libcuda) is a StorageError naming the file
    and offset, and the file handle goes back to the cache."""
    import cupy as cp
    import numpy as np

    from gpuio.storage._kvikio import KvikioBackend
    from gpuio.storage.buffers import BufferPool, Lease, _Storage
    from gpuio.device import Device
    from gpuio.errors import StorageError
    from gpuio.storage.plan import build_plan

    base = cp.ndarray((1 << 16,), cp.uint8, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(1 << 40, 1 << 16, None, 0), 0))
    storage = object.__new__(_Storage)  # a device buffer at a made-up address, never reached
    storage.__dict__.update(capacity=1 << 16, device=Device("cuda", 0), pinned=False, events=[], _gds=None, array=base)
    storage._record_release = lambda: None
    backend = KvikioBackend(threads=2, compat="on")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.bin")
        with open(path, "wb") as f:
            f.write(bytes(range(256)) * 64)
        plan = build_plan(np.zeros(1, np.int64), np.array([5000]), np.array([3000]))
        try:
            backend.read(plan, [path], Lease(BufferPool(1 << 20), storage, plan.nbytes))
        except StorageError as exc:
            assert exc.path == path and exc.offset == 5000, (exc.path, exc.offset)
        else:
            raise AssertionError("a failing pread did not raise StorageError")
        assert backend._handles._entries[path][1] == 0, "the file handle was not released"
    backend.close()


def _decode_params() -> None:
    from nvidia import nvimgcodec

    from gpuio.ops.decode import COLORS, _decode_params as make

    for color in COLORS:
        params = make(nvimgcodec, color)
        assert isinstance(params, nvimgcodec.DecodeParams), color


def _region_streams() -> None:
    """The region machinery of the GPU window decodes (``decode_image_slice``,
    ``DecodeFused``) on nvImageCodec's parser, which needs no GPU: the stored size, the
    sub code stream of a window, the whole image as itself, unparsable bytes as None."""
    import io

    import numpy as np
    from nvidia import nvimgcodec
    from PIL import Image

    from gpuio.ops.decode_slice import code_stream, region_source

    buf = io.BytesIO()
    Image.fromarray(np.zeros((70, 90, 3), np.uint8)).save(buf, "JPEG")
    data = np.frombuffer(buf.getvalue(), np.uint8)
    stream = code_stream(nvimgcodec, data)
    assert (stream.height, stream.width) == (70, 90), stream
    region = region_source(nvimgcodec, stream, (5, 10, 60, 31)).view.region
    assert (tuple(region.start), tuple(region.end)) == ((5, 10), (60, 31)), region
    assert region_source(nvimgcodec, stream, (0, 0, 70, 90)) is stream
    assert code_stream(nvimgcodec, data[:40]) is None and code_stream(nvimgcodec, data[:0]) is None


def _cpu_decode() -> None:
    """gpuio's nvImageCodec calls on the wheel's CPU backend, on real JPEGs (colour and
    grayscale): its decode parameters for each colour, the sources it passes (the bytes,
    a code stream, a region's sub code stream) and the keywords it passes; the images,
    shaped as ``decode_gpu`` shapes them, equal gpuio's CPU decoder's."""
    import io

    import numpy as np
    from nvidia import nvimgcodec
    from PIL import Image

    from gpuio.ops.decode import COLORS, _decode_params, decode_cpu
    from gpuio.ops.decode_slice import code_stream, region_source

    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.uint8)
    decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                 backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])
    for mode, pixels in (("RGB", rgb), ("L", rgb[:, :, 0])):
        buf = io.BytesIO()
        Image.fromarray(pixels, mode).save(buf, "JPEG", quality=95)
        data = np.frombuffer(buf.getvalue(), np.uint8)
        stream = code_stream(nvimgcodec, data)
        window = (8, 16, 40, 48)
        for color in COLORS:
            images = decoder.decode([data, stream, region_source(nvimgcodec, stream, window)],
                                    params=_decode_params(nvimgcodec, color), cuda_stream=0)
            whole = decode_cpu(data, color, 0)
            for img, want in zip(images, (whole, whole, whole[window[0]:window[2], window[1]:window[3]])):
                assert img is not None, (mode, color)
                arr = np.asarray(img)  # a host image; decode_gpu's steps after its conversion:
                if arr.ndim == 2:
                    arr = arr[:, :, None]
                if color == "rgb" and arr.shape[2] == 1:
                    arr = np.broadcast_to(arr, arr.shape[:2] + (3,))
                assert arr.dtype == want.dtype and arr.shape == want.shape, (mode, color, arr.shape, want.shape)
                diff = int(np.abs(arr.astype(np.int16) - want).max())
                assert diff <= 2, f"{mode} JPEG as {color}: differs from the CPU decode by up to {diff}"


def _device_arrays() -> None:
    """The CuPy arrays gpuio builds on pointers, over a made-up address (never read)."""
    import gc

    import cupy as cp

    from gpuio.storage import _deferred

    owner = object()
    base = cp.ndarray((4096,), cp.uint8, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(1 << 40, 4096, owner, 0), 0))
    view = base[256:].view(cp.float32).reshape(60, 16)[:, ::2]
    given = _deferred.hand_over(view, 1234, 0)
    assert given.shape == view.shape and given.strides == view.strides and given.data.ptr == view.data.ptr
    assert given.dtype == view.dtype and given.data.mem.size == 4096
    released = []
    _deferred.release_after = lambda streams, obj, device: released.append((streams, obj, device))
    part = given[1:3]  # a consumer's view keeps the memory: nothing is released yet
    del given
    gc.collect()
    assert released == [], released
    del part
    gc.collect()  # the consumer dropped all: the original goes to release_after, on its stream
    assert len(released) == 1 and released[0][0] == (1234,) and released[0][1] is view, released
    _lease_array(base)
    _decoded_images()


def _decoded_images() -> None:
    """``decode_gpu``'s view of a decoded image, over an interface as nvImageCodec's
    ``Image`` gives it (the stream it was decoded on; a made-up address, never read):
    the shape and strides it describes, the image kept alive by the array, and no wait
    for that stream (no driver call at all), where ``cupy.asarray`` synchronizes it."""
    import gc
    import weakref

    import cupy as cp

    from gpuio.ops.decode import _cuda_view

    class Decoded:
        def __init__(self, shape: tuple[int, ...], strides: tuple[int, ...] | None) -> None:
            self.__cuda_array_interface__ = {"shape": shape, "strides": strides, "typestr": "|u1",
                                             "data": (1 << 40, False), "version": 3, "stream": 1234}

    planar = (1024 * 60, 1024, 1)
    for shape, strides, nbytes in (((60, 16, 3), None, 2880), ((3, 60, 16), planar, 2 * 61440 + 59 * 1024 + 16)):
        img = Decoded(shape, strides)
        alive = weakref.ref(img)
        arr = _cuda_view(img, cp, 0)
        assert arr.shape == shape and arr.dtype == cp.uint8 and arr.data.ptr == 1 << 40, (arr.shape, arr.dtype)
        assert arr.strides == (strides or (48, 3, 1)) and arr.data.mem.size == nbytes, (arr.strides, arr.data.mem.size)
        del img
        gc.collect()
        assert alive() is not None, "the array does not keep the decoded image alive"
        del arr
        gc.collect()
        assert alive() is None, "the decoded image outlives its array"
    from cupy import _util

    # what cupy.asarray would do: cudaStreamSynchronize on the interface's stream unless
    # CUPY_CUDA_ARRAY_INTERFACE_SYNC=0 (CuPy's _convert_object_with_cuda_array_interface)
    assert _util.CUDA_ARRAY_INTERFACE_SYNC, "CuPy no longer waits for an interface's stream: _cuda_view may go"


def _lease_array(base: Any) -> None:
    """A device batch buffer's arrays keep the lease; when the last is gone, the release
    event is recorded first and only then the buffer goes back to the pool."""
    import gc

    from gpuio.storage.buffers import BufferPool, Lease, _Storage
    from gpuio.device import Device

    pool = BufferPool(1 << 20)
    storage = object.__new__(_Storage)  # a device buffer at a made-up address, never read
    storage.__dict__.update(capacity=4096, device=Device("cuda", 0), pinned=False, events=[], _gds=None, array=base)
    order = []

    def back() -> bool:  # a finalizer hands it to the pool's lock-free queue, drained into _free later
        return storage in pool._free or storage in pool._returned

    storage._record_release = lambda: order.append(("event", back()))
    lease = Lease(pool, storage, 1000)
    arr = lease.array
    assert arr.data.ptr == base.data.ptr and arr.nbytes == 1000 and arr.dtype == "uint8"
    part = arr[10:20]
    del lease, arr
    gc.collect()
    assert order == [] and not back(), order
    del part
    gc.collect()
    assert order == [("event", False)] and back(), order


def _info() -> None:
    import contextlib
    import io

    from gpuio import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["info"])
    line = next(x for x in out.getvalue().splitlines() if x.strip().startswith("kvikio"))
    assert "loads" in line and "compat" in line, line


def main() -> None:
    report: dict[str, Any] = {"problems": [], "checked": 0, "conversions": 0, "ran": [],
                              "python": sys.version.split()[0], "versions": {}}
    before = set(sys.modules)
    import gpuio

    if not Path(gpuio.__file__).resolve().is_relative_to(ROOT):  # the other checks would test that gpuio
        report["problems"].append(f"gpuio imports from {gpuio.__file__}, not from this checkout ({ROOT}): "
                                  f"install this checkout into the environment that runs the tests (pip install -e)")
        print(json.dumps(report))
        sys.stdout.flush()
        os._exit(0)

    cuda = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("cupy", "kvikio", "cupy_backends")
                  or m.startswith("nvidia"))
    if cuda:
        report["problems"].append(f"import gpuio imported CUDA libraries: {cuda[:5]}")
    check_uses(report)
    check_conversions(report)
    for name in ("cupy", "kvikio", "nvidia.nvimgcodec", "PyNvVideoCodec"):
        module = sys.modules.get(name)
        report["versions"][name] = getattr(module, "__version__", None)
    run_gpuio(report)
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # no finalizer may reach for a driver on the way out


if __name__ == "__main__":
    main()
