"""Serving: the training pipeline's ops as a Triton Inference Server model, on PyTriton.

    from gpuio import ops, serve
    pipe = [ops.decode_image(), ops.resize(256), ops.center_crop(224),
            ops.normalize(mean=[123.7, 116.3, 103.5], std=[58.4, 57.1, 57.4])]
    with serve.Server(pipe, model="resnet50.pt2", device="cuda") as server:
        server.serve_forever()          # or: gpuio serve --ops "..." --model resnet50.pt2

The model takes ``images`` (``TYPE_UINT8``, dims ``[-1]``): per request ``[n, L]``, one
encoded image per row (the rows of one request padded with zero bytes at the end; after a
JPEG's end marker they are dropped, other formats' decoders ignore them). It gives
``image`` (the ops' output, one row per image) or, with a model chained in the same
process, ``scores`` (the model's output, one row per image).

Batching: PyTriton fails every request of a call when the call raises, so Triton's own
dynamic batcher (which merges requests into one call) would let one bad image fail the
requests merged with it. Here Triton hands each model instance one request at a time, and
gpuio batches the requests in flight (up to ``max_batch`` images) into one ``Batch`` run
through the ops and the model; a bad image rejects only its row, and its request alone
gets the error, naming the image and what is wrong with it.

On a GPU (``device="cuda"``) decoding and the ops run on the GPU and the ops' output
reaches a torch model by DLPack, on the GPU (no host copy); only the model's output goes
to the host for the response.

PyTriton 0.7 runs each model instance in a Triton Python stub built for the running
interpreter's version and linked against its ``libpython3.X.so``, which must be on
``LD_LIBRARY_PATH`` (``start`` puts this interpreter's folder there). Under Python 3.11 the
stub fails to load any model; under 3.12 it works, so ``start`` asks for 3.12.
``import gpuio`` (and this module) never imports PyTriton: ``start`` does.

Errors: PyTriton answers any exception of an inference callable as an internal error (HTTP
500, gRPC INTERNAL) whose message is the Python traceback. ``start`` therefore puts a small
Triton Python model (``STUB_MODEL``) in front of PyTriton's own in the model store: a request
gpuio refuses (an empty one, or an image that does not decode; a ``DataError``) is answered as
the client's error (HTTP 400, gRPC INVALID_ARGUMENT) with gpuio's one-line message, any other
failure as an internal error with one line; tracebacks go to the server's log only.

Stopping: Triton's exit timeout (``exit_timeout`` seconds) is how long a stop waits for the
requests in flight and then for the model instances to unload; the Python stubs unload one
after the other, about 2 s each (a 1 s wait in Triton's Python backend and PyTriton's 1 s
polling), so with more than two instances Triton gives up and exits before the last stubs have
finished. ``stop`` then ends every process under Triton's server that is still running, and
removes PyTriton's shared memory segments of this process (``/dev/shm/pytrtion<pid>-*``).
The timeout is one budget for both waits, so it stays at 5 s: shorter, a slow request in
flight would be cut off.
"""

from __future__ import annotations

import contextlib
import glob
import os
import queue
import runpy
import signal
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device, check_cuda, parse_device, require
from gpuio.errors import ConfigError, DataError, DependencyError, GpuioError

__all__ = ["Batcher", "Pipeline", "Server", "load_model", "parse_ops", "INPUT", "OUTPUT", "SCORES", "STUB_MODEL"]

INPUT = "images"  # encoded bytes, uint8 [n, L] per request
OUTPUT = "image"  # the ops' output, one row per image
SCORES = "scores"  # the chained model's output, one row per image

Model = Callable[[Any], Any]


