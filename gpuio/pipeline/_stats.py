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

import logging
import math
import os
import threading
import time
from collections import deque
from typing import Any

from gpuio.device import require

__all__ = ["Autotune", "Histogram", "PipelineStats", "cpu_budget"]

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
        self.start_up = _Meter()  # the same for each pass's first batch (threads start, the stages fill)
        self.hand_off = _Meter()  # the part of next() that hands a batch to the consumer's framework
        self.consumer_work = _Meter()  # the training step: from a hand-over to the next call
        self.remote = _Meter()  # ranged GETs of object storage, all threads together
        self._wall = 0.0  # seconds of passes ended
        self._since: float | None = None  # when the running pass began
        self._cpu0 = time.process_time()
        self._cpu = 0.0  # process CPU seconds during passes ended
        self._cpu_since = 0.0
        self._machine = [0, 0]  # the machine's busy and all CPU ticks during passes ended (Linux)
        self._machine_since = (0, 0)
        # per stage (and "parts", the ops' pool): its threads' seconds on a core and ready
        # to run but waiting for one, during passes ended (Linux; schedstat)
        self._threads: dict[str, tuple[int, ...]] = {}
        self._sched: dict[str, list[float]] = {}
        self._sched_since: dict[str, tuple[float, float]] = {}
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
            self._machine_since = _machine_ticks()
            self._sched_since = self._sched_now()

    def pass_ended(self) -> None:
        with self._lock:
            if self._since is not None:
                self._wall += time.perf_counter() - self._since
                self._cpu += time.process_time() - self._cpu_since
                busy, total = _machine_ticks()
                self._machine[0] += busy - self._machine_since[0]
                self._machine[1] += total - self._machine_since[1]
                for group, (on, waited) in self._sched_now().items():
                    was = self._sched_since.get(group, (0.0, 0.0))
                    acc = self._sched.setdefault(group, [0.0, 0.0])
                    acc[0] += max(0.0, on - was[0])  # threads that ended meanwhile count no more
                    acc[1] += max(0.0, waited - was[1])
                self._since = None

    def taken(self, name: str, depth: int, starved: float) -> None:
        """A worker of ``name`` took an item after waiting ``starved`` seconds for one,
        with ``depth`` items left in its input queue."""
        m = self.stages[name]
        with m.lock:
            m.depth_sum += depth
            m.takes += 1
            m.starved += starved
        tracer = self.tracer
        if tracer is not None:
            tracer.counter(f"queue before {name}", {"batches": depth})

    def started(self, name: str) -> None:
        """A span of ``name`` (a stage's work, the consumer's ``next``) begins on this thread."""
        tracer = self.tracer
        if tracer is not None:
            tracer.started(name)

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
        cp = require("cupy")  # events exist only where CuPy is in use

        for name, seq, submitted, start, end in passed:
            seconds = cp.cuda.get_elapsed_time(start, end) / 1e3  # milliseconds
            _add(self.stages[name], seconds, gpu=True)
            tracer = self.tracer
            if tracer is not None:
                tracer.gpu_span(name, seq, submitted, seconds)

    def waited(self, seq: int, t0: float, t1: float, first: bool = False) -> None:
        """The consumer waited in ``next()`` from ``t0`` to ``t1`` for item ``seq``; the
        first batch of a pass (``first``: its start-up) is counted apart."""
        _add(self.start_up if first else self.consumer_wait, t1 - t0)
        tracer = self.tracer
        if tracer is not None:
            tracer.consumer(seq, t0, t1)

    def handed(self, seq: int, t0: float, t1: float) -> None:
        """Item ``seq`` was handed to the consumer's framework (and stream) from ``t0`` to ``t1``."""
        _add(self.hand_off, t1 - t0)
        tracer = self.tracer
        if tracer is not None:
            tracer.span("hand-off", seq, t0, t1)

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

    def attach(self, tracer: Any) -> Any:
        """Forward every call to ``tracer`` (``None``: stop); returns the one it replaces."""
        old, self.tracer = self.tracer, tracer
        return old

    # ---- what they add up to -------------------------------------------------------------
    def workers(self, name: str, native_ids: list[int]) -> None:
        """Stage ``name`` runs on the threads of these native ids (from now on)."""
        with self._lock:
            self._threads[name] = tuple(native_ids)

    def _sched_now(self) -> dict[str, tuple[float, float]]:
        """Per stage, and for ``parts`` (the threads of the ops' pool, ``gpuio-ops``), its
        threads' seconds on a core and waiting for one so far."""
        groups = dict(self._threads)
        groups["parts"] = tuple(t.native_id for t in threading.enumerate()
                                if t.name.startswith("gpuio-ops") and t.native_id is not None)
        return {group: _schedstat(tids) for group, tids in groups.items()}

    def wall(self) -> tuple[float, float, dict[str, tuple[float, float]], float]:
        """Seconds passes ran, process CPU seconds during them, per stage (and ``parts``)
        its threads' seconds on a core and waiting for one then, and the share of the
        machine's CPU time that was busy (every process), the running pass included."""
        with self._lock:
            wall, cpu = self._wall, self._cpu
            sched = {group: tuple(acc) for group, acc in self._sched.items()}
            busy, total = self._machine
            if self._since is not None:
                wall += time.perf_counter() - self._since
                cpu += time.process_time() - self._cpu_since
                for group, (on, waited) in self._sched_now().items():
                    was = self._sched_since.get(group, (0.0, 0.0))
                    acc = sched.get(group, (0.0, 0.0))
                    sched[group] = (acc[0] + max(0.0, on - was[0]), acc[1] + max(0.0, waited - was[1]))
                now = _machine_ticks()
                busy, total = busy + now[0] - self._machine_since[0], total + now[1] - self._machine_since[1]
        return wall, cpu, sched, busy / total if total > 0 else 0.0

    def snapshot(self) -> dict[str, Any]:
        """The figures now (see ``Loader.stats``)."""
        if self._gpu_pending:
            self._read_gpu_timings()
        wall, cpu, sched, machine = self.wall()
        with self._lock:
            stages = dict(self.stages)
            in_flight = dict(self.in_flight)
            peak = self.peak_in_flight
        wait, work, start = self.consumer_wait, self.consumer_work, self.start_up
        with wait.lock, work.lock, start.lock:
            consumer = {
                "batches": wait.items + start.items,
                "start_up_s": round(start.seconds, 6),
                "wait_s": round(wait.seconds, 6),
                "wait_p50_ms": round(1e3 * wait.latency.quantile(0.5), 3),
                "wait_p99_ms": round(1e3 * wait.latency.quantile(0.99), 3),
                "work_s": round(work.seconds, 6),
                "work_p50_ms": round(1e3 * work.latency.quantile(0.5), 3),
                "work_p99_ms": round(1e3 * work.latency.quantile(0.99), 3),
            }
            step = wait.seconds + work.seconds
        with self.hand_off.lock:
            consumer.update(hand_off_s=round(self.hand_off.seconds, 6),
                            hand_off_p50_ms=round(1e3 * self.hand_off.latency.quantile(0.5), 3),
                            hand_off_p99_ms=round(1e3 * self.hand_off.latency.quantile(0.99), 3))
            consumer["input_share"] = round(wait.seconds / step, 4) if step > 0 else 0.0
        remote = self.remote
        with remote.lock:
            fetches = {"requests": remote.items, "bytes": remote.nbytes, "seconds": round(remote.seconds, 6),
                       "p50_ms": round(1e3 * remote.latency.quantile(0.5), 3),
                       "p99_ms": round(1e3 * remote.latency.quantile(0.99), 3),
                       "bytes_per_s": remote.nbytes / wall if wall > 0 else 0.0}
        cores = cpu_budget()
        return {
            "stages": {name: {**m.as_dict(wall), "on_core_s": round(sched.get(name, (0.0, 0.0))[0], 6),
                              "waited_for_core_s": round(sched.get(name, (0.0, 0.0))[1], 6)}
                       for name, m in stages.items()},
            "consumer": consumer,
            "remote": fetches,
            "bytes_in_flight": in_flight,
            "peak_bytes_in_flight": peak,
            "cpu": {"seconds": round(cpu, 6), "cores": cores,
                    "busy": round(cpu / (wall * cores), 4) if wall > 0 else 0.0, "machine_busy": round(machine, 4),
                    "waited_for_cores_s": round(sum(w for _, w in sched.values()), 6),
                    "parts": {"on_core_s": round(sched.get("parts", (0.0, 0.0))[0], 6),
                              "waited_for_core_s": round(sched.get("parts", (0.0, 0.0))[1], 6)}},
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


def _machine_ticks() -> tuple[int, int]:
    """The machine's busy and all CPU ticks so far, every core and process (``/proc/stat``;
    (0, 0) where there is none)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest time is in user)
    return total - ticks[3] - ticks[4], total


def _schedstat(tids: tuple[int, ...]) -> tuple[float, float]:
    """Seconds these threads of this process have been on a core and ready to run but
    waiting for one (``/proc/self/task/<id>/schedstat``; 0.0 where there is none)."""
    on = waited = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                fields = f.read().split()
            on, waited = on + int(fields[0]), waited + int(fields[1])
        except (OSError, ValueError, IndexError):  # a thread that ended, or no schedstat here
            continue
    return on / 1e9, waited / 1e9


def cpu_budget() -> int:
    """The cores this process may use (see ``cpu_budget_parts``)."""
    return cpu_budget_parts()["cores"]


def cpu_budget_parts() -> dict[str, Any]:
    """The cores this process may use and where the figure comes from: the ``affinity``
    mask, cut by the cgroup's CPU ``quota`` in cores (``cpu.max``, cgroup v2, or
    ``cpu.cfs_quota_us``, v1; None where it has none), shared among ``torchrun``'s
    ``local_world_size`` processes on this node (``LOCAL_WORLD_SIZE``); at least 1."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    cores = affinity if quota is None else min(affinity, max(1, math.ceil(quota)))
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    local_world_size = int(local) if local.isdigit() and int(local) > 1 else 1
    return {"cores": max(1, cores // local_world_size), "affinity": affinity, "quota": quota,
            "local_world_size": local_world_size}


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


# ---- the verdict ---------------------------------------------------------------------------
# tf.data's input pipeline analyzer's bands of the share of step time spent waiting for input
_BANDS = ((0.05, "not input-bound"), (0.20, "moderately input-bound"), (float("inf"), "highly input-bound"))
_SATURATED = 0.8  # a busy share at or above this: the workers (or cores) have no time to spare
_CPU_SATURATED = 0.85
_DEMAND = 0.5  # the bottleneck wanted a core this share of its working time ...
_CONTENDED = 0.3  # ... and waited for one this share of that: other threads or processes take the cores


class Verdict:
    """What ``Loader.report()`` concludes: ``input_share`` (the consumer's wait in
    ``next()`` over its wait and its work, each pass's first batch left out) and its
    ``band``; the ``bottleneck`` (a stage, or ``"consumer"``); the ``resource`` that binds
    it (``"consumer"``, ``"cpu"``, ``"workers"``, ``"storage"``, ``"network"``,
    ``"gpu"``, ``"buffer budget"``, ``"hand-off"``); ``advice`` (what to change); and
    ``numbers``, the figures it used. ``str()`` is the same as lines of text."""

    def __init__(self, input_share: float, band: str, bottleneck: str, resource: str, why: str,
                 advice: str, numbers: dict[str, Any]) -> None:
        self.input_share, self.band, self.bottleneck = input_share, band, bottleneck
        self.resource, self.why, self.advice, self.numbers = resource, why, advice, numbers

    def as_dict(self) -> dict[str, Any]:
        return {"input_share": self.input_share, "band": self.band, "bottleneck": self.bottleneck,
                "resource": self.resource, "why": self.why, "advice": self.advice, "numbers": self.numbers}

    def __str__(self) -> str:
        return "\n".join([f"{self.band}: the training loop waited {100 * self.input_share:.1f}% of its step time "
                          "for batches",
                          f"bottleneck: {self.bottleneck} (bound by {self.resource}): {self.why}",
                          f"to change: {self.advice}"])

    __repr__ = __str__


def verdict(s: dict[str, Any], *, threads: int, prefetch: int, window: int, wanted: int,
            settings: dict[str, Any]) -> Verdict:
    """The verdict on ``s`` (``Loader.stats()``) of a loader with ``threads`` per CPU
    stage and ``prefetch``, running ``window`` batches in flight where its stages and ``prefetch`` want
    ``wanted`` (fewer: the buffer budget cut it); ``settings``: the ``gpuio.config``
    values the advice names."""
    c = s["consumer"]
    if c["batches"] < 2:
        return Verdict(0.0, "no verdict yet", "-", "-", "the loader has handed over fewer than two batches",
                       "iterate it first (the first batch of each pass, the start-up, is not counted)", {})
    share = c["input_share"]
    band = next(name for limit, name in _BANDS if share < limit)
    stages = s["stages"]
    busy = {name: max(st["busy"], st.get("gpu_busy", 0.0)) for name, st in stages.items()}
    top = max(busy, key=busy.get) if busy else "read"
    st = stages.get(top, {"busy": 0.0, "workers": 1, "p50_ms": 0.0, "p99_ms": 0.0})
    cpu = s["cpu"]
    numbers: dict[str, Any] = {
        "input_share": share, "wait_s": c["wait_s"], "work_s": c["work_s"], "start_up_s": c["start_up_s"],
        "stage_busy": busy, "cpu_busy": cpu["busy"], "machine_busy": cpu["machine_busy"], "cores": cpu["cores"],
        "window": window,
        "wanted_window": wanted}
    shares = ", ".join(f"{n} {100 * b:.0f}%" for n, b in sorted(busy.items(), key=lambda kv: -kv[1]))
    if share < _BANDS[0][0]:
        spare = f"its busiest stage, {top}, is busy {100 * busy.get(top, 0.0):.0f}% of the time"
        return Verdict(share, band, "consumer", "consumer",
                       f"the training step takes {c['work_p50_ms']:.1f} ms per batch (p50), the loader hands a "
                       f"batch over in {c['wait_p50_ms']:.2f} ms; {spare}",
                       "nothing in the loader: speed up the training step; the loader has room "
                       f"({spare}; threads={threads} could be fewer)", numbers)
    stage_says = (f"{top} is the busiest stage ({shares}): {st['workers']} worker(s), "
                  f"{st['p50_ms']:.1f} ms per batch p50, {st['p99_ms']:.1f} ms p99")
    if window < wanted and busy.get(top, 0.0) < _SATURATED:
        b = s["buffers"]
        need = b["budget"] * (wanted + 1) // (window + 1)  # the consumer holds one batch more
        return Verdict(share, band, top, "buffer budget",
                       f"the buffer budget ({b['budget']:,} bytes) holds only {window} batch(es) in flight where "
                       f"the stages would keep {wanted}, so the stages wait for buffers; {stage_says}",
                       f"raise buffer_budget to about {need:,} bytes (gpuio.config.override(buffer_budget=...) "
                       "or GPUIO_BUFFER_BUDGET), or use a smaller batch_size", numbers)
    # the bottleneck's threads (an op stage's with the ops' part pool): the time they wanted a core, and
    # waited for one
    pool = top not in ("read", "parse")
    on = st.get("on_core_s", 0.0) + (cpu["parts"]["on_core_s"] if pool else 0.0)
    waited = st.get("waited_for_core_s", 0.0) + (cpu["parts"]["waited_for_core_s"] if pool else 0.0)
    demand = (on + waited) / st["seconds"] if st.get("seconds") else 0.0
    contended = waited / (on + waited) if on + waited > 0 else 0.0
    numbers.update(core_demand=demand, waited_for_core_share=contended)
    if cpu["busy"] >= _CPU_SATURATED or (demand >= _DEMAND and contended >= _CONTENDED):
        others = "" if cpu["busy"] >= _CPU_SATURATED else (
            f"; {top}'s threads{' and the ops part pool' if pool else ''} waited for a core "
            f"{100 * contended:.0f}% of the time they wanted one, while the machine's cores were {100 * cpu['machine_busy']:.0f}% busy: other threads or "
            "processes take them")
        return Verdict(share, band, top, "cpu",
                       f"the process used {cpu['busy'] * cpu['cores']:.1f} of its {cpu['cores']} cores "
                       f"({100 * cpu['busy']:.0f}%){others}; {stage_says}",
                       f"more threads cannot help: make {top} cheaper (fewer or smaller ops, a packed dataset), "
                       "move decoding and augmentation to the GPU (device='cuda'), or give the process more "
                       "cores", numbers)
    r = s["remote"]
    if top == "read" and r["requests"]:
        numbers.update(remote_bytes_per_s=r["bytes_per_s"], get_p50_ms=r["p50_ms"], get_p99_ms=r["p99_ms"])
        return Verdict(share, band, "read", "network",
                       f"the reads wait on object storage: {r['requests']} GETs at {r['bytes_per_s'] / 1e6:.1f} "
                       f"MB/s, {r['p50_ms']:.1f} ms p50 and {r['p99_ms']:.1f} ms p99 per GET (retries "
                       f"included); {stage_says}",
                       f"keep more GETs in flight (remote_requests, now {settings['remote_requests']}), keep "
                       f"the node-local cache on (remote_cache, now {settings['remote_cache']}) so later epochs "
                       "read local disk, or ask the store why it throttles (a p99 far above the p50)", numbers)
    if top == "read":
        numbers["bytes_per_s"] = s["bytes_per_s"]
        return Verdict(share, band, "read", "storage",
                       f"the reads take {st['p50_ms']:.1f} ms per batch p50 ({s['bytes_per_s'] / 1e6:.1f} MB/s) "
                       f"while the CPU is {100 * cpu['busy']:.0f}% busy; {stage_says}",
                       f"keep more reads in flight (io_threads, now {settings['io_threads']}; read_parts, now "
                       f"{settings['read_parts']}), pack small files into shards (gpuio pack), or use a faster "
                       "disk", numbers)
    if stages.get(top, {}).get("gpu_busy", 0.0) >= _SATURATED:
        return Verdict(share, band, top, "gpu",
                       f"{top}'s kernels keep the GPU busy {100 * st['gpu_busy']:.0f}% of the time "
                       f"({st['gpu_p50_ms']:.1f} ms per batch p50); {stage_says}",
                       f"make {top} cheaper on the GPU (fewer ops, a smaller output, a fused chain)", numbers)
    if busy.get(top, 0.0) >= _SATURATED:
        room = cpu["cores"] - cpu["busy"] * cpu["cores"]
        return Verdict(share, band, top, "workers",
                       f"{top}'s {st['workers']} worker(s) are busy {100 * busy[top]:.0f}% of the time while the "
                       f"process uses {100 * cpu['busy']:.0f}% of its {cpu['cores']} cores; {stage_says}",
                       f"raise threads (now {threads}; about {room:.1f} cores are idle), or make {top} cheaper",
                       numbers)
    return Verdict(share, band, top, "hand-off",
                   f"no stage is saturated ({shares}) and the CPU is {100 * cpu['busy']:.0f}% busy: batches wait "
                   "between stages and for the consumer",
                   f"raise prefetch (now {prefetch}, {window} batches in flight) so that more batches are under way",
                   numbers)


_TUNE_BATCHES = 8  # the most batches the tuner looks at before each decision
_FIRST_SPAN = 4  # the fewest: a span shorter than this measures the noise of single batches
_SETTLE_SHARE, _SETTLE_SPANS = 0.1, 4  # spans short enough for this many decisions within this share of a pass
_MOVED = 0.25  # a change of the consumer's wait share by this much (absolute) reopens a settled or undone setting
_GAIN = 0.05  # a split of the decodes is kept when the consumer's batches per second rise by this much
_MOST_PREFETCH = 64  # read-ahead depth the tuner never goes beyond, whatever the budget allows
_log = logging.getLogger("gpuio")


class Autotune:
    """The settings a loader chooses online from its figures: the read-ahead depth
    (``Loader(prefetch="auto")``) and the parts a batch's decodes are split into on the
    ops' pool (``decode_parts="auto"``, a CPU loader whose ops read it).

    The loader tells it each pass's length (``begin``) and each batch's wait in
    ``next()`` and the consumer's work after it (``batch``); at the end of each span of
    batches it decides. A span is short enough that ``_SETTLE_SPANS`` decisions fit in
    the first ``_SETTLE_SHARE`` of a pass, never shorter than ``_FIRST_SPAN`` nor longer
    than ``_TUNE_BATCHES``. While the consumer waited at least tf.data's lower band (5%)
    of its step time and the process left some of its cores free (``_CPU_SATURATED``):

    - no stage's workers saturated (busy below ``_SATURATED``, on a GPU its device time
      too): the read-ahead depth doubles (one more at least), up to ``room``, the most
      the buffer budget allows;
    - the decoding stage's workers saturated: its batches are split into twice the parts
      (one more at least), up to the cores this process may use (``cpu_budget``), so
      that the idle cores take parts of the batches the workers hold. A split takes
      cores, so it is a trial: unless the next span's batches per second rise by
      ``_GAIN`` it is undone, and that split is not tried again until the consumer's
      wait share has moved by ``_MOVED``.

    A setting holds once the consumer no longer waits, the cores are saturated, or its
    limit binds. The tuner settles at the first span whose consumer waited yet that
    changes nothing (and has no trial to judge): from then on it changes a setting only
    once the consumer's wait share has moved by ``_MOVED`` from that span's, so that
    noise does not keep it moving (a span that did not wait settles nothing: the next
    slow batch still deepens the read-ahead, which only ever deepens). Each change, and the first hold of each kind, is a decision
    ``{batch, setting, from, to, why}`` in ``decisions`` and a log line (``gpuio``
    logger). ``prefetch`` or ``parts`` ``None``: that setting is not tuned."""

    def __init__(self, stats: PipelineStats, prefetch: int | None, parts: int | None = None,
                 decoding: str | None = None) -> None:
        self.prefetch, self.parts, self._decoding = prefetch, parts, decoding
        self.decisions: list[dict[str, Any]] = []
        self._stats = stats
        self._held: dict[str, str] = {}  # per setting, the kind of the last hold said (once until a change)
        self._cores = cpu_budget()  # read once: it reads the cgroup's files
        self._span = _TUNE_BATCHES
        self._settled: float | None = None  # the wait share of the span that settled the tuner
        self._trial: tuple[int, float] | None = None  # a split on trial: the parts before, batches/s before
        self._undone: dict[int, float] = {}  # parts tried and undone: the wait share then
        self.begin()

    def begin(self, batches: int | None = None) -> None:
        """Start a span (at a pass's start, of ``batches`` batches: its first batch is
        start-up, not counted)."""
        if batches is not None:
            self._span = min(_TUNE_BATCHES, max(_FIRST_SPAN, math.ceil(batches * _SETTLE_SHARE / _SETTLE_SPANS)))
        self._wait = self._work = 0.0
        self._n = 0
        self._t0, self._cpu0 = time.perf_counter(), time.process_time()
        self._seconds0 = {name: max(m.seconds, m.gpu_seconds) for name, m in self._stats.stages.items()}

    def batch(self, k: int, wait: float, work: float, room: int) -> dict[str, int]:
        """Batch ``k`` was waited for ``wait`` s and worked on ``work`` s; the settings
        that change (``"prefetch"``, ``"decode_parts"``) and their new values. ``room``:
        the deepest read-ahead the budget allows."""
        self._wait += wait
        self._work += work
        self._n += 1
        n = self._n
        if n < self._span:
            return {}
        wall = time.perf_counter() - self._t0
        step = self._wait + self._work
        share = self._wait / step if step > 0 else 0.0
        busy = {name: (max(m.seconds, m.gpu_seconds) - self._seconds0.get(name, 0.0)) / (m.workers * wall)
                for name, m in self._stats.stages.items()} if wall > 0 else {}
        cores = self._cores
        cpu = (time.process_time() - self._cpu0) / (wall * cores) if wall > 0 else 0.0
        rate = n / wall if wall > 0 else 0.0
        self.begin()
        if self._trial is not None:
            undone = self._judge(k, share, rate)
            if undone:
                return undone
        elif self._settled is not None and abs(share - self._settled) < _MOVED:
            return {}
        self._settled = None
        parts = self.parts
        changes = self._changes(k, share, n, busy, cpu, room)
        if "decode_parts" in changes:
            self._trial = (parts, rate)
        if not changes and share >= _BANDS[0][0]:  # waited, and nothing helps: settled until the wait moves
            self._settled = share
        return changes

    def _judge(self, k: int, share: float, rate: float) -> dict[str, int]:
        """The split on trial: kept (``{}``) if the span after it ran ``_GAIN`` more
        batches per second than the span before it, else undone."""
        before, then = self._trial
        self._trial = None
        if rate >= (1 + _GAIN) * then:
            return {}
        self._undone[self.parts] = share
        why = (f"the consumer took {rate:.1f} batches/s over {self._span} batches with {self.parts} parts, "
               f"{then:.1f} with {before} before: the split is undone")
        self.parts = self._decide(k, "decode_parts", self.parts, before, why)
        return {"decode_parts": before}

    def _changes(self, k: int, share: float, n: int, busy: dict[str, float], cpu: float,
                 room: int) -> dict[str, int]:
        if share < _BANDS[0][0]:
            return {}
        waited = f"the consumer waited {100 * share:.0f}% of its step time over {n} batches"
        if cpu >= _CPU_SATURATED:
            why = (f"{waited}, but the process keeps {100 * cpu:.0f}% of its {self._cores} cores busy: "
                   "{} cannot make it faster")
            for setting, value, what in (("prefetch", self.prefetch, "batches further ahead"),
                                         ("decode_parts", self.parts, "more parts")):
                if value is not None:
                    self._hold(k, setting, value, "cpu", why.format(what))
            return {}
        changes = {}
        if self.prefetch is not None:
            depth = self._deepen(k, waited, busy, room)
            if depth is not None:
                changes["prefetch"] = self.prefetch = depth
        if self.parts is not None:
            parts = self._split(k, waited, share, busy, cpu)
            if parts is not None:
                changes["decode_parts"] = self.parts = parts
        return changes

    def _deepen(self, k: int, waited: str, busy: dict[str, float], room: int) -> int | None:
        top = max(busy, key=busy.__getitem__) if busy else None
        if top is not None and busy[top] >= _SATURATED:
            return self._hold(k, "prefetch", self.prefetch, "stage",
                              f"{waited}, but {top}'s workers are {100 * busy[top]:.0f}% busy: "
                              "batches further ahead cannot make it faster")
        deepest = min(room, _MOST_PREFETCH)
        if deepest <= self.prefetch:
            limit = ("the buffer budget holds no more batches in flight" if room <= _MOST_PREFETCH
                     else f"{_MOST_PREFETCH} is the most the tuner reads ahead")
            return self._hold(k, "prefetch", self.prefetch, "budget", f"{waited}, but {limit}")
        new = min(deepest, max(2 * self.prefetch, self.prefetch + 1))
        busiest = f" (busiest stage {top}, {100 * busy[top]:.0f}% busy)" if top is not None else ""
        bound = "; the buffer budget allows no more" if new == room else ""
        return self._decide(k, "prefetch", self.prefetch, new, f"{waited} and no stage is saturated{busiest}{bound}")

    def _split(self, k: int, waited: str, share: float, busy: dict[str, float], cpu: float) -> int | None:
        stage = self._decoding
        if busy.get(stage, 0.0) < _SATURATED:
            return None  # its workers have time to spare: the read-ahead's turn
        cores = self._cores
        saturated = (f"{waited}, {stage}'s workers are {100 * busy[stage]:.0f}% busy and the process keeps "
                     f"{100 * cpu:.0f}% of its {cores} cores busy")
        if self.parts >= cores:
            return self._hold(k, "decode_parts", self.parts, "budget",
                              f"{saturated}, but a batch's decodes already run as {self.parts} parts, one per "
                              f"core this process may use")
        new = min(cores, max(2 * self.parts, self.parts + 1))
        if new in self._undone and abs(share - self._undone[new]) < _MOVED:
            return self._hold(k, "decode_parts", self.parts, "undone",
                              f"{saturated}, but {new} parts ran no faster when tried, at a wait share of "
                              f"{100 * self._undone[new]:.0f}%")
        self._undone.pop(new, None)
        return self._decide(k, "decode_parts", self.parts, new,
                            f"{saturated}: the idle cores take parts of the batches the workers hold"
                            + ("; the cores allow no more" if new == cores else ""))

    def _hold(self, k: int, setting: str, value: int, kind: str, why: str) -> None:
        if self._held.get(setting) != kind:
            self._held[setting] = kind
            self._record(k, setting, value, value, why)
        return None

    def _decide(self, k: int, setting: str, old: int, new: int, why: str) -> int:
        self._held.pop(setting, None)
        self._record(k, setting, old, new, why)
        return new

    def _record(self, k: int, setting: str, old: int, new: int, why: str) -> None:
        self.decisions.append({"batch": k, "setting": setting, "from": old, "to": new, "why": why})
        _log.info("gpuio.Loader batch %d: %s %d -> %d: %s", k, setting, old, new, why)
