"""A GPU reader's uploads (posix reads into host memory, then one copy to the GPU) do not
wait for the GPU work of the executor's stages: those run on blocking streams, and a copy
on the read thread's current stream (the legacy default stream) waited for all of it,
stalling the read thread. Uploads run on the reader's own non-blocking stream."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gpuio.index import Extents, SampleIndex

pytestmark = pytest.mark.gpu

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""
CYCLES = 2_000_000_000  # about a second


def test_upload_does_not_wait_for_the_stage_streams(tmp_path):
    import cupy as cp

    from gpuio.storage import Reader

    blob = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8)
    (tmp_path / "data.bin").write_bytes(blob.tobytes())
    index = SampleIndex([str(tmp_path / "data.bin")], {"data": Extents(np.zeros(4, np.int64),
                                                                       np.arange(4) * (1 << 20), np.full(4, 1 << 20))})
    with Reader("cuda", backend="posix") as reader:
        reader.read(index, [0])  # the reader's stream and buffers made before the clock starts
        done = {}

        def read_thread():  # a read stage's thread: nothing current but GPU 0's legacy stream
            got = reader.read(index, [3, 1, 2])
            done["stage busy"] = not stage.done
            done["bytes"] = np.concatenate([cp.asnumpy(g) for g in got])

        with cp.cuda.Device(0):
            stage = cp.cuda.Stream(non_blocking=False)  # as the executor's stage streams
            cp.RawKernel(SPIN, "spin")((1,), (1,), (np.int64(CYCLES),), stream=stage)
            worker = threading.Thread(target=read_thread)
            worker.start()
            worker.join()
            stage.synchronize()
    assert done["stage busy"], "the upload waited for the work queued on a stage's (blocking) stream"
    want = np.concatenate([blob[k << 20: (k + 1) << 20] for k in (3, 1, 2)])
    assert np.array_equal(done["bytes"], want)