def parse_ops(text: str) -> list[Any]:
    """Ops from their Python spelling, e.g. ``"decode_image(), resize(256),
    center_crop(224), normalize(mean=[123.7, 116.3, 103.5], std=[58.4, 57.1, 57.4])"``
    (calls of ``gpuio.ops`` names, comma separated)."""
    from gpuio import ops

    names = {name: getattr(ops, name) for name in ops.__all__}
    try:
        built = eval(f"[{text}]", {"__builtins__": {}}, names)  # noqa: S307 - the user's own command line
    except GpuioError:
        raise
    except Exception as exc:  # a typo in the text: SyntaxError, NameError, TypeError ...
        raise ConfigError(f"--ops {text!r}: {type(exc).__name__}: {exc}; write calls of gpuio.ops "
                          f"({', '.join(n for n in ops.__all__ if n[0].islower())}), comma separated") from exc
    if not built or not all(callable(op) for op in built):
        raise ConfigError(f"--ops {text!r} gives no ops; write calls of gpuio.ops, comma separated")
    return built


def load_model(spec: str, device: str | Device = "cpu") -> Model:
    """A model from a file: ``FILE.pt2`` (``torch.export.save``), ``FILE.pt``/``.pth``/``.ts``
    (TorchScript, ``torch.jit.save``), or ``FILE.py:NAME`` (the callable ``NAME`` defined
    in that Python file, called on NumPy arrays, or CuPy arrays on a GPU)."""
    device = parse_device(device)
    path, _, attr = spec.rpartition(":") if spec.rpartition(":")[0].endswith(".py") else (spec, "", "")
    if not os.path.isfile(path):
        raise ConfigError(f"model {spec!r}: no such file {path!r}")
    if path.endswith(".py"):
        found = runpy.run_path(path).get(attr)
        if not callable(found):
            raise ConfigError(f"model {spec!r}: {path} defines no callable {attr!r}")
        return found
    torch = require("torch")
    where = "cpu" if not device.is_cuda else f"cuda:{device.index}"
    if path.endswith(".pt2"):
        return torch.export.load(path).module().to(where)  # an exported program has no eval mode
    if path.endswith((".pt", ".pth", ".ts")):
        return torch.jit.load(path, map_location=where).eval()
    raise ConfigError(f"model {spec!r}: use a .pt2 (torch.export), .pt/.pth/.ts (TorchScript) or FILE.py:NAME")


def _last_dtype(ops: Sequence[Any]) -> np.dtype:
    """The dtype the ops give: the last op with a ``dtype`` (normalize), else uint8 pixels."""
    flat = [o for op in ops for o in getattr(op, "ops", [op])]
    dtypes = [o.dtype for o in flat if isinstance(getattr(o, "dtype", None), str)]
    return np.dtype(dtypes[-1] if dtypes else np.uint8)


class Pipeline:
    """Encoded images -> the ops' output (-> the model's output), the same ops and the
    same results as a ``Loader`` with ``ops`` (on the CPU, exactly).

    Args:
        ops: ops as a ``Loader`` takes them; the first reads field ``field`` (encoded
            bytes), the output is field ``output``.
        model: a callable run on the ops' output, stacked ``[N, ...]``: a torch module
            (called on a torch tensor made by DLPack, on the batch's device, under
            ``torch.inference_mode``) or any callable on NumPy (CPU) or CuPy (GPU) arrays;
            or a file for ``load_model``.
        device: ``"cpu"`` or ``"cuda[:N]"``: where decoding, the ops and the model run.
    """

    def __init__(self, ops: Sequence[Any], *, model: Model | str | None = None, device: str | Device = "cpu",
                 field: str = "data", output: str = "image") -> None:
        from gpuio.ops import Compose

        if not ops or not all(callable(op) for op in ops):
            raise ConfigError(f"ops must be a non-empty list of gpuio ops, got {ops!r}")
        self.device = parse_device(device)
        check_cuda(self.device)
        self.ops = Compose(list(ops))  # as the Loader composes them: the fused chains and all
        self.field, self.output = field, output
        self.model = load_model(model, self.device) if isinstance(model, str) else model
        torch = sys.modules.get("torch")
        self._torch = torch if torch is not None and isinstance(self.model, torch.nn.Module) else None
        self.dtype = _last_dtype(ops)

    def __call__(self, images: Sequence[Any], seeds: np.ndarray | None = None) -> list[np.ndarray | DataError]:
        """Run a batch of encoded images (1-D uint8 arrays or bytes); one entry per image:
        its output row (host NumPy) or the ``DataError`` that rejected it (naming it). ``seeds``
        (uint64 per image) drive random ops; default: ``sample_seeds(0, 0, arange(n))``."""
        from gpuio.ops.ragged import to_host

        n = len(images)
        rows = [np.frombuffer(a, np.uint8) if isinstance(a, (bytes, bytearray, memoryview)) else a for a in images]
        seeds = sample_seeds(0, 0, np.arange(n)) if seeds is None else seeds
        batch = Batch({self.field: rows}, np.arange(n, dtype=np.int64), seeds, self.device, on_error="skip")
        with self._on_device():  # CuPy allocates on the current device, which is per thread (GPU 0 by default)
            batch = self.ops(batch)
            out = batch.data[self.output]
            kept = batch.index.tolist()
            if self.model is not None and kept:
                out = self._run_model(out if not isinstance(out, list) else _stacked(out, batch.xp,
                                                                                     "the model's inputs"))
            out = [to_host(a) for a in out] if isinstance(out, list) else to_host(out)  # one copy per batch
        results: list[np.ndarray | DataError] = [None] * n
        for row, err in batch.errors:
            results[row] = _for_image(err, row)
        for j, row in enumerate(kept):
            results[row] = out[j]
        return results

    def _on_device(self) -> contextlib.AbstractContextManager:
        """This pipeline's GPU as CuPy's current device (nothing on the CPU)."""
        if not self.device.is_cuda:
            return contextlib.nullcontext()
        return require("cupy").cuda.Device(self.device.index)

    def _run_model(self, x: Any) -> Any:
        torch = self._torch
        if torch is None:
            return self.model(x)
        if self.device.is_cuda:  # torch's stream waits for the ops' kernels (on CuPy's current stream)
            cp = require("cupy")
            event = cp.cuda.get_current_stream().record()  # the caller made this pipeline's GPU current
            stream = torch.cuda.current_stream(self.device.index).cuda_stream
            cp.cuda.runtime.streamWaitEvent(stream, event.ptr)
        with torch.inference_mode():
            return self.model(torch.from_dlpack(x))


def _for_image(err: BaseException, row: int) -> DataError:
    """``err``, which rejected image ``row``, as a ``DataError`` naming that image."""
    if isinstance(err, DataError):
        return type(err)(err.reason, sample=f"image {row}")
    return DataError(f"{type(err).__name__}: {err}", sample=f"image {row}")


def _stacked(rows: list[Any], xp: Any, what: str) -> Any:
    """``rows`` stacked into one array; rows of different shapes are a ``ConfigError``
    that says they are ``what`` (a model's inputs, a request's outputs) and how to fix it."""
    if any(a.shape != rows[0].shape for a in rows):
        raise ConfigError(f"{what} have different shapes ({sorted({a.shape for a in rows})}): end the ops with a "
                          f"resize or crop to one size")
    return xp.stack(rows)


def _unpad(row: np.ndarray) -> np.ndarray:
    """A request's row without the zero bytes that pad it to the request's width, where
    they follow a JPEG's end marker (the decoders' fast paths want the JPEG to end there)."""
    if len(row) < 2 or row[-1] != 0:
        return row
    nonzero = np.flatnonzero(row)
    end = int(nonzero[-1]) + 1 if len(nonzero) else 0
    return row[:end] if end >= 2 and row[end - 2] == 0xFF and row[end - 1] == 0xD9 else row


class _Job:
    """One request on its way through the batcher."""

    __slots__ = ("rows", "done", "out", "error")

    def __init__(self, rows: list[np.ndarray]) -> None:
        self.rows = rows
        self.done = threading.Event()
        self.out: np.ndarray | None = None
        self.error: BaseException | None = None


class Batcher:
    """Runs the requests in flight as batches of ``pipeline``: ``workers`` threads each
    take every waiting request (up to ``max_batch`` images) as one batch."""

    def __init__(self, pipeline: Pipeline, max_batch: int = 64, workers: int = 1) -> None:
        self.pipeline, self.max_batch = pipeline, max_batch
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._loop, name=f"gpuio-serve-{i}", daemon=True)
                         for i in range(workers)]
        self._lock = threading.Lock()
        self.batches = 0  # batches run, and images in them: how much requests were merged
        self.images = 0
        for t in self._threads:
            t.start()

    def submit(self, images: np.ndarray) -> np.ndarray:
        """Run one request's images (uint8 ``[n, L]``); its output rows stacked, or raise
        the error of its first bad image (a ``DataError``; an empty request is one too)."""
        shape = list(images.shape) if isinstance(images, np.ndarray) else [len(images)]
        if 0 in shape:
            raise DataError(_EMPTY.format(shape=shape))
        job = _Job([_unpad(row) for row in images])
        self._queue.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.out

    def close(self) -> None:
        """End the batch threads once the requests queued before this call are done."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs, n = [job], len(job.rows)
            while n < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:  # closing: finish this batch, then stop
                    self._queue.put(None)
                    break
                jobs.append(more)
                n += len(more.rows)
            self._run(jobs)

    def _run(self, jobs: list[_Job]) -> None:
        rows = [r for job in jobs for r in job.rows]
        # random ops draw by the image's place in its request, not in the merged batch
        seeds = sample_seeds(0, 0, np.concatenate([np.arange(len(job.rows)) for job in jobs]))
        try:
            results = self.pipeline(rows, seeds)
        except Exception as exc:  # the ops or the model failed the whole batch (a model's own errors too)
            if len(jobs) > 1:  # run each request alone, so that only the culprit's fails
                for job in jobs:
                    self._run([job])
                return
            jobs[0].error = exc
            jobs[0].done.set()
            return
        with self._lock:
            self.batches += 1
            self.images += len(rows)
        start = 0
        for job in jobs:
            mine = results[start: start + len(job.rows)]
            start += len(job.rows)
            bad = [(i, r) for i, r in enumerate(mine) if isinstance(r, DataError)]
            try:
                if bad:  # named by its place in its own request
                    raise _for_image(bad[0][1], bad[0][0])
                job.out = _stacked(mine, np, "the outputs of one request's images")
            except Exception as exc:  # this request's own failure; the batch thread goes on
                job.error = exc
            job.done.set()


# What is wrong with a request that holds no image bytes: gpuio's own check and the stub model's
# (which runs before PyTriton's serializer fails on such a request) say it alike.
_EMPTY = ("a request of shape {shape} holds no image: send uint8 [n, L] with n >= 1 images of L >= 1 bytes, "
          "one encoded image per row")


# Marks the message a request is answered with inside the text PyTriton hands the stub model
# (its traceback of the raised exception): "<START>invalid message<END>" or "<START>internal ...".
_START, _END = "<<gpuio-answer ", " gpuio-answer>>"

STUB_MODEL = f'''"""gpuio's Triton Python model (written by gpuio.serve): PyTriton's proxy model
(pytriton_model.py) answering gpuio's errors as Triton errors with their own code and one line."""

import triton_python_backend_utils as pb_utils

from .pytriton_model import TritonPythonModel as PyTritonModel

INPUT, START, END, EMPTY = {INPUT!r}, {_START!r}, {_END!r}, {_EMPTY!r}


