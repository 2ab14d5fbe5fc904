"""Device names and GPU detection that never imports a CUDA library.

``import gpuio`` must work on a machine with no GPU and no CUDA packages, so detection
looks at the driver's device nodes and at which packages are installed, and the CUDA
libraries (CuPy, kvikio, nvImageCodec) are imported only when a GPU path runs.
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

from gpuio._fork import refuse_cuda_after_fork
from gpuio.errors import ConfigError, DependencyError, DeviceError

__all__ = ["Device", "parse_device", "gpu_count", "cuda_available", "require", "check_cuda"]

# package -> the extra that installs it
_EXTRAS = {
    "cupy": "cu12 or cu13",
    "kvikio": "cu12 or cu13",
    "nvidia.nvimgcodec": "cu12 or cu13",
    "PyNvVideoCodec": "video",
    "av": "video",
    "cupyx": "cu12 or cu13",
    "torch": "torch",
    "jax": "jax",
    "tensorflow": "tensorflow",
}


@dataclass(frozen=True)
class Device:
    """``Device("cpu")`` or ``Device("cuda", 0)``."""

    kind: str
    index: int = 0

    @property
    def is_cuda(self) -> bool:
        """Whether this is a GPU (``cuda:N``)."""
        return self.kind == "cuda"

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


def parse_device(device: str | Device) -> Device:
    """Parse ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    if isinstance(device, Device):
        return device
    text = str(device).strip().lower()
    if text == "cpu":
        return Device("cpu")
    if text == "cuda":
        return Device("cuda", 0)
    if text.startswith("cuda:") and text[5:].isdigit():
        return Device("cuda", int(text[5:]))
    raise ConfigError(f"device {device!r} is not one of 'cpu', 'cuda' or 'cuda:N'")


@functools.lru_cache(maxsize=1)
def gpu_count() -> int:
    """NVIDIA GPUs visible to this process, from the driver's device nodes."""
    nodes = [p for p in glob.glob("/dev/nvidia[0-9]*") if p[len("/dev/nvidia"):].isdigit()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() not in ("", "-1")]
        return min(len(ids), len(nodes))
    return len(nodes)


def cuda_available() -> bool:
    """A GPU is present and CuPy is installed (without importing it)."""
    return gpu_count() > 0 and importlib.util.find_spec("cupy") is not None


def require(module: str) -> ModuleType:
    """Import an optional GPU or framework package, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = _EXTRAS.get(module, "")
        hint = f"; install it with pip install 'gpuio[{extra.split(' or ')[0]}]'" if extra else ""
        raise DependencyError(f"this path needs {module!r}, which could not be imported ({exc}){hint}") from exc


def check_cuda(device: Device) -> None:
    """Raise a clear error when ``device`` is a GPU this machine does not have."""
    if not device.is_cuda:
        return
    refuse_cuda_after_fork()
    count = gpu_count()
    if count == 0:
        raise DeviceError(f"device {device} was asked for, but this machine has no NVIDIA GPU")
    if device.index >= count:
        raise DeviceError(f"device {device} was asked for, but only {count} GPU(s) are visible")
