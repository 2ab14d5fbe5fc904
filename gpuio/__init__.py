"""gpuio: training data from storage into GPU tensors, as fast as the hardware allows.

    import gpuio
    index = gpuio.formats.filetree("/data/imagenet/train")
    batch = gpuio.read(index, range(256), device="cuda")   # CuPy views, one buffer

``import gpuio`` never imports a CUDA library; GPU packages load when a GPU path runs.
"""

from gpuio import config, errors, formats
from gpuio.device import Device, cuda_available, gpu_count
from gpuio.errors import GpuioError
from gpuio.index import (Extent, Extents, PathTable, Ragged, SampleIndex, concat, register_parser,
                         register_sample_reader)
from gpuio.pipeline import Loader
from gpuio.storage import Reader, read, read_sample

# What a SampleIndex cannot know from below the storage core, said once, here: how
# index[i] reads, and which record parsers a saved index may name.
register_sample_reader(read_sample)
for _name, _parser in formats.PARSERS.items():
    register_parser(_name, _parser)
del _name, _parser

__version__ = "0.1.0"

__all__ = [
    "config",
    "errors",
    "formats",
    "ops",
    "Device",
    "Extent",
    "Extents",
    "GpuioError",
    "ImagePolicy",
    "Loader",
    "PathTable",
    "Ragged",
    "Reader",
    "SampleIndex",
    "concat",
    "cuda_available",
    "gpu_count",
    "pack",
    "read",
]


def __getattr__(name: str):  # gpuio.ops and the writer without importing them (and the decoders) up front
    import importlib

    if name == "ops":
        return importlib.import_module("gpuio.ops")
    if name in ("pack", "ImagePolicy"):
        return getattr(importlib.import_module("gpuio._pack"), name)
    raise AttributeError(f"module 'gpuio' has no attribute {name!r}")


def __dir__() -> list[str]:  # help(gpuio) and dir() list ops before it is imported
    return sorted({*globals(), "ops", "pack", "ImagePolicy"})