class TritonPythonModel(PyTritonModel):
    def execute(self, requests):
        # the stub adds these names to pb_utils once the model runs, not when it is imported
        codes = {{"invalid": pb_utils.TritonError.INVALID_ARG, "internal": pb_utils.TritonError.INTERNAL}}
        answers = [None] * len(requests)
        passed = []
        for i, request in enumerate(requests):
            shape = list(pb_utils.get_input_tensor_by_name(request, INPUT).shape())
            if 0 in shape:  # PyTriton's serializer cannot take it
                error = pb_utils.TritonError(EMPTY.format(shape=shape), codes["invalid"])
                answers[i] = pb_utils.InferenceResponse(error=error)
            else:
                passed.append(i)
        if passed:
            try:
                got = super().execute([requests[i] for i in passed])
            except pb_utils.TritonModelException as exc:
                text = str(exc)
                start = text.rfind(START)
                end = text.find(END, start)
                if start < 0 or end < 0:  # failed in PyTriton itself
                    pb_utils.Logger.log_error(text)
                    kind, message = "internal", "the server failed on this request; its log has the details"
                else:
                    kind, _, message = text[start + len(START): end].partition(" ")
                error = pb_utils.TritonError(message, codes[kind])
                got = [pb_utils.InferenceResponse(error=error) for _ in passed]
            for i, answer in zip(passed, got):
                answers[i] = answer
        return answers
