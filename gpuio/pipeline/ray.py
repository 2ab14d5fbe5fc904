"""``gpuio.ray``: a gpuio index as a Ray Dataset, read and processed on a Ray cluster.

    import gpuio.ray
    ds = gpuio.ray.read(index, ops=[ops.decode_image(), ops.resize((224, 224))],
                        shuffle=True, seed=0, epoch=epoch)
    gpu = gpuio.ray.Collate([ops.normalize(mean=..., std=...)], device="cuda", seed=0, epoch=epoch)
    for batch in ds.iter_torch_batches(batch_size=256, collate_fn=gpu, device="cuda"):
        images, labels = batch["image"], batch["label"]

The dataset's rows are the index's samples in the Loader's epoch order
(``gpuio.pipeline.order`` with one rank), from the position a saved state gives (else
0) to the end: one row per sample, each with its dataset position ``index``, and the
fields a ``Loader`` with the same ``fields`` and ``ops`` gives (``image`` once decoded).
A read task is a run of whole batches of ``batch_size`` consecutive order positions
(without ``shuffle``, consecutive samples: neighbouring extents, few large reads); it
reads them with the storage core (local paths, ``s3://`` and ``http(s)://`` URLs) and
runs the ops on the Ray worker, each batch as ``Loader.load`` runs it, so a sample's
pixels and random draws (``(seed, epoch, sample)``) are those of a Loader pass of that
epoch, and batch-mixing ops (``mixup``, ``cutmix``) mix the batches a one-rank Loader
of that ``batch_size`` would.

The GPU end stays on the trainer: ``Collate`` is a ``collate_fn`` for
``iter_torch_batches`` that moves each batch to the trainer's device and runs the ops
left for it there (e.g. normalize and cast after a CPU decode and resize).

Position: the dataset keeps its order (``preserve_order`` is set on its context), so a
consumer that has taken ``rows`` rows has consumed a prefix of the epoch's order;
``state_dict`` turns that count into a Loader state, which ``read(state=...)`` (or a
``Loader``, on any number of ranks) resumes from, each remaining sample exactly once.
A worker that dies mid-read, or a node lost with its raylet, has its task run again by
Ray Data on the workers left (rows the task had already handed out are not handed out
twice: the rows stay the epoch's order, each once); Ray Data retries without limit unless
``ray_remote_args={"max_retries": k}`` bounds it, after which iterating the dataset
raises Ray's ``WorkerCrashedError``. A bad sample stops the ingest with the
``PipelineError`` naming it and its file: a skipped row would shift the row count a
position rests on.

``pip install 'gpuio[ray]'``; ``import gpuio`` does not import this module or Ray.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch, sample_seeds
from gpuio.device import check_cuda, parse_device, require
from gpuio.errors import ConfigError, DependencyError
from gpuio.index import SampleIndex
from gpuio.pipeline import _frameworks
from gpuio.pipeline._collate import stack
from gpuio.pipeline.loader import Loader
from gpuio.pipeline.order import ORDER_VERSION, epoch_order

try:
    import ray
    import ray.data
    from ray.data.block import BlockAccessor, BlockMetadata
    from ray.data.collate_fn import NumpyBatchCollateFn
except ImportError as exc:
    raise DependencyError(f"gpuio.ray needs Ray Data, which could not be imported ({exc}); "
                          "install it with pip install 'gpuio[ray]'") from exc

__all__ = ["Collate", "read", "state_dict"]


def read(index: SampleIndex, *, fields: Sequence[str] | dict[str, str] | None = None,
         ops: Sequence[Any] | Any = (), batch_size: int = 64, shuffle: bool = False, seed: int = 0,
         epoch: int = 0, state: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
         **ray_options: Any) -> ray.data.Dataset:
    """The samples of ``index`` as a ``ray.data.Dataset`` (module docstring).

    Args:
        index: the dataset (a ``SampleIndex``; put once into Ray's object store).
        fields, ops: as the ``Loader``'s; they are checked here, at once. The ops run on
            the Ray workers, on the CPU.
        batch_size: samples per read and per op call on a worker (rows per block).
        shuffle, seed, epoch: the epoch order, the Loader's.
        state: a ``Loader.state_dict()`` (or every rank's), or ``state_dict(...)`` of an
            earlier ingest: the dataset is the rest of that state's epoch (its epoch
            replaces ``epoch``; ``shuffle`` and ``seed`` must be the saved ones, a
            ``ConfigError`` says which differs).
        ray_options: passed to ``ray.data.read_datasource``: ``override_num_blocks``
            (read tasks; default 4 per CPU of the cluster, at most one per batch; each
            yields one block per batch), ``num_cpus``, ``concurrency``, ``memory``,
            ``runtime_env``, ...
    """
    epoch, start = _position(index, fields, ops, batch_size, shuffle, seed, epoch, state)
    source = _Source(ray.put(index), len(index), fields, ops, batch_size, shuffle, seed, epoch, start)
    if "override_num_blocks" not in ray_options:  # else Ray asks for more and splits each batch's block
        batches = math.ceil((len(index) - start) / batch_size)
        ray_options["override_num_blocks"] = max(1, min(batches, _TASKS_PER_CPU * _cluster_cpus()))
    ds = ray.data.read_datasource(source, **ray_options)
    ds.context.execution_options.preserve_order = True  # rows in order: a row count is a position
    return ds


_TASKS_PER_CPU = 4  # read tasks per cluster CPU: enough to even out tasks of unequal speed


def _cluster_cpus() -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))  # ray.put has started Ray if nothing had


def state_dict(index: SampleIndex, rows: int, *, shuffle: bool = False, seed: int = 0, epoch: int = 0,
               state: dict[str, Any] | Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Loader state of an ingest ``read(index, shuffle=, seed=, epoch=, state=)``
    (the same arguments) whose consumer has taken its first ``rows`` rows: load it into
    ``read(state=...)`` or ``Loader.load_state_dict`` to go on with the rest of the epoch."""
    epoch, start = _position(index, [], (), 1, shuffle, seed, epoch, state)  # no fields: nothing to size
    n = len(index)
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or not 0 <= rows <= n - start:
        raise ConfigError(f"rows must be an integer in 0..{n - start} (the rows of this ingest), got {rows!r}")
    # one-row batches on one rank: any row count is a whole number of steps
    return {"order_version": ORDER_VERSION, "epoch": epoch, "consumed": start + int(rows), "samples": n,
            "shuffle": bool(shuffle), "seed": int(seed), "start": start, "batch": int(rows), "batch_size": 1,
            "world_size": 1, "last_batch": "partial", "rank": 0, "skipped": 0}


def _position(index: SampleIndex, fields: Any, ops: Any, batch_size: int, shuffle: bool, seed: int, epoch: int,
              state: Any) -> tuple[int, int]:
    """``(epoch, first order position)``, with the arguments checked as a Loader checks them."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ConfigError(f"epoch must be an integer >= 0, got {epoch!r}")
    loader = Loader(index, batch_size, fields=fields, ops=ops, output="numpy", shuffle=shuffle, seed=seed)
    if state is None:
        return int(epoch), 0
    loader.load_state_dict(state)
    saved = loader.state_dict()
    return saved["epoch"], saved["consumed"]


class _Source(ray.data.Datasource):
    """The read tasks: runs of whole batches of order positions ``start .. n-1``."""

    def __init__(self, index_ref: Any, n: int, fields: Any, ops: Any, batch_size: int, shuffle: bool, seed: int,
                 epoch: int, start: int) -> None:
        super().__init__()
        self.index_ref, self.n, self.fields, self.ops = index_ref, n, fields, ops
        self.batch_size, self.shuffle, self.seed, self.epoch, self.start = batch_size, shuffle, seed, epoch, start

    def get_name(self) -> str:
        return "gpuio"

    def estimate_inmemory_data_size(self) -> int | None:
        return None  # decoded sizes are known only once decoded

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ray.data.ReadTask]:
        batches = math.ceil((self.n - self.start) / self.batch_size)
        tasks = []
        for run in np.array_split(np.arange(batches), max(1, min(parallelism, batches))):
            if not run.size:
                continue
            lo = self.start + int(run[0]) * self.batch_size
            hi = min(self.n, self.start + (int(run[-1]) + 1) * self.batch_size)
            meta = BlockMetadata(num_rows=hi - lo, size_bytes=None, exec_stats=None, input_files=None)
            tasks.append(ray.data.ReadTask(lambda lo=lo, hi=hi: self._read(lo, hi), meta,
                                           per_task_row_limit=per_task_row_limit))
        return tasks

    def _read(self, lo: int, hi: int) -> Iterator[Any]:
        """Order positions ``lo .. hi-1``, a block per batch, on a Ray worker."""
        index = ray.get(self.index_ref)
        loader = Loader(index, self.batch_size, fields=self.fields, ops=self.ops, output="numpy",
                        shuffle=self.shuffle, seed=self.seed, threads=1)
        order = epoch_order(self.n, self.shuffle, self.seed, self.epoch)
        try:
            for first in range(lo, hi, self.batch_size):
                batch = loader.load(order[first: min(first + self.batch_size, hi)], self.epoch)
                yield BlockAccessor.batch_to_block({name: _column(v) for name, v in batch.items()})
        finally:
            loader.close()


def _column(value: Any) -> np.ndarray:
    """A batch column as Ray takes it: arrays as they are, lists (ragged rows, strings)
    as object arrays of one value per row."""
    if isinstance(value, np.ndarray):
        return value
    out = np.empty(len(value), dtype=object)
    out[:] = list(value)
    return out


class Collate(NumpyBatchCollateFn):
    """A ``collate_fn`` for ``Dataset.iter_torch_batches`` that runs ``ops`` on the
    trainer's ``device``: each batch of rows (NumPy columns, as Ray hands them over) is
    moved there in one copy per column, put through the ops with the random draws of
    ``(seed, epoch, sample)`` (give the ingest's), and returned as a dict of ``output``
    tensors (``"torch"``, or ``"numpy"`` for NumPy/CuPy arrays) with ``index``; rows of
    one shape are one ``[B, ...]`` array, ragged ones a list. On a GPU the batch's
    kernels have finished when it is returned (Ray calls this on its own threads).
    Pass the same ``device`` to ``iter_torch_batches``, which otherwise moves the tensors
    to the CPU."""

    def __init__(self, ops: Sequence[Any] | Any = (), *, device: str = "cuda", seed: int = 0, epoch: int = 0,
                 output: str = "torch") -> None:
        super().__init__()
        self.ops = [ops] if callable(ops) else list(ops)
        for op in self.ops:
            if not callable(op):
                raise ConfigError(f"ops must be callables batch -> batch, got {op!r}")
        self.device = parse_device(device)
        check_cuda(self.device)
        self.seed, self.epoch, self.output = int(seed), int(epoch), output
        self.framework = _frameworks.load(output)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        if "index" not in batch:
            raise ConfigError(f"a gpuio.ray.Collate batch needs the 'index' column of gpuio.ray.read; "
                              f"it has {list(batch)}")
        index = np.asarray(batch["index"], dtype=np.int64)
        if not self.device.is_cuda:
            out = self._run(batch, index, np, None)
        else:
            cp = require("cupy")
            with cp.cuda.Device(self.device.index):
                stream = cp.cuda.get_current_stream()
                out = self._run(batch, index, cp, stream)
                stream.synchronize()
        return {name: _frameworks.convert(v, self.output, self.framework) for name, v in out.items()}

    def _run(self, batch: dict[str, np.ndarray], index: np.ndarray, xp: Any, stream: Any) -> dict[str, Any]:
        """The ops on one batch, on the device of ``xp`` (on a GPU inside its device, on
        ``stream``): the columns after them, with ``index``."""
        data = {name: _on_device(col, xp) for name, col in batch.items() if name != "index"}
        b = Batch(data, index, sample_seeds(self.seed, self.epoch, index), self.device)
        if stream is not None:
            b.stream = stream
        for op in self.ops:
            b = op(b) or b
        out = {name: _stacked(col, xp) for name, col in b.data.items()}
        out["index"] = xp.asarray(b.index)
        return out


def _on_device(col: np.ndarray, xp: Any) -> Any:
    """A Ray column on the batch's device: a numeric array in one copy; an object column
    (ragged rows, strings) as a list, its arrays moved one by one."""
    if col.dtype != object:
        return xp.asarray(col)
    return [xp.asarray(v) if isinstance(v, np.ndarray) else v for v in col]


def _stacked(col: Any, xp: Any) -> Any:
    """A column after the ops: rows of one shape and dtype as one array, else a list."""
    if isinstance(col, list) and col and all(hasattr(v, "shape") for v in col):
        whole = stack(col, xp)
        return col if whole is None else whole
    return col
