"""A loader's timeline as Chrome Trace Event JSON (Perfetto, chrome://tracing).

A ``Tracer`` is attached to a loader's ``PipelineStats`` (``gpuio.pipeline._stats``),
which forwards each call to it, until the consumer has taken ``batches`` batches or
the pass ends; ``write()`` then saves the file. What it holds:

- a track per thread (``tid`` = the thread's native id, named by a ``thread_name``
  metadata event): each stage worker's spans (ph ``X``, one per batch it worked on),
  the consumer's wait in ``next()``, and the parts of ``ops._cpu_pool`` on the pool's
  threads. A thread works on one thing at a time, so its spans never overlap; a pass
  run on the consumer's thread (``inline``) has its stages' spans inside the wait;
- a track per CUDA stream (one per GPU stage): the stage's device time from its
  events, placed at the later of when it was queued and when the stream's previous
  span ended (the events give durations, not clock times);
- counter tracks (ph ``C``): each stage's input queue length at every take, and the
  bytes in flight by where they lie;
- flow arrows (ph ``s``/``t``/``f``, ``id`` = the batch's sequence number) from the
  end of the batch's read span through the end of each stage's span to the end of the
  consumer's wait that took it.

With the ``nvtx`` package importable and a GPU in use, the same stage spans and waits
are also NVTX ranges in the ``gpuio`` domain (pushed when a span begins, popped when it
ends, on its thread), for Nsight Systems.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from typing import Any

__all__ = ["Tracer"]

_US = 1e6


class Tracer:
    """Collects the events of one capture (see the module docstring); ``first`` names
    the stage a batch's flow starts at (the loader's ``read``). While capturing it keeps
    tuples of raw clock readings; ``write()`` turns them into trace events."""

    def __init__(self, path: str | os.PathLike[str], batches: int, *, nvtx: bool = False,
                 first: str = "read") -> None:
        self.path = os.fspath(path)
        self.batches = batches
        self.taken = 0  # batches the consumer took during the capture
        self.first = first
        self._origin = time.perf_counter()
        self._pid = os.getpid()
        # (tid, name, cat, t0, t1, batch or None, flow phase or None) per span; (name, t, values) per counter
        self._spans: list[tuple[int, str, str, float, float, int | None, str | None]] = []
        self._counters: list[tuple[str, float, dict[str, int]]] = []
        self._threads: dict[int, str] = {}  # track -> its name
        self._streams: dict[str, tuple[int, float]] = {}  # GPU stage -> (its track, where its last span ends)
        self._lock = threading.Lock()
        self._nvtx = _nvtx() if nvtx else None
        self.on_part = _weakly(self.part)  # for ops._cpu_pool.watch_parts: holds the tracer weakly

    @property
    def done(self) -> bool:
        return self.taken >= self.batches

    def _tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self._threads:
            with self._lock:  # write() copies the names under it
                self._threads[tid] = threading.current_thread().name
        return tid

    # ---- PipelineStats forwards these ----------------------------------------------------
    def started(self, name: str) -> None:
        """A span of ``name`` begins on this thread (an NVTX range, where on)."""
        if self._nvtx is not None:
            self._nvtx.push_range(name, domain="gpuio")

    def span(self, name: str, seq: int, t0: float, t1: float) -> None:
        """Stage ``name`` worked on batch ``seq`` from ``t0`` to ``t1`` on this thread."""
        if self._nvtx is not None:
            self._nvtx.pop_range(domain="gpuio")
        self._spans.append((self._tid(), name, "stage", t0, t1, seq, "s" if name == self.first else "t"))

    def gpu_span(self, name: str, seq: int, queued: float, seconds: float) -> None:
        """Stage ``name``'s device time for batch ``seq`` on its stream (queued at ``queued``)."""
        with self._lock:
            tid, free = self._streams.get(name, (None, 0.0))
            if tid is None:
                tid = -(len(self._streams) + 1)  # no thread has a negative id
                self._threads[tid] = f"CUDA stream of {name}"
            t0 = max(queued, free)
            self._streams[name] = (tid, t0 + seconds)
        self._spans.append((tid, name, "gpu", t0, t0 + seconds, seq, None))

    def consumer(self, seq: int, t0: float, t1: float) -> None:
        """The consumer waited in ``next()`` from ``t0`` to ``t1`` and got batch ``seq``."""
        if self._nvtx is not None:
            self._nvtx.pop_range(domain="gpuio")
        self._spans.append((self._tid(), "next", "consumer", t0, t1, seq, "f"))
        self.taken += 1

    def part(self, name: str, t0: float, t1: float) -> None:
        """A part of an op ran on a thread of ``ops._cpu_pool`` (this one); none are kept
        once the capture has its batches."""
        if not self.done:
            self._spans.append((self._tid(), name, "part", t0, t1, None, None))

    def counter(self, name: str, values: dict[str, int]) -> None:
        self._counters.append((name, time.perf_counter(), dict(values)))

    # ---- the file ------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        """The capture as Chrome trace events."""
        pid = self._pid

        def us(t: float) -> float:
            return round((t - self._origin) * _US, 3)

        with self._lock:
            threads = dict(self._threads)
        out: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "gpuio"}}]
        out += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
                for tid, name in threads.items()]
        for tid, name, cat, t0, t1, seq, flow in list(self._spans):
            ts, end = us(t0), us(t1)
            out.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts,
                        "dur": max(0.0, round(end - ts, 3)), "args": {} if seq is None else {"batch": seq}})
            if flow is not None:  # just inside the span's end (see the module docstring)
                point = {"ph": flow, "name": "batch", "cat": "batch", "id": seq, "pid": pid, "tid": tid,
                         "ts": round(max(ts, end - 0.001), 3)}
                if flow == "f":
                    point["bp"] = "e"  # binds to the span enclosing it, as "s" and "t" do
                out.append(point)
        out += [{"ph": "C", "name": name, "pid": pid, "ts": us(t), "args": values}
                for name, t, values in list(self._counters)]
        return out

    def write(self) -> str:
        """Save the events as ``{"traceEvents": [...]}`` at ``path``; returns the path."""
        text = json.dumps({"traceEvents": self.events(), "displayTimeUnit": "ms"})
        with open(self.path, "w") as f:  # one write (json.dump writes piece by piece)
            f.write(text)
        return self.path


def _weakly(method: Any) -> Any:
    """``method`` (bound), called through a weak reference to its object: a no-op once
    the object is gone."""
    ref, func = weakref.ref(method.__self__), method.__func__

    def call(*args: Any) -> None:
        obj = ref()
        if obj is not None:
            func(obj, *args)

    return call


def _nvtx() -> Any:
    """The ``nvtx`` module, or None where it is not installed."""
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx
