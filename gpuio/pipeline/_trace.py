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
from typing import Any

__all__ = ["Tracer"]

_US = 1e6


class Tracer:
    """Collects the events of one capture (see the module docstring); ``first`` names
    the stage a batch's flow starts at (the loader's ``read``)."""

    def __init__(self, path: str | os.PathLike[str], batches: int, *, nvtx: bool = False,
                 first: str = "read") -> None:
        self.path = os.fspath(path)
        self.batches = batches
        self.taken = 0  # batches the consumer took during the capture
        self.first = first
        self._origin = time.perf_counter()
        self._pid = os.getpid()
        self._events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": self._pid, "args": {"name": "gpuio"}}]
        self._named: set[int] = set()  # threads that have their name event
        self._streams: dict[str, tuple[int, float]] = {}  # GPU stage -> (its track, where its last span ends)
        self._lock = threading.Lock()
        self._nvtx = _nvtx() if nvtx else None

    @property
    def done(self) -> bool:
        return self.taken >= self.batches

    def _us(self, t: float) -> float:
        return round((t - self._origin) * _US, 3)

    def _tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self._named:
            self._named.add(tid)
            self._events.append({"ph": "M", "name": "thread_name", "pid": self._pid, "tid": tid,
                                 "args": {"name": threading.current_thread().name}})
        return tid

    def _span(self, name: str, tid: int, t0: float, t1: float, args: dict[str, Any], cat: str = "stage") -> None:
        ts = self._us(t0)
        self._events.append({"ph": "X", "name": name, "cat": cat, "pid": self._pid, "tid": tid, "ts": ts,
                             "dur": max(0.0, round(self._us(t1) - ts, 3)), "args": args})

    def _flow(self, ph: str, seq: int, tid: int, t0: float, t1: float) -> None:
        """A flow point of batch ``seq`` at the end of the span t0..t1 of ``tid`` (just
        inside it): a batch leaves each stage after it got there, so the arrows run
        forward in time."""
        end = self._us(t1)
        event = {"ph": ph, "name": "batch", "cat": "batch", "id": seq, "pid": self._pid, "tid": tid,
                 "ts": round(max(self._us(t0), end - 0.001), 3)}
        if ph == "f":
            event["bp"] = "e"  # binds to the span enclosing it, as "s" and "t" do
        self._events.append(event)

    # ---- PipelineStats forwards these ----------------------------------------------------
    def started(self, name: str) -> None:
        """A span of ``name`` begins on this thread (an NVTX range, where on)."""
        if self._nvtx is not None:
            self._nvtx.push_range(name, domain="gpuio")

    def span(self, name: str, seq: int, t0: float, t1: float) -> None:
        """Stage ``name`` worked on batch ``seq`` from ``t0`` to ``t1`` on this thread."""
        if self._nvtx is not None:
            self._nvtx.pop_range(domain="gpuio")
        tid = self._tid()
        self._span(name, tid, t0, t1, {"batch": seq})
        self._flow("s" if name == self.first else "t", seq, tid, t0, t1)

    def gpu_span(self, name: str, seq: int, queued: float, seconds: float) -> None:
        """Stage ``name``'s device time for batch ``seq`` on its stream (queued at ``queued``)."""
        with self._lock:
            tid, free = self._streams.get(name, (None, 0.0))
            if tid is None:
                tid = -(len(self._streams) + 1)  # no thread has a negative id
                self._events.append({"ph": "M", "name": "thread_name", "pid": self._pid, "tid": tid,
                                     "args": {"name": f"CUDA stream of {name}"}})
            t0 = max(queued, free)
            self._streams[name] = (tid, t0 + seconds)
        self._span(name, tid, t0, t0 + seconds, {"batch": seq}, cat="gpu")

    def consumer(self, seq: int, t0: float, t1: float) -> None:
        """The consumer waited in ``next()`` from ``t0`` to ``t1`` and got batch ``seq``."""
        if self._nvtx is not None:
            self._nvtx.pop_range(domain="gpuio")
        tid = self._tid()
        self._span("next", tid, t0, t1, {"batch": seq}, cat="consumer")
        self._flow("f", seq, tid, t0, t1)
        self.taken += 1

    def part(self, name: str, t0: float, t1: float) -> None:
        """A part of an op ran on a thread of ``ops._cpu_pool`` (this one)."""
        self._span(name, self._tid(), t0, t1, {}, cat="part")

    def counter(self, name: str, values: dict[str, int]) -> None:
        self._events.append({"ph": "C", "name": name, "pid": self._pid, "ts": self._us(time.perf_counter()),
                             "args": dict(values)})

    # ---- the file ------------------------------------------------------------------------
    def write(self) -> str:
        """Save the events as ``{"traceEvents": [...]}`` at ``path``; returns the path."""
        events = list(self._events)
        with open(self.path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return self.path


def _nvtx() -> Any:
    """The ``nvtx`` module, or None where it is not installed."""
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx
