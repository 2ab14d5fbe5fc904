"""A user's per-sample Python function as an op: the bridge to torchvision transforms,
albumentations or any callable on one sample.

For an op of your own, write the ``Op`` protocol directly (see the README, "Custom
ops"): a callable ``batch -> batch`` that works on whole batches; this op is for
code that exists only per sample.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError, DataError


class PythonFunction(Op):
    """Run ``function`` on each row of ``field`` and store its results in ``out``
    (default: ``field``), one call per sample, in row order on the stage's worker thread.

    A row is what the earlier ops made: an image is an HWC uint8 NumPy array on the
    CPU (a CuPy array on a GPU batch). ``function`` may return a NumPy array, a
    CPU ``torch.Tensor``, a PIL image or a CuPy array; the result is stored as an array
    (on the batch's device). If ``function`` takes a keyword argument ``rng``, it gets
    the row's ``numpy.random.Generator`` (``batch.rng(row, salt)``, seeded by seed,
    epoch and sample), so its draws repeat exactly on resume; a callable that draws from
    a global generator (torchvision's transforms draw from torch's) does not repeat
    them. An exception from ``function`` rejects the row with a ``DataError`` that
    names the function and the sample (skipped under ``on_error="skip"``).

    Cost: a Python call per sample, and it splits a fused crop/resize/flip/normalize
    chain in two where it sits inside it; put it before or after that chain.
    """

    def __init__(self, function: Callable[..., Any], field: str = "image", out: str | None = None, *,
                 salt: int = 0x5059) -> None:
        if not callable(function):
            raise ConfigError(f"python_function takes a callable, got {function!r}")
        self.function, self.field, self.out, self.salt = function, field, out or field, salt
        self.name = getattr(function, "__name__", type(function).__name__)
        try:
            params = inspect.signature(function).parameters
        except (TypeError, ValueError):  # a builtin or extension callable without a signature
            params = {}
        self._takes_rng = "rng" in params

    def __call__(self, batch: Batch) -> Batch:
        rows = batch.data[self.field]
        out = []
        for row in range(len(rows)):
            try:
                result = (self.function(rows[row], rng=batch.rng(row, self.salt)) if self._takes_rng
                          else self.function(rows[row]))
                out.append(_as_array(result, batch))
            except Exception as exc:  # the user's code: any failure is this sample's, named below
                batch.reject(row, DataError(f"python_function {self.name} raised {type(exc).__name__}: {exc}",
                                            sample=int(batch.index[row])))
                out.append(None)
        batch.data[self.out] = out
        return batch


def _as_array(result: Any, batch: Batch) -> Any:
    """``result`` as an array on the batch's device (NumPy on the CPU, CuPy on a GPU)."""
    if batch.device.is_cuda:
        cp = batch.xp
        if isinstance(result, cp.ndarray):
            return result
        if hasattr(result, "__dlpack__") and getattr(result, "is_cuda", False):  # a CUDA torch tensor
            return cp.from_dlpack(result)
        return cp.asarray(np.asarray(result))
    if hasattr(result, "detach"):  # a torch tensor on the CPU
        result = result.detach()
    return np.asarray(result)


def python_function(function: Callable[..., Any], field: str = "image", out: str | None = None, *,
                    salt: int = 0x5059) -> PythonFunction:
    """See ``PythonFunction``."""
    return PythonFunction(function, field, out, salt=salt)
