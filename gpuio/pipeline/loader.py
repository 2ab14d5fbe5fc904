"""``gpuio.Loader``: batches from a ``SampleIndex`` for a training loop.

    loader = gpuio.Loader(index, 256, ops=[...], device="cuda", shuffle=True,
                          rank=rank, world_size=world_size)
    for epoch in range(epochs):
        for batch in loader:            # one pass = one epoch
            images, labels = batch["image"], batch["label"]

Stages (``gpuio.pipeline._executor``): ``read`` (the batch's extents with ``gpuio.storage.read_fields``),
``parse`` (when the index has a parser), one stage per op, ``collate`` (its own stage on a
GPU, part of the last stage on the CPU); they run
concurrently on threads, several batches in flight, and batch ``k`` is always yielded
``k``-th. Sample order and sharding follow ``gpuio.pipeline.order`` (see ``Loader``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from gpuio import config
from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device, check_cuda, parse_device, require
from gpuio.errors import BufferBudgetError, ConfigError, DataError, PipelineError
from gpuio.index import SampleIndex
from gpuio.pipeline import _frameworks
from gpuio.pipeline._collate import Collate
from gpuio.pipeline._executor import Executor, Stage
from gpuio.pipeline._stats import Autotune, PipelineStats, Verdict, cpu_budget_parts, verdict
from gpuio.pipeline._opfields import check_op_fields, consumed_fields, flat_ops, image_fields
from gpuio.pipeline.order import ORDER_VERSION, EpochOrder, EpochPlan, epoch_order
from gpuio.storage import Reader, learn_lengths, read_fields
from gpuio.storage._fielddecode import host_decoded_fields
from gpuio.storage.buffers import BufferPool
from gpuio.storage import remote
from gpuio.storage.remote import is_remote

__all__ = ["Loader"]

_MAX_ERRORS = 10  # first skipped-sample errors kept for stats()
# A read-only CPU pass whose consumer spent less than this share of the last pass on its
# own work (between batches) runs on the consumer's thread: reading ahead could hide at
# most that share, and handing each batch between threads costs more than that where
# cores are few (bench/loader.py measures both).
_INLINE_BELOW = 0.1
_AHEAD_BATCHES = 256  # batches a pass over remote data draws ahead of its reads, at most


class _Work:
    """One batch on its way through the stages."""

    __slots__ = ("k", "epoch", "src", "index", "data", "batch", "held")

    def __init__(self, k: int, epoch: int, src: np.ndarray, index: np.ndarray) -> None:
        self.k = k
        self.epoch = epoch
        self.src = src  # samples to read (a padding row reads the sample it copies)
        self.index = index  # dataset position per row, -1 for padding rows
        self.data: dict[str, Any] = {}
        self.batch: Batch | None = None
        self.held = (0, 0)  # bytes read of the host fields, of the device fields

    def keep(self, rows: np.ndarray) -> None:
        """Keep only ``rows`` (positions) in src, index and the fields read so far."""
        self.src, self.index = self.src[rows], self.index[rows]
        for name, col in self.data.items():
            self.data[name] = [col[r] for r in rows.tolist()] if isinstance(col, list) else col[rows]


class Loader:
    """Iterates batches of ``index``: dicts of fields plus ``index``.

    Args:
        index: the dataset (a ``SampleIndex`` from ``gpuio.formats``).
        batch_size: rows per batch (per rank).
        fields: fields to load (default: all of ``index.fields``, except that encoded
            bytes a decoder turns into another field, e.g. ``data`` into ``image``, are
            not handed over unless named here). ``"index"`` is reserved. An op reading
            a field that neither these nor an earlier op give is an error here, at once.
            A dict renames: ``{"data": "jpg", "label": "cls"}`` loads the index's
            ``jpg`` and ``cls`` as ``data`` and ``label`` (ops and batches see the new
            names), so one loader serves every format. With the default fields, a
            decoder reading ``data`` from an index without one (``ops.decode_image()``
            on a webdataset of ``jpg``, a TFRecord of ``image/encoded``) reads the
            index's one image field, where it has exactly one.
        ops: ops applied in order (``gpuio.batch.Op``); an op's ``host_inputs`` names
            extent fields that must be read into host (pinned) memory; other extent
            fields land on ``device`` (kvikio on a GPU). On the CPU the ops run as one
            stage; on a GPU each decoder (an op with ``host_inputs``) is a stage and
            each run of ops between decoders one ``ops.Compose`` stage, fused into one
            kernel.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        output: ``"torch"``, ``"jax"`` or ``"tensorflow"`` (that framework's tensors by
            DLPack, over the same memory: no copy) or ``"numpy"`` (NumPy/CuPy arrays as
            they are); see ``gpuio.pipeline._frameworks``. The framework is imported here, so a
            missing one is reported when the loader is made.
        shuffle, seed: a global permutation of ``len(index)`` per epoch keyed by
            ``(seed, epoch)``, evaluated per position (``gpuio.pipeline.order``): each
            rank computes only the positions it reads.
        rank, world_size: this process's shard (see below).
        last_batch: ``"partial"``, ``"drop"`` or ``"pad"`` (see below).
        prefetch: finished batches that may wait for the consumer beyond one per stage
            worker. Besides the batch the consumer holds, at most ``prefetch`` plus the
            stages' workers (``threads`` per CPU stage, one per GPU stage, one reader)
            batches are in flight, and the next batch is under way while the consumer
            holds one. With none, a stage waits for the consumer to take a batch before it
            gets the next (a thread round trip per batch); more absorbs a consumer whose time per batch jumps, at
            the cost of a batch of buffers each. A loader that only reads (no ``ops``, no
            parsed fields) on the CPU reads a pass on the consumer's thread instead, with
            no read-ahead, when its consumer spent under 10% of the last complete pass
            between batches: reading ahead could hide no more than that, and the
            hand-off between threads costs more on small machines. It reads ahead
            again from the pass after one whose consumer worked longer. ``"auto"`` (the
            default; ``None`` is the same) starts at 1 and deepens online: every 8 batches
            in which the consumer waited 5% or more of its step time while no stage's
            workers and not the process's cores were saturated, it doubles, up to the
            batches the buffer budget holds (``buffer_budget``; it is never exceeded);
            it stops when the consumer no longer waits, a stage saturates or the budget
            binds. ``stats()["tuning"]`` lists each decision and why (also a log line of
            the ``gpuio`` logger); an integer is kept as it is.
        threads: worker threads per CPU stage, or ``"auto"`` (the default; ``None`` is
            the same): the cores this process may use, from its affinity mask, its
            cgroup's CPU quota and ``torchrun``'s ``LOCAL_WORLD_SIZE`` (the processes on
            this node share them); ``stats()["threads"]`` says what was chosen and from
            which figures.
        on_error: ``"raise"`` (the first bad sample stops the pass with a
            ``PipelineError``) or ``"skip"`` (bad samples are dropped from their batch,
            counted and reported by ``stats()``).
        trace: a path: write a timeline of the first pass's first 100 batches there
            (``trace()``).

    Output: a dict per batch. A field whose rows are arrays of one shape and dtype is
    stacked into one array with a leading batch axis, on ``device``, and with
    ``output="torch"`` handed over as a tensor by DLPack (no copy): arrays a format
    decodes (``formats.numpy``'s ``data``, webdataset's ``npy``) and scalars (labels,
    webdataset's ``cls``) alike. Raw bytes of an
    extent field (1-D uint8 rows, as read) and the index's ``Ragged`` fields (boxes,
    keys) stay lists, one value per row, whatever the rows of one batch happen to be,
    as the stages made them (NumPy/CuPy arrays, ``str``): no tensor per sample. ``batch["index"]`` (int64, on ``device``) is each row's dataset position, -1 for
    a padding row.

    Order and sharding, with ``N = len(index)``, ``B = batch_size``, ``W = world_size``
    and ``G = W * B``: the epoch's order (``arange(N)`` or the permutation above) is cut
    into global steps of ``G`` samples, and in step ``k`` rank ``r`` gets the contiguous
    slice ``order[k*G + r*B : k*G + (r+1)*B]``. The ``M = N % G`` samples left over are
    split into ``W`` contiguous shares in rank order (the first ``M % W`` ranks take one
    more, as ``np.array_split``). ``"drop"`` drops them (``N // G`` batches per rank,
    every sample at most once). ``"partial"`` gives each rank one last batch with its
    share, or one padding row when its share is empty (only when ``M < W``).
    ``"pad"`` fills each rank's last batch with padding rows up to ``B``. Padding row
    ``i`` of a batch carries the data and augmentation draws of ``order[i % N]``, with
    ``index`` -1. Every rank yields ``len(loader)`` batches per epoch, and across ranks
    every sample is a real row exactly once per epoch (``"partial"``, ``"pad"``). Under
    ``on_error="skip"`` a batch may have fewer rows (even none) but is still yielded.

    Epochs: each complete ``for`` over the loader is one epoch, and the epoch then
    advances by one; ``set_epoch(e)`` sets it (as ``DistributedSampler.set_epoch``). A
    ``for`` that was left early restarts its epoch at batch 0 the next time, unless
    ``load_state_dict`` set a position. ``state_dict()`` taken between batches and
    given to ``load_state_dict`` (of this or a new loader with the same settings) makes
    the next ``for`` yield exactly the remaining batches of that epoch (the same rows,
    the same random draws: ops draw from ``batch.rng(row, salt)``, seeded by
    ``(seed, epoch, sample)``), after which the epoch advances as usual.

    Elastic resume: a state records the epoch's consumed part as a prefix of its global
    order: ``k*G`` positions after ``k`` full steps, all ``N`` once the epoch's last
    step is out (the partial last step, and under ``"drop"`` the samples it leaves
    out, count as consumed; padding rows consume nothing). A loader with another
    ``world_size``, ``batch_size`` or ``last_batch`` (same index, ``shuffle`` and
    ``seed``) resumes from it: the rest of the epoch, positions ``consumed .. N-1``,
    is cut by the rule above with the new ``B`` and ``W`` (``N - consumed`` in place of
    ``N``), so every sample not yet seen is a real row exactly once across the new
    ranks, each rank yielding the same number of batches, with the random draws each
    sample would have had; later epochs run as usual. Every rank saves the same
    position at the same step (only ``rank`` and ``skipped`` differ); a list of states
    that disagree, a state whose numbers do not add up, or one saved under gpuio's
    older order (no ``order_version``) is a ``ConfigError``. Given every rank's state,
    new rank ``r`` goes on counting ``skipped`` samples from the counts of the saved
    ranks ``q`` with ``q % world_size == r``.

    Threads: the stage threads and the storage readers' I/O threads start with the
    first pass and are kept from one completed pass to the next (no start-up per
    epoch); they end with ``close()``, with a pass left early (``break``, an
    exception, Ctrl-C, the iterator garbage collected) or when the loader is garbage
    collected (they hold no reference to it).

    On a GPU the consumer's current stream (torch's, or CuPy's for ``output="numpy"``)
    waits on each batch's last CUDA event before the batch is handed over, and a
    batch's GPU memory is reused only after that stream has passed the point where the
    consumer dropped the batch (``gpuio.storage._deferred``): use a batch on that stream, or
    order other streams after it (``torch.Tensor.record_stream``).
    """

    def __init__(self, index: SampleIndex, batch_size: int, *,
                 fields: Sequence[str] | dict[str, str] | None = None, ops: Sequence[Any] | Any = (),
                 device: str | Device = "cpu", output: str = "torch",
                 shuffle: bool = False, seed: int = 0, rank: int = 0, world_size: int = 1,
                 last_batch: str = "partial", prefetch: int | str | None = "auto",
                 threads: int | str | None = "auto",
                 on_error: str = "raise", trace: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(index, SampleIndex):
            raise ConfigError(f"index must be a gpuio SampleIndex, got {type(index).__name__}")
        self.index = index
        self.plan = EpochPlan(len(index), batch_size, world_size, rank, last_batch)
        self.batch_size, self.rank, self.world_size, self.last_batch = batch_size, rank, world_size, last_batch
        self.device = parse_device(device)
        check_cuda(self.device)
        self._framework = _frameworks.load(output)  # a missing framework is reported here
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error={on_error!r}; choose 'raise' or 'skip'")
        auto_prefetch = prefetch is None or prefetch == "auto"
        if auto_prefetch:  # read-ahead from one batch beyond the workers, deepened while the consumer waits
            prefetch = 1
        elif isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch must be an integer >= 0 or 'auto', got {prefetch!r}")
        if threads is None or threads == "auto":  # the cores this process may use
            budget = cpu_budget_parts()
            threads = budget["cores"]
            self._threads_why = {"threads": threads, "auto": True, **budget}
        elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be a positive integer or 'auto', got {threads!r}")
        else:
            self._threads_why = {"threads": threads, "auto": False}
        self.output, self.on_error, self.prefetch, self.threads = output, on_error, prefetch, threads
        self.shuffle, self.seed = bool(shuffle), int(seed)
        if callable(ops):  # one op (or a Compose) for the whole chain
            ops = [ops]
        # the fields as ops and batches name them -> the index's fields they hold
        self._source = _field_sources(index, fields, ops)
        self.fields = tuple(self._source)
        unknown = [f for f in self._source.values() if f not in index.fields]
        if unknown:
            raise ConfigError(f"unknown field(s) {unknown}; this index has {list(index.fields)}")
        if "index" in self.fields:
            raise ConfigError("field name 'index' is reserved for the dataset positions of a batch's rows; "
                              "pass fields= without it")
        for op in ops:
            if not callable(op):
                raise ConfigError(f"ops must be callables batch -> batch, got {op!r}")
        check_op_fields(ops, self.fields, index)
        self._notes = consumed_fields(ops, self.fields) if fields is None else {}
        self.ops = _group_ops(ops, self.device.is_cuda)
        parser = index.parser
        self._parsed = tuple(f for f in self._source.values()
                             if parser is not None and f in parser.fields and f not in index.extents)
        read = [f for f in self._source.values() if f not in self._parsed]
        if self._parsed and parser.source not in read:
            read.append(parser.source)
        host = {self._source.get(f, f) for op in self.ops for f in getattr(op, "host_inputs", ())}
        host.update(host_decoded_fields(index))  # int, str, json ... decode on the host
        if self._parsed:
            host.add(parser.source)
        on_device = self.device.is_cuda
        self._dev_fields = tuple(f for f in read if on_device and f in index.extents and f not in host)
        self._host_fields = tuple(f for f in read if f not in self._dev_fields)
        self._pool = BufferPool(config.get("buffer_budget"))  # the setting in force here and now
        learn_lengths(index, [f for f in read if f in index.extents])  # the buffer bound takes the largest extents
        self._max_in_flight = self._batches_that_fit() - 1  # the consumer holds one more
        # bytes of coming batches whose remote blocks are fetched into the node-local cache ahead
        self._ahead_bytes = config.get("remote_readahead") if is_remote(index.files) and config.get("remote_cache") \
            else 0
        # the last stage (it holds no reference to the loader: the stage threads must not keep it alive)
        self._collate = Collate(index, self._source, self._notes, self.device, output, self._framework)
        names = [getattr(op, "name", None) or _op_name(op) for op in self.ops]
        self._op_names = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
        self._epoch = 0
        self._plan = self.plan  # the plan of the epoch's running (or last) pass
        self._pos = 0  # batches of self._plan handed to the consumer
        self._resume: EpochPlan | None = None  # the next pass's plan, set by load_state_dict
        self._executor: Executor | None = None  # kept across completed passes
        self._wanted = 0  # batches in flight the stages and prefetch want (the budget may allow fewer)
        self._window = 0  # batches in flight the last pass kept, at most
        self._passing = False  # a pass is between its first and last batch
        self._inline = False  # the next pass reads on the consumer's thread (see _INLINE_BELOW)
        self._readers: dict[str, Reader] = {}
        # where the host and the device fields' bytes lie while in flight
        self._where_read = ("pinned" if self.device.is_cuda else "host", "gpu")
        self._lock = threading.Lock()
        self._stats = PipelineStats()  # the hook every stage reports to (stats(), report(), trace())
        # the op stage that splits its batches' decodes into parts (decode_parts), on the CPU
        decoding = None if self.device.is_cuda else next(
            (name for op, name in zip(self.ops, self._op_names) if getattr(op, "uses_decode_parts", False)), None)
        parts = config.get("decode_parts")  # the setting in force here and now, passed to the op stages' threads
        auto_parts = parts == "auto" and decoding is not None
        self._parts = 1 if parts == "auto" else parts  # "auto": from a part per batch, split while cores idle
        self._tuner = Autotune(self._stats, prefetch if auto_prefetch else None, self._parts if auto_parts else None,
                               decoding) if auto_prefetch or auto_parts else None
        self._handed = 0  # batches handed to the consumer, every pass (the tuner's decisions name them)
        if trace is not None:
            self.trace(trace)
        self._flight: deque[tuple[int, int]] = deque()  # (host, device) bytes of each batch read, not handed over
        if is_remote(index.files):
            remote.watch_fetches(self._stats)
        self._samples = 0
        self._bytes = 0
        self._seconds = 0.0
        self._skipped = 0
        self._errors: list[str] = []
        self._warned = 0
        self._warnings: list[str] = []

    # ---- epochs and state ---------------------------------------------------------------
    def __len__(self) -> int:
        """Batches the running pass yields in all, or else the next one: an epoch's
        batches on this rank (the same on every rank), or after ``load_state_dict`` the
        batches left of the resumed epoch, so that a progress bar counts right."""
        if self._passing:
            return len(self._plan)
        return len(self.plan if self._resume is None else self._resume)

    @property
    def epoch(self) -> int:
        """The epoch the next pass runs (it advances when a pass completes)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass (its order and random draws), from batch 0."""
        self._epoch, self._plan, self._pos, self._resume = int(epoch), self.plan, 0, None

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: the epoch and its consumed prefix of the global
        order (``gpuio.pipeline.order``), the same on every rank at the same step, plus
        this rank's ``rank`` and ``skipped`` count."""
        plan, k = (self._resume, 0) if self._resume is not None else (self._plan, self._pos)
        with self._lock:
            skipped = self._skipped
        return {"order_version": ORDER_VERSION, "epoch": self._epoch, "consumed": plan.consumed(k),
                "samples": len(self.index), "shuffle": self.shuffle, "seed": self.seed,
                "start": plan.start, "batch": k, "batch_size": self.batch_size,
                "world_size": self.world_size, "last_batch": self.last_batch,
                "rank": self.rank, "skipped": skipped}

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Resume from ``state_dict()`` of this loader, of a loader with other
        ``world_size``, ``batch_size`` or ``last_batch``, or from the list of every
        rank's states: the next pass yields this rank's share of the epoch's samples not
        yet consumed, each a real row exactly once across the new ranks. The states of a
        list must describe one position. This rank's ``skipped`` count goes on from the
        counts of the saved ranks ``q`` with ``q % world_size == rank``."""
        states = [state] if isinstance(state, dict) else list(state)
        if not states or not all(isinstance(s, dict) for s in states):
            raise ConfigError("load_state_dict takes a state_dict() or a non-empty list of them")
        for s in states:
            if "order_version" not in s:
                raise ConfigError(
                    "this state was saved under gpuio's older epoch order (no 'order_version' key: a full "
                    f"PCG64 permutation per epoch); the current order is version {ORDER_VERSION}, so the "
                    "state's position names other samples and cannot be resumed; restart its epoch with "
                    "set_epoch(state['epoch'])")
            if s["order_version"] != ORDER_VERSION:
                raise ConfigError(f"state has order_version={s['order_version']!r}; this gpuio resumes "
                                  f"order version {ORDER_VERSION} only")
        first = states[0]
        position = [k for k in first if k not in ("rank", "skipped")]
        for s in states[1:]:
            for key in position:
                if s.get(key) != first[key]:
                    raise ConfigError(
                        f"the states do not describe one position: rank {first.get('rank')} saved "
                        f"{key}={first[key]!r}, rank {s.get('rank')} saved {key}={s.get(key)!r}; "
                        "give the states every rank saved at the same step")
        mine = {"samples": len(self.index), "shuffle": self.shuffle, "seed": self.seed}
        for key, value in mine.items():
            if first.get(key) != value:
                raise ConfigError(f"state was saved with {key}={first.get(key)!r}, this loader has "
                                  f"{key}={value!r}; the epoch's order would differ")
        try:
            saved = EpochPlan(len(self.index), first["batch_size"], first["world_size"], 0,
                              first["last_batch"], first["start"])
            consumed = saved.consumed(int(first["batch"]))
            recorded, epoch = first["consumed"], int(first["epoch"])
        except KeyError as missing:
            raise ConfigError(f"state lacks {missing}; pass a Loader's state_dict()") from None
        if recorded != consumed:
            raise ConfigError(
                f"inconsistent state: {first['batch']} batches of {first['batch_size']} on "
                f"{first['world_size']} ranks from position {first['start']} consume {consumed} samples, "
                f"the state says consumed={recorded!r}")
        skipped = sum(int(s.get("skipped", 0)) for s in states
                      if int(s.get("rank", 0)) % self.world_size == self.rank)
        self.close()
        self._epoch, self._plan, self._pos = epoch, self.plan, 0
        self._resume = EpochPlan(len(self.index), self.batch_size, self.world_size, self.rank,
                                 self.last_batch, consumed)
        with self._lock:
            self._skipped = skipped

    def _batches_that_fit(self) -> int:
        """How many batches' read buffers the loader's buffer budget holds at once; at
        least two (the batch the consumer holds and the next one being read), else a
        ``BufferBudgetError`` with the numbers, now rather than a stall later."""
        align = 4096 if config.get("o_direct") else 1
        gap = config.get("merge_gap")
        needs = {f: _batch_bytes_bound(self.index.extents[f].length, self.batch_size, gap, align)
                 for f in self._host_fields + self._dev_fields if f in self.index.extents}
        # a device field read without kvikio passes through a host buffer of its size
        charge = sum(self._pool.charge(n) * (2 if f in self._dev_fields else 1) for f, n in needs.items())
        budget = self._pool.budget
        if charge and budget < 2 * charge:
            raise BufferBudgetError(
                f"a batch of {self.batch_size} samples needs up to {charge:,} bytes of read buffers "
                f"({', '.join(f'{f}: {n:,}' for f, n in needs.items())}), and two batches must fit in the "
                f"buffer budget (the one in use and the next being read), but buffer_budget is {budget:,} "
                f"bytes; raise it to at least {2 * charge:,} (gpuio.config.override(buffer_budget=...) or "
                f"GPUIO_BUFFER_BUDGET) or use a smaller batch_size")
        return budget // charge if charge else 1 << 30

    # ---- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._passing:  # one pass at a time: stop one left running
            self.close()
        return self._run(self._epoch)

    def _run(self, epoch: int) -> Iterator[dict[str, Any]]:
        # the plan is taken when the pass starts: until then len() and state_dict() see it unstarted
        plan = self.plan if self._resume is None else self._resume
        self._plan, self._pos, self._resume = plan, 0, None
        ex = self._executor
        if ex is None or not ex.reusable:
            ex = self._start()
        order = epoch_order(len(self.index), self.shuffle, self.seed, epoch)
        works = _works(plan, order, epoch)
        if self._ahead_bytes:  # remote data: the coming batches' blocks go to the node-local cache first
            fields = [("host", f) for f in self._host_fields] + [("device", f) for f in self._dev_fields]
            works = _read_ahead(works, self.index, self._readers, fields, self._ahead_bytes)
        ex.feed(works, inline=self._inline)  # no reference to the loader
        self._passing = True
        completed = False
        stats = self._stats
        self._forget_in_flight()  # batches of a pass left early never reached the consumer
        stats.pass_started()
        t0 = time.perf_counter()
        busy = 0.0  # the consumer's own time, between batches
        try:
            for k in range(len(plan)):
                stats.started("next")
                asked = time.perf_counter()
                with _profiled("gpuio.Loader.next"):
                    item = ex.get()
                    if item is None:  # closed by close()
                        return
                    if item.error is not None:
                        if isinstance(item.error, PipelineError):
                            raise item.error
                        raise self._pipeline_error(item.stage or "?", item.payload, item.error) from item.error
                    (out, real), event, seq = item.payload, item.event, item.seq
                    del item  # while the next batch is awaited, the consumer's hold is the only one
                    stats.started("hand-off")
                    t_hand = time.perf_counter()
                    batch = self._collate.hand_off(out, event)
                    stats.handed(seq, t_hand, time.perf_counter())
                    del out, event
                self._pos += 1
                with self._lock:
                    self._samples += real
                if self._flight:
                    for where, n in zip(self._where_read, self._flight.popleft()):
                        stats.moved(where, -n)
                handed = time.perf_counter()
                stats.waited(seq, asked, handed, first=k == 0)
                if stats.tracer is not None and stats.tracer.done:
                    self._end_trace()
                yield batch
                back = time.perf_counter()
                stats.worked(back - handed)
                busy += back - handed
                del batch
                self._handed += 1
                if self._tuner is not None and not ex.inline:
                    self._tune(ex, k, handed - asked, back - handed)
            completed = True
        finally:
            stats.pass_ended()
            if stats.tracer is not None:
                self._end_trace()
            seconds = time.perf_counter() - t0
            with self._lock:
                self._seconds += seconds
            if self._executor is ex:  # not a pass already stopped by a newer one
                self._passing = False
                if not completed:
                    self.close()
            if completed and self._epoch == epoch and self._plan is plan:
                self._epoch, self._plan, self._pos = epoch + 1, self.plan, 0
            if completed:
                self._inline = (not self.device.is_cuda and len(ex.stages) == 1
                                and busy < _INLINE_BELOW * seconds)

    def _start(self) -> Executor:
        """The stage threads and the readers, started for the first pass (or the first
        after ``close()``) and kept across completed passes."""
        self.close()
        self._open_readers()
        stages = self._stages()
        self._wanted = self.prefetch + sum(1 if s.gpu else s.workers for s in stages)
        window = min(self._wanted, self._max_in_flight)
        self._window = window
        ex = Executor(stages, window=window, device=self.device, hook=self._stats,
                      name=f"gpuio-loader{self.rank}")
        ex.start()
        self._executor = ex
        return ex

    def _tune(self, ex: Executor, k: int, wait: float, work: float) -> None:
        """Tell the tuner of pass batch ``k`` (the first is start-up: it only starts the
        tuner's span); deepen the executor's window as it decides, within the batches the
        buffer budget holds, and split the next batches' decodes into the parts it chose."""
        tuner = self._tuner
        if k == 0:
            tuner.begin(len(self._plan))  # its spans are short enough to settle early in the pass
            return
        workers = self._wanted - self.prefetch
        changes = tuner.batch(self._handed, wait, work, room=self._max_in_flight - workers)
        self._parts = changes.get("decode_parts", self._parts)  # the op stages read it at their next batch
        depth = changes.get("prefetch")
        if depth is None:
            return
        self.prefetch, self._wanted = depth, depth + workers
        self._window = min(self._wanted, self._max_in_flight)
        ex.deepen(self._window)

    def load(self, samples: Sequence[int] | np.ndarray, epoch: int | None = None) -> dict[str, Any]:
        """One batch of ``samples`` (dataset positions, one row each, in this order) on the
        calling thread: read, parsed, put through the ops and collated as a pass does it,
        with the random draws of ``(seed, epoch, sample)`` (``epoch`` default: the
        loader's), so a sample comes out as it would in a pass of that epoch. This is the
        way to run a loader's pipeline on samples that another scheduler chose (a Ray
        read task: ``gpuio.ray``); it neither moves the loader's position nor starts its
        threads. A bad sample is a ``PipelineError`` naming it (under ``on_error="skip"``
        its row is dropped and counted in ``stats()``). CPU loaders only: a GPU pass hands
        batches over between CUDA streams, which a call on the consumer's thread has not."""
        if self.device.is_cuda:
            raise ConfigError("Loader.load runs on the CPU only; make the loader with device='cpu' "
                              "(GPU batches come from iterating the loader)")
        src = np.asarray(samples)
        n = len(self.index)
        if src.ndim != 1 or (src.size and src.dtype.kind not in "iu"):
            raise ConfigError(f"samples must be a 1-D sequence of dataset positions, got {samples!r}")
        src = src.astype(np.int64)
        if src.size and (src.min() < 0 or src.max() >= n):
            bad = int(src.min()) if src.min() < 0 else int(src.max())
            raise ConfigError(f"sample {bad} out of range 0..{n - 1}")
        w = _Work(0, self._epoch if epoch is None else int(epoch), src, src.copy())
        if not self._readers:
            self._open_readers()
        steps = [("read", self._read)] + ([("parse", self._parse)] if self._parsed else [])
        steps += [(name, functools.partial(self._run_op, op, name)) for op, name in zip(self.ops, self._op_names)]
        for name, step in steps:
            try:
                w = step(w)
            except PipelineError:
                raise
            except Exception as err:  # named as a pass names it (stage, sample, file)
                raise self._pipeline_error(name, w, err) from err
        out, _ = self._collate(w)
        return self._collate.hand_off(out, None)

    def _open_readers(self) -> None:
        if self._host_fields:
            self._readers["host"] = Reader("cpu", thread_name="gpuio-loader-read", pool=self._pool)
        if self._dev_fields:
            self._readers["device"] = Reader(self.device, thread_name="gpuio-loader-read", pool=self._pool)

    def close(self) -> None:
        """Stop the running pass, if any, and end every loader thread (they have ended on
        return); the next pass starts them again."""
        ex, self._executor, self._passing = self._executor, None, False
        if ex is not None:
            ex.close()  # joins the stage threads before the readers go
        _close_readers(self._readers)

    def __del__(self) -> None:
        ex = getattr(self, "_executor", None)
        if ex is not None:
            ex.close()
        _close_readers(getattr(self, "_readers", {}))
        stats = getattr(self, "_stats", None)
        if stats is not None and stats.tracer is not None:  # a capture never finished: no file
            from gpuio.ops._cpu_pool import watch_parts

            watch_parts(stats.tracer.on_part, on=False)

    # ---- stages ------------------------------------------------------------------------
    def _stages(self) -> list[Stage]:
        """The stages, calling the loader through a weak reference: the threads, kept
        across passes, must not keep the loader alive (collecting it ends them)."""
        cpu_workers = self.threads
        # one read worker: a batch's reads already run on io_threads (gpuio.config)
        stages = [Stage("read", _weak(self._read_counted), workers=1)]
        if self._parsed:
            stages.append(Stage("parse", _weak(self._parse), workers=cpu_workers))
        for op, name in zip(self.ops, self._op_names):
            stages.append(Stage(name, functools.partial(_weak(self._run_op), op, name), workers=cpu_workers,
                                gpu=self.device.is_cuda, holds=_columns))
        if self.device.is_cuda:  # its own stream: the hand-off waits on its event
            stages.append(Stage("collate", self._collate, workers=1, gpu=True, holds=_columns))
        else:  # on the CPU, collating in the last stage's worker saves a queue hop
            last = stages[-1]
            stages[-1] = Stage(last.name, _then(last.fn, self._collate), last.workers)
        return stages

    def _read_rows(self, src: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {}
        readers = self._readers
        stacked = not self.ops  # no op takes the rows one by one: the collated array at once
        if self._host_fields:
            out.update(read_fields(self.index, src, self._host_fields, reader=readers["host"], stacked=stacked))
        if self._dev_fields:
            out.update(read_fields(self.index, src, self._dev_fields, reader=readers["device"], stacked=stacked))
        return out

    def _read(self, w: _Work) -> _Work:
        w.data = self._without_bad_samples(w, "read", lambda rows: self._read_rows(w.src[rows]))
        w.held = tuple(sum(int(self.index.extents[f].length[w.src].sum()) for f in fields if f in self.index.extents)
                       for fields in (self._host_fields, self._dev_fields))
        with self._lock:
            self._bytes += sum(w.held)
        if not self._parsed:
            self._make_batch(w)
        return w

    def _read_counted(self, w: _Work) -> _Work:
        """``_read`` in a pass: the batch's bytes count as in flight until it is handed over."""
        w = self._read(w)
        self._flight.append(w.held)
        for where, n in zip(self._where_read, w.held):
            self._stats.moved(where, n)
        return w

    def _forget_in_flight(self) -> None:
        while self._flight:
            for where, n in zip(self._where_read, self._flight.popleft()):
                self._stats.moved(where, -n)

    def _parse(self, w: _Work) -> _Work:
        parser = self.index.parser
        ext = self.index.extents[parser.source]

        def parse(rows: np.ndarray) -> dict[str, list[Any]]:
            src = w.src[rows]
            records = [w.data[parser.source][r] for r in rows.tolist()]
            paths = self.index.files.many(ext.file[src])
            return parser.parse(records, src, paths, ext.offset[src])

        values = self._without_bad_samples(w, "parse", parse)
        w.data.update({f: values[f] for f in self._parsed})
        self._make_batch(w)
        return w

    def _without_bad_samples(self, w: _Work, stage: str, attempt: Any) -> Any:
        """``attempt(rows)`` on every row of ``w``. Under ``on_error="skip"``, when it raises
        a ``DataError``, each row is tried alone: the rows that fail are skipped (counted,
        named in ``stats()``) and dropped from ``w``, and the rest tried again together."""
        rows = np.arange(len(w.src))
        try:
            return attempt(rows)
        except DataError:
            if self.on_error != "skip":
                raise
            bad = []
            for j in rows.tolist():  # find the bad samples one by one
                try:
                    attempt(rows[j: j + 1])
                except DataError as one:
                    bad.append(j)
                    self._skip(int(w.src[j]), stage, one)
            if not bad:  # the batch failed but no single sample does: not a sample's fault
                raise
            w.keep(np.delete(rows, bad))
            return attempt(np.arange(len(w.src)))

    def _make_batch(self, w: _Work) -> None:
        data = {f: w.data[src] for f, src in self._source.items()}
        # ops run in collect mode: the loader raises for the first rejected row under "raise"
        seeds = sample_seeds(self.seed, w.epoch, w.src) if self.ops else np.zeros(0, np.uint64)  # no op draws
        w.batch = Batch(data, w.index, seeds, self.device, on_error="skip")
        w.data = {}

    def _run_op(self, op: Any, name: str, w: _Work) -> _Work:
        b = w.batch
        if self.device.is_cuda:  # the stage's stream (the executor made it current)
            cp = require("cupy")
            with cp.cuda.Device(self.device.index):
                b.stream = cp.cuda.get_current_stream()
        with config.override(decode_parts=self._parts):  # this thread's context: the loader's value
            out = op(b)
        b = out if out is not None else b
        # rows rejected by the op (or by ops inside it, which may have dropped them already)
        errors, b.errors[:] = list(b.errors), []
        if errors and self.on_error != "skip":
            index, err = errors[0]
            sample = index if index >= 0 else getattr(err, "sample", None)
            sample = int(sample) if isinstance(sample, (int, np.integer)) else None
            raise self._pipeline_error(name, w, err, sample=sample) from err
        read = getattr(op, "host_inputs", ())  # the fields the op read: where its bad samples are
        for index, err in errors:
            self._skip(index, name, err, read)
        warnings, b.warnings[:] = list(b.warnings), []
        for index, message in warnings:
            self._warn(index, name, message, read)
        b.drop_rejected()
        w.batch = b
        return w

    # ---- errors and stats ------------------------------------------------------------
    def _skip(self, sample: int, stage: str, err: BaseException, fields: Sequence[str] = ()) -> None:
        where = self._where(sample, err, fields)
        with self._lock:
            self._skipped += 1
            if len(self._errors) < _MAX_ERRORS:
                self._errors.append(f"sample {sample} (stage {stage!r}, {where}): {type(err).__name__}: {err}")

    def _warn(self, sample: int, stage: str, message: str, fields: Sequence[str] = ()) -> None:
        where = self._where(sample, None, fields)
        with self._lock:
            self._warned += 1
            if len(self._warnings) < _MAX_ERRORS:
                self._warnings.append(f"sample {sample} (stage {stage!r}, {where}): {message}")

    def _where(self, sample: int, err: BaseException | None, fields: Sequence[str] = ()) -> str:
        """The file and byte offset of a skipped or warned-of sample: those its error
        names, else where the first of ``fields`` (the fields read) stored for it starts."""
        path, offset = (err.path, err.offset) if isinstance(err, DataError) else (None, None)
        fields = [f for f in (*fields, *self._host_fields, *self._dev_fields) if f in self.index.extents]
        if path is None and fields and 0 <= sample < len(self.index):
            extent = self.index.extent(sample, fields[0])
            path, offset = extent.file, extent.offset
        return f"file {path}" + ("" if offset is None else f" at byte {offset}")

    def _key(self, sample: int) -> Any:
        for name in ("key", "__key__"):
            col = self.index.values.get(name)
            if col is not None:
                value = col[sample]
                return value.item() if isinstance(value, np.generic) else value
        return None

    def _pipeline_error(self, stage: str, w: Any, err: BaseException, sample: int | None = None) -> PipelineError:
        path = getattr(err, "path", None) if isinstance(err, DataError) else None
        if sample is None and isinstance(w, _Work):
            sample = _locate(self.index, w.src, self._host_fields + self._dev_fields, err)
        if sample is None and isinstance(err, DataError) and isinstance(err.sample, (int, np.integer)):
            sample = int(err.sample)
        if path is None and sample is not None and sample >= 0:
            extent_fields = [f for f in self._host_fields + self._dev_fields if f in self.index.extents]
            if extent_fields:
                path = self.index.extent(sample, extent_fields[0]).file
        key = self._key(sample) if sample is not None and sample >= 0 else None
        rank = f"rank {self.rank} of {self.world_size}: " if self.world_size > 1 else ""  # which process of a job
        return PipelineError(f"{rank}{type(err).__name__}: {err}", stage=stage, sample=sample, key=key, path=path)

    def stats(self) -> dict[str, Any]:
        """Throughput and where the time goes, over every pass so far; safe to call from
        any thread while a pass runs, and cheap enough to be always on.

        ``samples_per_s`` and ``bytes_per_s`` (bytes read from storage) are over the
        time passes were running. ``stages`` maps each stage (``read``, ``parse``, each op
        stage, ``collate`` on a GPU) to its ``batches``, ``workers``, ``seconds`` of work
        (all workers together), ``ms_per_batch``, ``busy`` (seconds over workers times the
        passes' wall time: 1.0 is every worker busy all the time), ``p50_ms``/``p99_ms``
        latency per batch, ``queue_mean`` (its input queue's length at each take),
        ``starved_s`` (its workers' wait for input, between passes included),
        ``blocked_s`` (finished batches' wait for their turn to go on, in order),
        ``on_core_s`` and ``waited_for_core_s`` (its threads' time on a core, and ready
        to run with none free, from Linux's schedstat); a GPU stage adds the same of
        its device time, from CUDA events on its stream
        (``gpu_seconds``, ``gpu_busy``, ``gpu_p50_ms``, ``gpu_p99_ms``). ``consumer``:
        the training loop's ``wait_s`` in ``next()`` (hand-off included; each pass's
        first batch apart, in ``start_up_s``) and ``work_s`` between batches, each with
        p50/p99 per batch, ``input_share``, the wait's share of the two, and
        ``hand_off_s`` with p50/p99, the part of the wait that hands a batch to its
        framework (and on a GPU to the consumer's stream). ``remote``:
        the ranged GETs of object storage (requests, bytes, seconds, p50/p99 per GET,
        retries included). ``bytes_in_flight``: bytes
        read and not yet handed over, by where they lie (``host``, ``pinned``, ``gpu``),
        and ``peak_bytes_in_flight``; ``threads``: the threads per CPU stage and, where
        ``"auto"`` chose them, the figures it took (``cores``, ``affinity``, ``quota``,
        ``local_world_size``); ``prefetch``: the read-ahead depth in force,
        ``decode_parts`` the parts a batch's JPEG decodes are split into (the setting
        in force when the loader was made, ``"auto"`` tuned from 1) and ``tuning`` the
        decisions of ``prefetch="auto"`` and ``decode_parts="auto"`` (``batch``:
        batches handed over by then, ``setting``, ``from``, ``to``, ``why``); ``buffers``: bytes the loader's buffer pool holds
        (read buffers, in use and cached) and its ``budget``. ``cpu``: the process's CPU
        seconds during passes, the ``cores`` it may use (affinity, cgroup quota,
        ``torchrun``'s local world size), their ``busy`` share, ``waited_for_cores_s``
        (the stages' threads' time ready to run with no core free), ``parts`` (the same
        two figures of the ops' part pool) and ``machine_busy`` (the share of the
        machine's CPU time busy with any process). ``queues``: batches
        waiting before each stage now; ``window``: the most batches the running pass
        keeps in flight; ``inline``: whether the last pass ran on the consumer's thread
        (see ``prefetch``); ``consumer_wait_s``: all the consumer's waits, start-ups included. ``skipped``
        counts bad samples dropped under ``on_error="skip"`` and ``errors`` holds the
        first few of them, each naming the sample, its file and byte offset; ``warned``
        counts samples decoded despite a decoder's warning (a JPEG libjpeg warns about,
        decoded as Pillow decodes it) and ``warnings`` names the first few.
        """
        figures = self._stats.snapshot()
        with self._lock:
            seconds = self._seconds
            ex = self._executor
            snap = ex.snapshot() if ex is not None else {"queues": {}, "window": 0}
            return {
                "samples": self._samples,
                "bytes": self._bytes,
                "seconds": round(seconds, 6),
                "samples_per_s": self._samples / seconds if seconds else 0.0,
                "bytes_per_s": self._bytes / seconds if seconds else 0.0,
                **figures,
                "buffers": {"held": self._pool.held_bytes, "budget": self._pool.budget},
                "threads": dict(self._threads_why),
                "prefetch": self.prefetch,
                "decode_parts": self._parts,
                "tuning": list(self._tuner.decisions) if self._tuner is not None else [],
                "queues": snap["queues"],
                "consumer_wait_s": round(figures["consumer"]["wait_s"] + figures["consumer"]["start_up_s"], 6),
                "window": snap["window"],
                "inline": ex is not None and ex.inline,
                "skipped": self._skipped,
                "errors": list(self._errors),
                "warned": self._warned,
                "warnings": list(self._warnings),
            }


    def trace(self, path: str | os.PathLike[str], batches: int = 100) -> None:
        """Capture a timeline of the next ``batches`` batches the loop takes and write it to
        ``path`` as Chrome Trace Event JSON (open it in https://ui.perfetto.dev or
        chrome://tracing) once they are taken, or when the pass ends first: a track per
        stage thread, per thread of the ops' part pool and per CUDA stream, the
        consumer's waits in ``next()``, counters of queue lengths and bytes in flight,
        and arrows following each batch from its read to the consumer (see
        ``gpuio.pipeline._trace``). On a GPU with the ``nvtx`` package the same spans are
        NVTX ranges in the ``gpuio`` domain (Nsight Systems). ``Loader(..., trace=path)``
        captures the first pass's first 100 batches. A capture costs about as little as
        ``stats()`` (bench/loader.py measures both)."""
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ConfigError(f"batches must be a positive integer, got {batches!r}")
        from gpuio.ops._cpu_pool import watch_parts
        from gpuio.pipeline._trace import Tracer

        tracer = Tracer(path, batches, nvtx=self.device.is_cuda)
        old = self._stats.attach(tracer)
        if old is not None:
            watch_parts(old.on_part, on=False)
        watch_parts(tracer.on_part)

    def _end_trace(self) -> None:
        """Stop the capture and write its file."""
        from gpuio.ops._cpu_pool import watch_parts

        tracer = self._stats.attach(None)
        if tracer is not None:
            watch_parts(tracer.on_part, on=False)
            tracer.write()

    def report(self) -> Verdict:
        """Whether the training loop waits for this loader, and if so why, from
        ``stats()``: the share of its step time spent waiting in ``next()`` (tf.data's
        bands: under 5% not input-bound, 5-20% moderately, above 20% highly), the
        bottleneck stage, the resource that binds it (the consumer; the CPU cores; one
        stage's workers; storage or the network; the GPU; the buffer budget) and what to
        change, with the numbers used (``Verdict``; ``print(loader.report())``)."""
        s = self.stats()
        settings = {name: config.get(name) for name in ("io_threads", "read_parts", "remote_requests",
                                                        "remote_cache")}
        return verdict(s, threads=self.threads, prefetch=self.prefetch, window=self._window, wanted=self._wanted,
                       settings=settings)


def _field_sources(index: SampleIndex, fields: Sequence[str] | dict[str, str] | None,
                   ops: Sequence[Any]) -> dict[str, str]:
    """``{name the ops and batches use: the index field it holds}`` (see ``Loader``'s
    ``fields``)."""
    if isinstance(fields, dict):
        sources = {str(new): str(old) for new, old in fields.items()}
        twice = sorted({old for old in sources.values() if list(sources.values()).count(old) > 1})
        if twice:
            raise ConfigError(f"fields={fields!r} loads {twice} under two names; name each index field once")
        return sources
    if isinstance(fields, str):
        raise ConfigError(f"fields={fields!r}: give a list of field names (fields=[{fields!r}]) or a dict of renames")
    names = index.fields if fields is None else tuple(fields)
    sources = {f: f for f in names}
    reads_data = any(getattr(op, "field", None) == "data" and getattr(op, "host_inputs", ())
                     for op in flat_ops(ops))
    images = image_fields(index)
    if fields is None and reads_data and "data" not in sources and len(images) == 1:
        sources = {("data" if f == images[0] else f): f for f in names}  # the decoder's default finds it
    return sources


def _works(plan: EpochPlan, order: EpochOrder, epoch: int) -> Iterator[_Work]:
    """The batches of one pass; the order is evaluated at this rank's positions only."""
    for k, (src, index) in enumerate(plan.batches(order)):
        yield _Work(k, epoch, src, index)


def _read_ahead(works: Iterator[_Work], index: SampleIndex, readers: dict[str, Reader],
                fields: list[tuple[str, str]], window: int) -> Iterator[_Work]:
    """``works``, drawn ahead of their reads: each batch's extents of ``fields`` (reader
    key, field) go to its reader's ``prefetch`` when drawn (the node-local cache fetches
    their remote blocks in the background), and a batch is yielded once the batches drawn
    after it hold ``window`` bytes (or ``_AHEAD_BATCHES`` batches), or the pass has no more."""
    pending: deque[tuple[_Work, int]] = deque()
    held = 0
    for w in works:
        nbytes = 0
        for key, field in fields:
            reader = readers.get(key)
            if reader is not None and field in index.extents:
                reader.prefetch(index, w.src, field)
                nbytes += int(index.extents[field].length[w.src].sum())
        pending.append((w, nbytes))
        held += nbytes
        while held - pending[0][1] >= window or len(pending) > _AHEAD_BATCHES:
            first, n = pending.popleft()
            held -= n
            yield first
    while pending:
        yield pending.popleft()[0]


def _profiled(name: str) -> Any:
    """A ``torch.profiler`` range named ``name`` where torch is imported (it records only
    inside a running profiler; a few microseconds where none runs), else nothing."""
    torch = sys.modules.get("torch")
    return torch.profiler.record_function(name) if torch is not None else contextlib.nullcontext()


def _weak(method: Any) -> Any:
    """``method``, a bound method of the loader, called through a weak reference to it."""
    ref, func = weakref.ref(method.__self__), method.__func__

    def call(*args: Any) -> Any:
        return func(ref(), *args)

    return call


def _then(first: Any, second: Any) -> Any:
    """``second(first(x))``."""
    return lambda x: second(first(x))


def _close_readers(readers: dict[str, Reader]) -> None:
    """Close and forget the readers (their I/O threads end here)."""
    for r in readers.values():
        r.close()
    readers.clear()


def _batch_bytes_bound(length: np.ndarray, batch_size: int, gap: int, align: int) -> int:
    """The most bytes a read plan of ``batch_size`` of these extents can span: the
    largest extents, plus per read the merge gap and the alignment padding."""
    n = min(batch_size, len(length))
    if n == 0:
        return 0
    largest = np.partition(np.asarray(length, dtype=np.int64), len(length) - n)[len(length) - n:]
    return int(largest.sum()) + n * (gap + 2 * (align - 1))


def _locate(index: SampleIndex, src: np.ndarray, fields: Sequence[str], err: BaseException) -> int | None:
    """The sample a storage error is about, from the file and byte offset it names."""
    if not isinstance(err, DataError):
        return None
    if isinstance(err.sample, (int, np.integer)) and int(err.sample) in set(src.tolist()):
        return int(err.sample)
    if err.path is None:
        return int(src[0]) if len(src) == 1 else None
    for f in fields:
        ext = index.extents.get(f)
        if ext is None:
            continue
        for s in src.tolist():
            if index.files[ext.file[s]] != err.path:
                continue
            lo, n = int(ext.offset[s]), int(ext.length[s])
            if err.offset is None or lo <= err.offset <= lo + n:
                return int(s)
    return None


def _columns(w: _Work) -> list[Any]:
    """A GPU stage's input: the batch's columns as they are before it runs (lists copied)."""
    return [list(col) if isinstance(col, list) else col for col in w.batch.data.values()]


def _op_name(op: Any) -> str:
    inner = getattr(op, "ops", None)
    return "+".join(type(o).__name__ for o in inner) if inner else type(op).__name__


def _group_ops(ops: Sequence[Any], gpu: bool) -> tuple[Any, ...]:
    """Pipeline stages from the ops. On the CPU all ops form one ``ops.Compose`` stage
    (its ``threads`` workers each take a whole batch through the chain; more stages
    would only add hand-offs). On a GPU an op that reads host memory (a decoder) is a
    stage of its own, on its own stream, so that decoding batch N+1 overlaps augmenting
    batch N, and each run of other ops becomes one ``Compose`` stage, which fuses crop,
    resize, flip and normalize into one kernel."""
    if not gpu:
        return tuple(_compose(list(ops)))
    stages: list[Any] = []
    run: list[Any] = []
    for op in ops:
        if getattr(op, "host_inputs", ()):
            stages.extend(_compose(run))
            run = []
            stages.append(op)
        else:
            run.append(op)
    stages.extend(_compose(run))
    return tuple(stages)


def _compose(run: list[Any]) -> list[Any]:
    if len(run) <= 1:
        return run
    from gpuio.ops import Compose

    return [Compose(run)]
