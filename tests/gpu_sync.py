"""Every op's GPU run fails on a device synchronization nobody meant.

Each GPU stage of a loader runs on a stream of its own so that stages overlap; an op that
reads a device value back on the host waits for all the work queued on its stream and
stops that overlap. ``forbid_syncs_in_ops`` (an autouse fixture of tests/conftest.py
applies it to every ``gpu``-marked test) wraps each op class's ``__call__`` so that, on a
GPU batch, it runs inside ``cupyx.allow_synchronize(False)``: CuPy then raises
``DeviceSynchronized`` where it reads a device value for the host (``ndarray.get``,
``cupy.asnumpy``, ``float()``/``int()``/``bool()`` of an array, ``Device.synchronize``),
in the op's thread, whichever thread that is (a loader's stage). The test's own code
around the ops may read back freely. Stream and event waits are not declared by CuPy;
the lint of tests/test_device_lint.py finds those and lists the meant ones.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

# Ops whose GPU path reads device values back by design, with the reason.
SYNCS_MEANT = {
    "NonsilentRegion": "its begin and length are host arrays, as DALI's (ops/ragged.py segment_span)",
    "PythonFunction": "it runs the user's function, whose reads are the user's to make",
}


def op_classes() -> list[type]:
    """Every subclass of ``gpuio.batch.Op`` that gpuio.ops defines, at any depth."""
    import gpuio.ops  # noqa: F401  (imports every op module)
    from gpuio.batch import Op

    out, todo = [], [Op]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


def forbid_syncs_in_ops(monkeypatch: Any) -> None:
    """Each op class's own ``__call__`` runs without syncs on a GPU batch (see above)."""
    for cls in op_classes():
        if "__call__" in vars(cls) and cls.__name__ not in SYNCS_MEANT:
            monkeypatch.setattr(cls, "__call__", _without_syncs(vars(cls)["__call__"]))


def _without_syncs(call: Any) -> Any:
    @functools.wraps(call)
    def run(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(getattr(batch, "device", None), "is_cuda", False):
            return call(self, batch, *args, **kwargs)
        import cupyx

        with contextlib.ExitStack() as stack:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated in CuPy 10, still in 14: it works
                stack.enter_context(cupyx.allow_synchronize(False))
            return call(self, batch, *args, **kwargs)

    return run
