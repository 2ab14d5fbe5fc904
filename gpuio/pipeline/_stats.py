"""What a loader measures of itself, always: the hook the executor and the loader call.

``PipelineStats`` is the one object the pipeline reports to (``taken``, ``done``,
``passed``, ``gpu_timed``, ``waited``, ``worked``, ``fetched``, ``moved``); ``snapshot()``
turns its figures into the plain dict of ``Loader.stats()``. Every figure has a fixed
size (a count, a sum, a log-bucket histogram), so a loader that runs for weeks holds no
more than one that ran a batch. Each stage's figures are updated under their own lock,
so ``snapshot()`` may be called from any thread while a pass runs. A ``Tracer``
(``gpuio.pipeline._trace``), while one is attached, gets every call too.

Rules the figures follow:
- a stage's *busy* fraction is its seconds of work over its workers times the seconds
  passes ran: 1.0 means every worker worked all the time;
- *starved* is time its workers waited for an input (an empty queue), *blocked* the time
  a finished item waited for its turn to be passed on (the stage before it in order is
  still working on an earlier item);
- on a GPU, a stage's device time is measured with CUDA events recorded around its work
  on its stream, read once the end event has passed (``Event.done``), never by waiting;
- the consumer's *wait* is the time ``next()`` took to hand over a batch (with the
  hand-off), its *work* the time from a batch's hand-over to the next ``next()``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from typing import Any

__all__ = ["Histogram", "PipelineStats", "cpu_budget"]

_BUCKETS_PER_OCTAVE = 4  # bucket k holds latencies up to 2**(k/4) microseconds: within 19%
_BUCKETS = 124  # up to 2**31 us, some 36 minutes
_GPU_PENDING = 256  # device timings not yet read, at most (older ones are dropped)


class Histogram:
    """Latencies in log-spaced buckets (fixed size; the caller holds a lock)."""

    __slots__ = ("counts", "n")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.n = 0

    def add(self, seconds: float) -> None:
        us = seconds * 1e6
        k = 0 if us <= 1.0 else min(_BUCKETS - 1, math.ceil(math.log2(us) * _BUCKETS_PER_OCTAVE))
        self.counts[k] += 1
        self.n += 1

    def quantile(self, q: float) -> float:
        """The ``q`` quantile in seconds: the upper edge of its bucket (0.0 when empty)."""
        if not self.n:
            return 0.0
        rank, seen = q * self.n, 0
        for k, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return 2 ** (k / _BUCKETS_PER_OCTAVE) / 1e6
        return 2 ** ((_BUCKETS - 1) / _BUCKETS_PER_OCTAVE) / 1e6


class _Meter:
    """One stage's figures (or the consumer's, or the remote fetches')."""

    __slots__ = ("lock", "workers", "gpu", "items", "seconds", "latency", "depth_sum", "takes",
                 "starved", "blocked", "gpu_items", "gpu_seconds", "gpu_latency", "nbytes")

    def __init__(self, workers: int = 1, gpu: bool = False) -> None:
        self.lock = threading.Lock()
        self.workers, self.gpu = workers, gpu
        self.items = 0
        self.seconds = 0.0
        self.latency = Histogram()
        self.depth_sum = self.takes = 0
        self.starved = self.blocked = 0.0
        self.gpu_items, self.gpu_seconds, self.gpu_latency = 0, 0.0, Histogram()
        self.nbytes = 0

    def as_dict(self, wall: float) -> dict[str, Any]:
        with self.lock:
            out = {
                "batches": self.items,
                "workers": self.workers,
                "seconds": round(self.seconds, 6),
                "ms_per_batch": round(1e3 * self.seconds / self.items, 3) if self.items else 0.0,
                "busy": round(self.seconds / (self.workers * wall), 4) if wall > 0 else 0.0,
                "p50_ms": round(1e3 * self.latency.quantile(0.5), 3),
                "p99_ms": round(1e3 * self.latency.quantile(0.99), 3),
                "queue_mean": round(self.depth_sum / self.takes, 3) if self.takes else 0.0,
                "starved_s": round(self.starved, 6),
                "blocked_s": round(self.blocked, 6),
            }
            if self.gpu:
                out.update({"gpu_batches": self.gpu_items, "gpu_seconds": round(self.gpu_seconds, 6),
                            "gpu_busy": round(self.gpu_seconds / wall, 4) if wall > 0 else 0.0,
                            "gpu_p50_ms": round(1e3 * self.gpu_latency.quantile(0.5), 3),
                            "gpu_p99_ms": round(1e3 * self.gpu_latency.quantile(0.99), 3)})
            return out


class PipelineStats:
    """The measurements of one loader, over every pass (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stages: dict[str, _Meter] = {}
        self.consumer_wait = _Meter()  # next(): from the call to the batch handed over
        self.consumer_work = _Meter()  # the training step: from a hand-over to the next call
        self.remote = _Meter()  # ranged GETs of object storage, all threads together
        self._wall = 0.0  # seconds of passes ended
        self._since: float | None = None  # when the running pass began
        self._cpu0 = time.process_time()
        self._cpu = 0.0  # process CPU seconds during passes ended
        self._cpu_since = 0.0
        self.in_flight: dict[str, int] = {}  # bytes read and not yet handed over, by where they lie
        self.peak_in_flight = 0
        self._gpu_lock = threading.Lock()
        self._gpu_pending: deque[tuple[str, int, float, Any, Any]] = deque(maxlen=_GPU_PENDING)
        self.tracer: Any = None  # a Tracer while one captures (gpuio.pipeline._trace)

    # ---- the pipeline's calls ------------------------------------------------------------
    def stage(self, name: str, workers: int, gpu: bool = False) -> None:
        """Declare stage ``name`` (kept across passes; its workers may change)."""
        with self._lock:
            meter = self.stages.get(name)
            if meter is None:
                self.stages[name] = _Meter(workers, gpu)
            else:
                meter.workers, meter.gpu = workers, gpu

    def pass_started(self) -> None:
        with self._lock:
            self._since, self._cpu_since = time.perf_counter(), time.process_time()

    def pass_ended(self) -> None:
        with self._lock:
            if self._since is not None:
                self._wall += time.perf_counter() - self._since
                self._cpu += time.process_time() - self._cpu_since
                self._since = None

    def taken(self, name: str, depth: int, starved: float) -> None:
        """A worker of ``name`` took an item after waiting ``starved`` seconds for one,
        with ``depth`` items left in its input queue."""
        m = self.stages[name]
        with m.lock:
            m.depth_sum += depth
            m.takes += 1
            m.starved += starved

    def done(self, name: str, seq: int, t0: float, t1: float) -> None:
        """A worker of ``name`` worked on item ``seq`` from ``t0`` to ``t1`` (perf_counter)."""
        _add(self.stages[name], t1 - t0)
        tracer = self.tracer
        if tracer is not None:
            tracer.span(name, seq, t0, t1)
        if self._gpu_pending:
            self._read_gpu_timings()

    def passed(self, name: str, seq: int, blocked: float) -> None:
        """Item ``seq`` of ``name`` waited ``blocked`` seconds for its turn to go on."""
        m = self.stages[name]
        with m.lock:
            m.blocked += blocked

    def gpu_timed(self, name: str, seq: int, submitted: float, start: Any, end: Any) -> None:
        """CUDA events recorded before and after stage ``name``'s work on item ``seq``
        (queued at ``submitted``); read once ``end`` has passed."""
        with self._gpu_lock:
            self._gpu_pending.append((name, seq, submitted, start, end))

    def _read_gpu_timings(self) -> None:
        """Device times of the events that have passed (``Event.done``: no waiting)."""
        passed = []
        with self._gpu_lock:
            while self._gpu_pending and self._gpu_pending[0][4].done:
                passed.append(self._gpu_pending.popleft())
        if not passed:
            return
        from cupy.cuda import get_elapsed_time  # events exist only where CuPy is in use

        for name, seq, submitted, start, end in passed:
            seconds = get_elapsed_time(start, end) / 1e3
            _add(self.stages[name], seconds, gpu=True)
            tracer = self.tracer
            if tracer is not None:
                tracer.gpu_span(name, seq, submitted, seconds)

    def waited(self, seq: int, t0: float, t1: float) -> None:
        """The consumer waited in ``next()`` from ``t0`` to ``t1`` for batch ``seq``."""
        _add(self.consumer_wait, t1 - t0)
        tracer = self.tracer
        if tracer is not None:
            tracer.consumer(seq, t0, t1)

    def worked(self, seconds: float) -> None:
        """The consumer spent ``seconds`` on a batch before asking for the next."""
        _add(self.consumer_work, seconds)

    def fetched(self, seconds: float, nbytes: int) -> None:
        """A ranged GET of ``nbytes`` bytes took ``seconds`` (retries included)."""
        m = self.remote
        with m.lock:
            m.items += 1
            m.seconds += seconds
            m.latency.add(seconds)
            m.nbytes += nbytes

    def moved(self, where: str, nbytes: int) -> None:
        """``nbytes`` read into ``where`` ("host", "pinned", "gpu"); < 0: handed over."""
        if not nbytes:
            return
        with self._lock:
            self.in_flight[where] = self.in_flight.get(where, 0) + nbytes
            self.peak_in_flight = max(self.peak_in_flight, sum(self.in_flight.values()))
        tracer = self.tracer
        if tracer is not None:
            tracer.counter("bytes in flight", self.in_flight)

    # ---- what they add up to -------------------------------------------------------------
    def wall(self) -> tuple[float, float]:
        """Seconds passes ran and process CPU seconds during them, the running one included."""
        with self._lock:
            wall, cpu = self._wall, self._cpu
            if self._since is not None:
                wall += time.perf_counter() - self._since
                cpu += time.process_time() - self._cpu_since
        return wall, cpu

    def snapshot(self) -> dict[str, Any]:
        """The figures now (see ``Loader.stats``)."""
        if self._gpu_pending:
            self._read_gpu_timings()
        wall, cpu = self.wall()
        with self._lock:
            stages = dict(self.stages)
            in_flight = dict(self.in_flight)
            peak = self.peak_in_flight
        wait, work = self.consumer_wait, self.consumer_work
        with wait.lock, work.lock:
            consumer = {
                "batches": wait.items,
                "wait_s": round(wait.seconds, 6),
                "wait_p50_ms": round(1e3 * wait.latency.quantile(0.5), 3),
                "wait_p99_ms": round(1e3 * wait.latency.quantile(0.99), 3),
                "work_s": round(work.seconds, 6),
                "work_p50_ms": round(1e3 * work.latency.quantile(0.5), 3),
                "work_p99_ms": round(1e3 * work.latency.quantile(0.99), 3),
            }
            step = wait.seconds + work.seconds
            consumer["input_share"] = round(wait.seconds / step, 4) if step > 0 else 0.0
        remote = self.remote
        with remote.lock:
            fetches = {"requests": remote.items, "bytes": remote.nbytes, "seconds": round(remote.seconds, 6),
                       "p50_ms": round(1e3 * remote.latency.quantile(0.5), 3),
                       "p99_ms": round(1e3 * remote.latency.quantile(0.99), 3),
                       "bytes_per_s": remote.nbytes / wall if wall > 0 else 0.0}
        cores = cpu_budget()
        return {
            "stages": {name: m.as_dict(wall) for name, m in stages.items()},
            "consumer": consumer,
            "remote": fetches,
            "bytes_in_flight": in_flight,
            "peak_bytes_in_flight": peak,
            "cpu": {"seconds": round(cpu, 6), "cores": cores,
                    "busy": round(cpu / (wall * cores), 4) if wall > 0 else 0.0},
        }


def _add(m: _Meter, seconds: float, gpu: bool = False) -> None:
    with m.lock:
        if gpu:
            m.gpu_items += 1
            m.gpu_seconds += seconds
            m.gpu_latency.add(seconds)
        else:
            m.items += 1
            m.seconds += seconds
            m.latency.add(seconds)


def cpu_budget() -> int:
    """The cores this process may use: the affinity mask, cut by the cgroup's CPU quota
    (``cpu.max``, cgroup v2, or ``cpu.cfs_quota_us``, v1), shared among ``torchrun``'s
    processes on this node (``LOCAL_WORLD_SIZE``); at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 1:
        cores = cores // int(local)
    return max(1, cores)


def _cgroup_quota() -> float | None:
    """The cgroup's CPU quota in cores, or None where it has none (or none is readable)."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
