"""Settings: defaults, ``GPUIO_*`` environment variables, and a ``with`` override.

    >>> import gpuio
    >>> gpuio.config.get("io_threads")
    16
    >>> with gpuio.config.override(io_threads=32):
    ...     gpuio.config.get("io_threads")
    32

Environment variables are read when a setting is first asked for, so that
``GPUIO_IO_THREADS=64 python train.py`` works without code changes. Overrides are
per thread of control (a ``contextvars`` value): code running inside ``override``
sees the new values, other threads keep theirs. Stages that run on worker threads
take their settings when they are built, in the caller's context.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

from gpuio.errors import ConfigError

__all__ = ["DEFAULTS", "get", "override", "parse_size", "settings"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# name -> (default, help). Sizes are in bytes.
DEFAULTS: dict[str, tuple[Any, str]] = {
    "io_threads": (16, "threads issuing reads; queue depth matters more than cores"),
    "task_size": (4 * MiB, "long reads are split into parallel tasks, each a multiple of this size"),
    "read_parts": (4, "a batch's reads longer than task_size make about this many tasks in all, "
                      "each one sequential run for the kernel's readahead"),
    "merge_gap": (4 * KiB, "extents this close in one file are merged into one read"),
    "o_direct": (False, "bypass the page cache (O_DIRECT), where the filesystem allows"),
    "cold_direct": (True, "read a batch of reads of 64 KiB and more on average with O_DIRECT when "
                          "the page cache holds almost none of it"),
    "read_ahead": (64 * MiB, "bytes of a file read ahead of batches read with O_DIRECT in the order of its "
                             "records (a packed dataset's cold pass), into buffers of about twice that; 0: none"),
    "buffer_budget": (4 * GiB, "bytes of batch buffers one pool may hold, host and device together "
                               "(gpuio.read: the value at each call; a Loader: the value when it is made)"),
    "backend": ("auto", "storage backend of reads into GPU memory: auto, posix or kvikio (host reads: posix)"),
    "native": (True, "posix reads in C with the GIL released, where the accelerator was built"),
    "pinned": ("auto", "pin host batch buffers: auto (when a GPU is present), true, false"),
    "max_open_files": (256, "kvikio CuFile handles kept open across batches"),
    "kvikio_compat": ("auto", "kvikio compat mode: auto, on (POSIX bounce) or off (GDS)"),
    "decode_parts": ("auto", "a CPU batch's JPEG window decodes (fused with their crop and resize) run as this many "
                             "parts at once on the process's pool of one thread per core; 0: a part per core, "
                             "1: on the calling thread; auto: a Loader chooses online within its CPU budget "
                             "(a part per core outside a Loader)"),
    "cache_dir": ("", "where sample datasets and indexes go; default ~/.cache/gpuio"),
    "remote_client": ("auto", "the client of remote GETs: auto (obstore; urllib3 in a forked child of a "
                              "process that used obstore, whose runtime does not survive fork), obstore, urllib3"),
    "remote_unsigned": (False, "send s3:// and az:// requests unsigned (a public bucket or container, "
                               "no credentials); AWS_NO_SIGN_REQUEST=true does the same"),
    "remote_cache": (True, "keep the bytes of object storage (s3://, gs://, az://) and http(s):// data in the node-local cache tier"),
    "remote_cache_dir": ("", "the node-local cache of remote data; default <cache_dir>/remote"),
    "remote_cache_budget": (64 * GiB, "bytes the remote cache may hold; least recently used blocks go first"),
    "remote_block": (8 * MiB, "remote objects are cached whole up to this size, larger ones in blocks of it"),
    "remote_pack_below": (1 * MiB, "remote objects smaller than this are appended to the cache's shared pack files "
                                   "instead of a file each; 0: never"),
    "remote_requests": (32, "ranged GETs in flight per reader"),
    "remote_readahead": (256 * MiB, "bytes of remote blocks a reader may hold in memory ahead of its reads: "
                                    "fetched from a Loader's coming batches, or waiting to be written to the cache"),
    "remote_gap": (1 * MiB, "uncached remote extents this close in one object are one GET"),
    "remote_part": (16 * MiB, "uncached remote reads longer than this are split into GETs of this size"),
    "remote_retries": (8, "tries of a GET after a 5xx, a 429 or a dropped connection, with backoff "
                          "(about 0.1, 0.2, 0.4 ... s, at most 5 s: 8 tries span some 11 s)"),
    "remote_timeout": (30, "seconds a remote connection or read may stall before it counts as dropped"),
    "pack_shard_size": (128 * MiB, "gpuio pack: source bytes per shard of a packed dataset"),
}

# Environment variables still read under a former name (when the new one is not set):
# setting -> the old variable. Code (get, override) knows only the new names.
ENV_ALIASES: dict[str, str] = {"read_parts": "GPUIO_READ_STREAMS"}

_AUTO_OR_COUNT = ("decode_parts",)  # settings that take "auto" or a non-negative integer

_overrides: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "gpuio_config_overrides", default={}
)


def _parse(name: str, raw: str, default: Any, var: str) -> Any:
    if isinstance(default, bool):
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{var}={raw!r}: expected true or false")
    if isinstance(default, int):
        try:
            return parse_size(raw)
        except ValueError:
            raise ConfigError(
                f"{var}={raw!r}: expected an integer, optionally with "
                "a KiB/MiB/GiB suffix"
            ) from None
    return raw


def parse_size(raw: str) -> int:
    """Bytes in ``raw``: an integer, optionally with a KiB/MiB/GiB (or K/M/G) suffix; a ``ValueError`` if not."""
    text = raw.strip()
    for suffix, mult in (("KiB", KiB), ("MiB", MiB), ("GiB", GiB), ("K", KiB), ("M", MiB), ("G", GiB)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def _check(name: str, value: Any, var: str = "") -> Any:
    if name not in DEFAULTS:
        raise ConfigError(f"unknown setting {name!r}; settings are: {', '.join(sorted(DEFAULTS))}")
    default = DEFAULTS[name][0]
    if name in _AUTO_OR_COUNT:  # "auto" or a non-negative integer
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        default = 0
    if isinstance(value, str) and not isinstance(default, str):
        value = _parse(name, value, default, var or f"GPUIO_{name.upper()}")
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"setting {name!r} must be True or False, got {value!r}")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            either = "'auto' or " if name in _AUTO_OR_COUNT else ""
            raise ConfigError(f"setting {name!r} must be {either}a non-negative integer, got {value!r}")
    choices = {
        "backend": ("auto", "posix", "kvikio"),
        "pinned": ("auto", "true", "false"),
        "kvikio_compat": ("auto", "on", "off"),
        "remote_client": ("auto", "obstore", "urllib3"),
    }.get(name)
    if choices is not None:
        value = str(value).lower()
        if value not in choices:
            raise ConfigError(f"setting {name!r} is {value!r}; choose one of {', '.join(choices)}")
    return value


def get(name: str) -> Any:
    """The value of setting ``name``: override, else ``GPUIO_<NAME>`` (else its former
    name, ``ENV_ALIASES``), else default."""
    over = _overrides.get()
    if name in over:
        return over[name]
    if name not in DEFAULTS:
        _check(name, None)
    var = f"GPUIO_{name.upper()}"
    if var not in os.environ and name in ENV_ALIASES:
        var = ENV_ALIASES[name]
    raw = os.environ.get(var)
    if raw is not None:
        return _check(name, raw, var)
    return DEFAULTS[name][0]


def settings() -> dict[str, Any]:
    """All settings as they stand now."""
    return {name: get(name) for name in DEFAULTS}


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily change settings: ``with gpuio.config.override(io_threads=32): ...``."""
    checked = {name: _check(name, value) for name, value in values.items()}
    token = _overrides.set({**_overrides.get(), **checked})
    try:
        yield
    finally:
        _overrides.reset(token)