'''


class _Answer(Exception):
    """How a request fails: ``kind`` ``"invalid"`` (the client's error) or ``"internal"``, and
    one line for the client, marked so that ``STUB_MODEL`` finds it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{_START}{kind} {' '.join(message.split())}{_END}")


def _answer(exc: Exception) -> _Answer:
    """``exc``, which failed a request, as the answer to it: gpuio's ``DataError`` (a bad image or
    request) is the client's; anything else is the server's, named by its type only (its message
    may hold server paths; the log has the traceback)."""
    if isinstance(exc, DataError):
        return _Answer("invalid", str(exc))
    return _Answer("internal", f"the server failed on this request ({type(exc).__name__}); its log has the details")


def _triton_processes() -> dict[int, str]:
    """The Triton servers this process started and every process under them (from ``/proc``),
    each with its start time (which tells it from a later process given the same pid). Other
    children of this process (an application's own) are not among them."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        started[int(entry)] = fields[19]
    todo = [p for p in children.get(os.getpid(), [])
            if os.path.basename(_cmdline(p).split(b"\0")[0]) == b"tritonserver"]
    found: dict[int, str] = {}
    while todo:
        pid = todo.pop()
        found[pid] = started[pid]
        todo.extend(children.get(pid, []))
    return found


def _running(pid: int, started: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and fields[19] == started


def _end(processes: dict[int, str]) -> None:
    """End the ``processes`` (pid: start time) still running. Once Triton is gone its Python
    stubs serve nothing: SIGTERM, and SIGKILL after 1 s (a stub may ignore SIGTERM). A
    multiprocessing resource tracker ignores SIGTERM and ends by itself once the processes it
    serves are gone, removing the shared memory they left: it is given 3 s for that."""
    def running(pids: dict[int, str]) -> dict[int, str]:
        return {p: s for p, s in pids.items() if _running(p, s)}

    def send(pids: dict[int, str], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def wait(pids: dict[int, str], seconds: float) -> dict[int, str]:
        deadline = time.monotonic() + seconds
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = running(pids)
        return pids

    left = running(processes)
    trackers = {p: s for p, s in left.items() if b"multiprocessing.resource_tracker" in _cmdline(p)}
    others = {p: s for p, s in left.items() if p not in trackers}
    send(others, signal.SIGTERM)
    others = wait(others, 1.0)
    send(others, signal.SIGKILL)
    killed = wait({**others, **trackers}, 3.0)
    send(killed, signal.SIGKILL)
    wait(killed, 2.0)  # a killed process needs a moment to finish exiting (its cmdline empty meanwhile)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def libpython_on_path() -> None:
    """Put this interpreter's ``libpython3.X.so`` folder on ``LD_LIBRARY_PATH``: Triton's
    Python stub (started by the server, inheriting this environment) links against it."""
    libdir = sysconfig.get_config_var("LIBDIR")
    if not libdir or not os.path.exists(os.path.join(libdir, sysconfig.get_config_var("LDLIBRARY") or "")):
        return
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if libdir not in paths:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([libdir, *paths])


def _pytriton() -> Any:
    if sys.version_info[:2] != (3, 12):
        raise DependencyError(
            f"serving needs Python 3.12 (this is {sys.version.split()[0]}): the Triton that PyTriton 0.7 ships "
            f"loads models in a Python stub that fails under 3.11 (3.12 is the version it works under here); "
            f"make a 3.12 environment with pip install 'gpuio[serve]'")
    try:
        import pytriton.triton as triton
        from pytriton import model_config
    except ImportError as exc:
        raise DependencyError(f"serving needs PyTriton ({exc}); install it with pip install 'gpuio[serve]'") from exc
    return triton, model_config


class Server:
    """A Triton Inference Server (PyTriton) serving ``ops`` (and ``model``) as model ``name``.

    Args:
        ops, model, device: as for ``Pipeline``.
        name: the Triton model's name.
        http_port, grpc_port, metrics_port: Triton's ports; ``address`` the interface
            they listen on (``"0.0.0.0"``: all).
        instances: Triton model instances, i.e. requests in flight at once (each
            instance is a Triton Python stub process).
        max_batch: images per request (Triton's ``max_batch_size``) and per merged batch.
        workers: threads running batches (default: 1 on a GPU, one per core on the CPU).
        output_shape: the output's dims per image (default: ``(-1, -1, -1)`` for images,
            ``(-1,)`` for scores).
        output_dtype: the output's dtype (default: the ops' own, float32 for a model).
        exit_timeout: seconds a stop waits for the requests in flight and for the model
            instances to unload (Triton's exit timeout; see the module docstring).
    """

    def __init__(self, ops: Sequence[Any], *, model: Model | str | None = None, device: str | Device = "cpu",
                 name: str = "gpuio", http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 address: str = "0.0.0.0", instances: int = 4, max_batch: int = 64, workers: int | None = None,
                 output_shape: Sequence[int] | None = None, output_dtype: Any = None, exit_timeout: int = 5) -> None:
        for what, value in (("instances", instances), ("max_batch", max_batch), ("workers", workers or 1),
                            ("exit_timeout", exit_timeout)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{what} must be a positive integer, got {value!r}")
        self.pipeline = Pipeline(ops, model=model, device=device)
        self.name, self.address, self.instances, self.max_batch = name, address, instances, max_batch
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        chained = self.pipeline.model is not None
        self.output = SCORES if chained else OUTPUT
        self.output_shape = tuple(output_shape or ((-1,) if chained else (-1, -1, -1)))
        self.output_dtype = np.dtype(output_dtype or (np.float32 if chained else self.pipeline.dtype))
        self.workers = workers or (1 if self.pipeline.device.is_cuda else os.cpu_count() or 1)
        self.exit_timeout = exit_timeout
        self.batcher: Batcher | None = None
        self._triton: Any = None
        self._stopping = False

    def bind(self, triton: Any) -> None:
        """Bind the model to a PyTriton ``Triton`` (which may serve other models too). Errors
        are answered PyTriton's way (internal, with a traceback) unless ``STUB_MODEL`` is put
        in front of PyTriton's model, as ``start`` does."""
        _, mc = _pytriton()
        self.batcher = Batcher(self.pipeline, self.max_batch, self.workers)

        def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
            # one request per call: the model config has no dynamic batcher (see the module docstring)
            try:
                return [{self.output: self.batcher.submit(r[INPUT]).astype(self.output_dtype, copy=False)}
                        for r in requests]
            except Exception as exc:  # answered by STUB_MODEL; PyTriton logs the traceback
                raise _answer(exc) from exc

        triton.bind(model_name=self.name, infer_func=[infer] * self.instances,
                    inputs=[mc.Tensor(name=INPUT, dtype=np.uint8, shape=(-1,))],
                    outputs=[mc.Tensor(name=self.output, dtype=self.output_dtype, shape=self.output_shape)],
                    config=mc.ModelConfig(batching=True, max_batch_size=self.max_batch, batcher=None))

    def start(self, tries: int = 3) -> Server:
        """Start Triton and load the model; returns when it serves requests.

        PyTriton's model instances start in parallel, and all but the first wait one
        second for the first one's handshake socket; on a loaded machine that can run
        out and the model fails to load. Such a start is tried again, ``tries`` times in
        all, then its error is raised."""
        self._check_ports()
        triton, _ = _pytriton()
        from pytriton.utils.workspace import Workspace

        libpython_on_path()
        config = triton.TritonConfig(http_address=self.address, grpc_address=self.address,
                                     metrics_address=self.address, http_port=self.ports["http"],
                                     grpc_port=self.ports["grpc"], metrics_port=self.ports["metrics"],
                                     exit_timeout_secs=self.exit_timeout)
        local_store = triton.TritonLifecyclePolicy(launch_triton_on_startup=True, local_model_store=True)
        for attempt in range(1, tries + 1):
            # a local model store: PyTriton writes the model's files there when it is bound, and
            # Triton loads them from there when it starts
            workspace = Workspace()
            self._triton = triton.Triton(config=config, workspace=workspace, triton_lifecycle_policy=local_store)
            try:
                self.bind(self._triton)
                version = workspace.model_store_path / self.name / "1"
                os.replace(version / "model.py", version / "pytriton_model.py")
                (version / "model.py").write_text(STUB_MODEL)
                self._triton.run()
                return self
            except Exception as exc:
                self.stop()
                if attempt == tries:
                    raise
                print(f"gpuio serve: the model did not load ({type(exc).__name__}: {str(exc)[:200]}...); "
                      f"starting again ({attempt + 1}/{tries})", file=sys.stderr)
            except BaseException:
                self.stop()
                raise
        return self

    def _check_ports(self) -> None:
        """A port another process holds is a ConfigError now: Triton itself would wait on it
        without failing."""
        for kind, port in self.ports.items():
            if not port:
                continue
            with socket.socket(socket.AF_INET6 if ":" in self.address else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds
                try:
                    probe.bind((self.address, port))
                except OSError as exc:
                    raise ConfigError(f"the {kind} port {port} on {self.address} cannot be used "
                                      f"({exc.strerror}); pick another with --{kind}-port") from None

    def serve_forever(self) -> None:
        """Block until Triton stops (Ctrl-C or SIGTERM stops it)."""
        self._triton.serve()

    def stop(self) -> None:
        """Stop Triton and the batch threads; then end every process under Triton's server
        that is still running (its Python stubs and their helpers, see the module docstring)
        and remove PyTriton's shared memory segments of this process."""
        self._stopping = True
        if self._triton is not None:
            started = _triton_processes()
            self._triton.stop()
            self._triton = None
            _end(started)
            for segment in glob.glob(f"/dev/shm/pytrtion{os.getpid()}-*"):  # PyTriton's prefix (sic)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(segment)
        if self.batcher is not None:
            self.batcher.close()
            self.batcher = None
        self._stopping = False

    def exit_on_signal(self, signum: int, frame: Any) -> None:
        """A signal handler (``signal.signal(signal.SIGTERM, server.exit_on_signal)``, in the
        main thread): leave by ``SystemExit(0)`` from wherever the main thread is, also while
        the server starts, so that the ``with`` block stops it; a signal during a stop is
        ignored, as that stop ends the server anyway."""
        if not self._stopping:
            raise SystemExit(0)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
