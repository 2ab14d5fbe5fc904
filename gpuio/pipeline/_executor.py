"""The stage executor: a chain of stages run concurrently, results in order.

``Executor(stages, window=..., device=...)`` starts the stages' threads once;
``feed(source)`` begins a pass, which sends the payloads of ``source`` through
``stages`` (each ``payload -> payload``) and hands them back with ``get()`` in the
order ``source`` made them, whatever order the workers finish in. Once a pass has
handed back everything it fed, the next ``feed`` reuses the same threads (no thread
start per pass):

- the consumer feeds: ``get()`` tops the pipeline up from ``source`` to ``window``
  payloads in flight (queued, being worked on, or finished and waiting), before it
  waits and again once it has taken the payload it returns, so that the next one is
  under way while the consumer holds this one; nothing runs ahead of the consumer by
  more than ``window`` and no feeder thread is needed; ``deepen(window)`` widens it
  for the next ``get()`` (the loader's read-ahead tuner);
- each stage has ``workers`` threads and an input queue (a ``SimpleQueue``: it never
  holds more than ``window`` items, and its get and put cost no Python-level locks, which
  on two cores showed in every batch's hand-off); a worker that finishes
  item ``s`` waits for its stage's turn to reach ``s`` before passing it on, so every
  queue holds items in source order (no reorder buffer is needed);
- on a GPU, a ``gpu`` stage runs on a CUDA stream of its own (one worker), waits on
  the event recorded by the previous GPU stage and records one when it is done;
  ``get()`` returns that event so the consumer's stream can wait on it. A host stage
  that receives an item with an event synchronizes on it first. The streams are
  blocking streams (``non_blocking=False``), so work on them is also ordered with
  respect to the legacy default stream. What a GPU stage reads of its input stays
  alive until its stream has passed that work (``Stage.holds``);
- an exception in a stage travels in order with its item (later stages pass it on
  untouched) and ``get()`` returns it, after every earlier item was handed over; no
  new payloads are fed after the first error;
- ``feed(source, inline=True)`` runs that pass's stages on the consumer's thread
  instead, one payload per ``get()`` (host stages only): no read-ahead and no hand-off
  between threads, for a consumer that would only wait for the next payload anyway;
- every step is told to ``hook`` (``gpuio.pipeline._stats.PipelineStats``): a worker's
  take (its wait for an input), its work (and on a GPU the CUDA events around it), its
  wait for its turn to pass the item on;
- ``close()`` stops every thread: blocking calls wake up every ``_POLL`` seconds to
  check the stop flag, and ``close`` joins them. A pass left with payloads in flight
  can only be closed: ``feed`` refuses to start another. In a forked child the
  threads do not exist: the executor is closed there and ``get()`` returns ``None``.

All heavy work in the stages is expected to release the GIL (preadv, NumPy, OpenCV,
simplejpeg), which is what lets threads run stages in parallel.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gpuio.storage._deferred import release_after
from gpuio._fork import renew_after_fork
from gpuio.device import Device, require
from gpuio.pipeline._stats import PipelineStats

_POLL = 0.05  # seconds between stop-flag checks in blocking calls
_JOIN_S = 10.0  # longest close() waits for one thread (a read stuck in the kernel)


@dataclass
class Stage:
    """One step: ``fn(payload) -> payload`` on ``workers`` threads (1 for a GPU stage).

    ``holds(payload)``, for a GPU stage, returns what of the payload the stage's kernels
    may read (arrays made on earlier stages' streams): it is kept alive until the
    stage's stream has passed the stage's work (``gpuio.storage._deferred``), so that no
    other stream gets that memory while the reads are queued."""

    name: str
    fn: Callable[[Any], Any]
    workers: int = 1
    gpu: bool = False
    holds: Callable[[Any], Any] | None = None


class Item:
    """A payload in flight: its position, the error that stopped it, its CUDA event."""

    __slots__ = ("seq", "payload", "error", "stage", "event")

    def __init__(self, seq: int, payload: Any) -> None:
        self.seq = seq
        self.payload = payload
        self.error: BaseException | None = None
        self.stage: str | None = None
        self.event: Any = None


class Executor:
    """Runs ``stages`` over the sources fed to it; see the module docstring."""

    def __init__(self, stages: list[Stage], *, window: int, device: Device,
                 hook: PipelineStats | None = None, name: str = "gpuio") -> None:
        self.stages = stages
        self.device = device
        self.hook = hook if hook is not None else PipelineStats()  # told of every step (gpuio.pipeline._stats)
        for s in stages:
            self.hook.stage(s.name, 1 if s.gpu else max(1, s.workers), s.gpu)
        self._source: Iterator[Any] = iter(())
        self._window = max(1, window)
        self._fed = 0  # payloads taken from sources, over every pass (the sequence numbers)
        self._in_flight = 0
        self._source_done = True
        self.inline = False  # the running pass works on the consumer's thread (see feed)
        self._queues = [queue.SimpleQueue() for _ in range(len(stages) + 1)]
        self._turn = [0] * len(stages)
        self._turn_cv = [threading.Condition() for _ in stages]
        self._stop = threading.Event()
        self._forked = False
        self._failed_seq: int | None = None  # first item that failed; later ones are not worked on
        self._threads: list[threading.Thread] = []
        self._name = name
        renew_after_fork(self)

    def snapshot(self) -> dict[str, Any]:
        """What the executor holds now: items waiting before each stage (and for the
        consumer) and the most items it keeps in flight."""
        names = [s.name for s in self.stages]
        return {"queues": {name: q.qsize() for name, q in zip(names, self._queues)}, "window": self._window}

    def deepen(self, window: int) -> None:
        """Keep up to ``window`` payloads in flight from the next ``get()`` on (the
        consumer's thread calls it, between ``get()`` calls; a window is never narrowed)."""
        self._window = max(self._window, window)

    def _after_fork(self) -> None:
        self._forked = True  # the threads stayed in the parent; locks they held stay held
        self._threads = []

    @property
    def reusable(self) -> bool:
        """Whether ``feed`` may start a pass: not closed, and the last pass handed back
        every payload it fed without an error."""
        return not (self._forked or self._stop.is_set()) and self._in_flight == 0 and self._failed_seq is None

    def feed(self, source: Iterator[Any], *, inline: bool = False) -> None:
        """Begin a pass over ``source``: ``get()`` hands its payloads back, worked on by
        the stage threads or, with ``inline``, by ``get()`` itself on the caller's thread."""
        if not self.reusable:
            raise RuntimeError("the executor is closed or its last pass still has payloads in flight")
        if inline and any(s.gpu for s in self.stages):
            raise RuntimeError("GPU stages run on their own streams' threads; they cannot run inline")
        self._source, self._source_done, self.inline = source, False, inline
        self._turn = [self._fed] * len(self.stages)  # nothing in flight: an inline pass took turns too

    # ---- lifetime ---------------------------------------------------------------------
    def start(self) -> None:
        for i, stage in enumerate(self.stages):
            threads = [self._spawn(self._work, f"{self._name}-{stage.name}-{j}", i)
                       for j in range(1 if stage.gpu else max(1, stage.workers))]
            self.hook.workers(stage.name, [t.native_id for t in threads])

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        t = threading.Thread(target=target, name=name, args=args, daemon=True)
        self._threads.append(t)
        t.start()
        return t

    def close(self) -> None:
        """Stop and join every thread (idempotent). Blocked threads are woken at once:
        ``None`` in every queue ends a waiting worker."""
        if self._forked:
            return
        self._stop.set()
        for i, stage in enumerate(self.stages):
            with self._turn_cv[i]:
                self._turn_cv[i].notify_all()
            for _ in range(1 if stage.gpu else max(1, stage.workers)):
                self._queues[i].put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(_JOIN_S)
        self._threads.clear()

    # ---- consumer ---------------------------------------------------------------------
    def _next_item(self) -> Item | None:
        """The source's next payload as an item (``None`` at its end); an error of the
        source reaches the consumer like a stage error."""
        item = Item(self._fed, None)
        try:
            item.payload = next(self._source)
        except StopIteration:
            self._source, self._source_done = iter(()), True
            return None
        except Exception as exc:
            item.error, item.stage = exc, "order"
            self._failed_seq = item.seq
            self._source_done = True
        self._fed += 1
        return item

    def _top_up(self) -> None:
        while not self._source_done and self._in_flight < self._window and self._failed_seq is None:
            item = self._next_item()
            if item is None:
                return
            self._queues[0].put(item)  # it holds at most window items
            self._in_flight += 1

    def get(self) -> Item | None:
        """The next item in source order (check ``item.error``); ``None`` once closed or
        when the source is exhausted."""
        if self._forked or self._stop.is_set():
            return None
        if self.inline:
            if self._source_done or self._failed_seq is not None:
                return None
            item = self._next_item()
            if item is not None:
                for i in range(len(self.stages)):
                    self._apply(i, item, None)
            return item
        self._top_up()
        if self._in_flight == 0:
            return None
        q = self._queues[-1]
        while True:
            try:
                item = q.get(timeout=_POLL)
                break
            except queue.Empty:
                if self._stop.is_set():
                    return None
        self._in_flight -= 1
        self._top_up()
        return item

    # ---- threads ----------------------------------------------------------------------
    def _put(self, q: queue.SimpleQueue, item: Item) -> bool:
        """Pass ``item`` on; False once closed."""
        if self._stop.is_set():
            return False
        q.put(item)
        return True

    def _work(self, i: int) -> None:
        inq, outq, cv = self._queues[i], self._queues[i + 1], self._turn_cv[i]
        hook, name = self.hook, self.stages[i].name
        stream = None
        idle = time.perf_counter()
        while not self._stop.is_set():
            try:
                item = inq.get(timeout=_POLL)
            except queue.Empty:
                continue
            if item is None:  # woken by close()
                return
            hook.taken(name, inq.qsize(), time.perf_counter() - idle)
            stream = self._apply(i, item, stream)
            done = time.perf_counter()
            with cv:
                while self._turn[i] != item.seq:
                    if self._stop.is_set():
                        return
                    cv.wait(_POLL)
            idle = time.perf_counter()
            hook.passed(name, item.seq, idle - done)
            if not self._put(outq, item):
                return
            item = None  # an idle worker keeps no batch (nor its buffers) alive
            with cv:
                self._turn[i] += 1
                cv.notify_all()

    def _apply(self, i: int, item: Item, stream: Any) -> Any:
        """Run stage ``i`` on ``item`` unless an earlier stage or item failed; an error
        travels with the item. Returns the stage's CUDA stream (made on first use by a
        GPU stage's worker)."""
        stage = self.stages[i]
        failed = self._failed_seq
        if item.error is not None or (failed is not None and item.seq >= failed):
            return stream
        self.hook.started(stage.name)
        t0 = time.perf_counter()
        try:
            if stage.gpu:
                stream = self._run_gpu(stage, item, stream)
            else:
                if item.event is not None:
                    item.event.synchronize()
                    item.event = None
                item.payload = stage.fn(item.payload)
        except Exception as exc:  # handed to the consumer in order, see get()
            item.error, item.stage = exc, stage.name
            if self._failed_seq is None or item.seq < self._failed_seq:
                self._failed_seq = item.seq
        self.hook.done(stage.name, item.seq, t0, time.perf_counter())
        return stream

    def _run_gpu(self, stage: Stage, item: Item, stream: Any) -> Any:
        cp = require("cupy")
        with cp.cuda.Device(self.device.index):
            if stream is None:  # made on the worker thread, on the loader's device
                stream = cp.cuda.Stream(non_blocking=False)
            if item.event is not None:
                stream.wait_event(item.event)
            held = stage.holds(item.payload) if stage.holds is not None else None
            submitted = time.perf_counter()
            start = stream.record()  # the device time between the two events is the stage's (Stats)
            try:
                with stream:
                    item.payload = stage.fn(item.payload)
            finally:  # also when the stage failed after queuing work
                if held is not None:
                    release_after((stream.ptr,), held, self.device.index)
            item.event = stream.record()
            self.hook.gpu_timed(stage.name, item.seq, submitted, start, item.event)
        return stream
