"""Batches handed to a framework by DLPack, without copies: the Loader's ``output``.

``"numpy"`` keeps the arrays as the stages made them (NumPy on the CPU, CuPy on a GPU);
``"torch"``, ``"jax"`` and ``"tensorflow"`` wrap each array of numbers in that
framework's tensor over the same memory. Lists (raw bytes, ragged fields) stay lists.
The framework is imported when the Loader is made, so that a missing one is reported
there, with the extra that installs it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from gpuio.device import require
from gpuio.errors import ConfigError

OUTPUTS = ("torch", "numpy", "jax", "tensorflow")


def load(output: str) -> ModuleType | None:
    """The module of framework ``output`` (``None`` for ``"numpy"``), imported now."""
    if output not in OUTPUTS:
        raise ConfigError(f"output={output!r}; choose one of {', '.join(repr(o) for o in OUTPUTS)}")
    return None if output == "numpy" else require(output)


def convert(value: Any, output: str, module: ModuleType | None) -> Any:
    """``value`` as framework ``output`` holds it: an array of numbers becomes a tensor
    over the same memory; anything else is returned as it is."""
    if module is None or not _numeric_array(value):
        return value
    if output == "torch":
        return module.from_dlpack(value)
    if isinstance(value, np.ndarray) and (not value.flags.writeable or value.ctypes.data % _ALIGN):
        # DLPack before 1.0, which JAX and TensorFlow take, has no read-only flag; JAX
        # copies a CPU array not aligned to 64 bytes itself, TensorFlow aborts the process
        value = _aligned_copy(value)
    if output == "jax":
        return module.dlpack.from_dlpack(value)
    return module.experimental.dlpack.from_dlpack(value.__dlpack__())


_ALIGN = 64  # bytes: the alignment TensorFlow (Eigen) demands of a CPU tensor's data


def _aligned_copy(value: np.ndarray) -> np.ndarray:
    """A writable C-contiguous copy of ``value`` whose data starts on a 64-byte boundary."""
    raw = np.empty(value.nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    out = raw[start:start + value.nbytes].view(value.dtype).reshape(value.shape)
    out[...] = value
    return out


def _numeric_array(value: Any) -> bool:
    """A NumPy or CuPy array of numbers (or booleans) in native byte order."""
    is_array = isinstance(value, np.ndarray) or hasattr(value, "__cuda_array_interface__")
    return is_array and value.dtype.kind in "biufc" and value.dtype.isnative
