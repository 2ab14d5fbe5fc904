"""Helpers shared by the bench commands: machine description, timing, tables, JSON."""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import mmap
import os
import resource
import platform
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import gpuio
from gpuio.errors import GpuioError
from gpuio.sample import make_image_tree


class BenchError(GpuioError):
    """gpuio's own row of a benchmark failed: the run has no result to show."""


def cache_dir() -> str:
    """Where sample datasets go: ``GPUIO_CACHE_DIR`` or ``~/.cache/gpuio``."""
    path = gpuio.config.get("cache_dir") or os.path.join(os.path.expanduser("~"), ".cache", "gpuio")
    os.makedirs(path, exist_ok=True)
    return path


SAMPLE_COUNT = 2000


def sample_root(count: int = SAMPLE_COUNT, seed: int = 0) -> str:
    """The built-in sample dataset (ImageNet-like JPEGs) in the cache folder, generated
    on first use."""
    root = os.path.join(cache_dir(), f"sample-images-{count}-{seed}")
    if not os.path.exists(os.path.join(root, ".complete")):
        print(f"generating the sample dataset ({count} JPEGs) in {root}", file=sys.stderr)
        make_image_tree(root, count=count, seed=seed, progress=True)
        open(os.path.join(root, ".complete"), "w").close()
    return root


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "gpuio": gpuio.__version__,
        "gpus": gpuio.gpu_count(),
    }
    if gpuio.cuda_available():
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        info["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        info["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def drop_cache(paths: Sequence[str]) -> float:
    """Evict the files' pages from the page cache and return the fraction of their
    pages still resident afterwards (0.0 when the drop took). Dirty pages (a file just
    written) survive ``POSIX_FADV_DONTNEED``, so each file is flushed first."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_fraction(paths)


def resident_fraction(paths: Sequence[str]) -> float:
    """Fraction of the files' pages in the page cache, by ``mincore`` on a read-only
    mapping of each (mapping faults nothing in)."""
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        pages = (size + page - 1) // page
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else 0.0


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def best_time(fn: Callable[[], Any], repeat: int) -> float:
    """Fastest of ``repeat`` runs of ``fn`` in seconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def interleaved_rounds(runs: dict[str, Callable[[], Any]], epochs: int, count: int | None = None,
                       desc: str = "pipelines", rounds: dict[str, list[float]] | None = None,
                       settle: dict[str, float] | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """Items/s of each competitor's fastest pass, and the error of each that failed.
    ``runs`` maps a name to a function that makes one pass, yielding batches (``shape[0]``
    items each). One untimed pass each first (workers, decoders and caches warm up), then
    ``epochs`` rounds that run every competitor once, so that drift of the machine hits
    them alike. A pass that does not yield ``count`` items (when given) fails; a
    competitor that fails drops out with its whole error, the others go on. ``rounds``,
    where given, gets each competitor's items/s of every timed pass, in round order.
    ``settle`` maps a competitor to seconds of idle after each of its passes, so that work
    it does ahead after its pass (DALI's prefetch) is over before the next pass is timed."""
    from tqdm import tqdm

    best, seen = dict.fromkeys(runs, float("inf")), {}
    failed: dict[str, str] = {}
    with tqdm(total=(epochs + 1) * len(runs), desc=desc, unit="pass", leave=False) as bar:
        for timed in [False] + [True] * epochs:
            for name, run in runs.items():
                bar.update()
                if name in failed:
                    continue
                try:
                    t0 = time.perf_counter()
                    seen[name] = sum(int(batch.shape[0]) for batch in run())
                    elapsed = time.perf_counter() - t0
                    if count is not None and seen[name] != count:
                        raise RuntimeError(f"a pass yielded {seen[name]} items, expected {count}")
                except Exception as exc:  # a competitor's failure is a result to report, not a crash
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    continue
                time.sleep((settle or {}).get(name, 0.0))
                if timed:
                    best[name] = min(best[name], elapsed)
                    if rounds is not None:
                        rounds.setdefault(name, []).append(seen[name] / elapsed)
    return {name: seen[name] / t for name, t in best.items() if name not in failed}, failed


def print_table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> None:
    """``columns``: (key, heading, format spec)."""
    cells = [[format(r.get(k, ""), f) if r.get(k) is not None and r.get(k) != "" else "-"
              for k, _, f in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(columns)]
    print("  ".join(h.ljust(w) for (_, h, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> int:
    """Reset the peak-RSS counter (Linux ``clear_refs``) and return the RSS now, KiB.

    ``ru_maxrss`` alone would not do: it survives ``exec`` and so starts at the
    parent's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return _status_kib("VmRSS") or 0


def peak_rss() -> int:
    """Peak RSS since the last reset, KiB."""
    return _status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def streaming_module(name: str) -> types.ModuleType:
    """A module of mosaicml-streaming, imported without the package's ``__init__`` (its
    vision, text and dataloader modules import torchvision and transformers, which the
    writer and StreamingDataset do not need)."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None:
            raise ImportError("No module named 'streaming' (pip install --no-deps mosaicml-streaming)")
        root = spec.submodule_search_locations[0]
        for pkg, folder in (("streaming", root), ("streaming.base", os.path.join(root, "base"))):
            module = types.ModuleType(pkg)
            module.__path__ = [folder]
            sys.modules[pkg] = module
    return importlib.import_module(name)
