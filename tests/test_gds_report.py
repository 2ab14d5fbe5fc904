"""GDS is reported only where cuFile really uses it, and a buffer cuFile will not
register is read unregistered instead of failing every read.

No GPU and no cuFile here: a stand-in ``kvikio`` package (the module names and calls
of kvikio 26.10: ``defaults.is_compat_mode_preferred``, ``cufile_driver.get``,
``memory_register``, ``CuFile.pread`` returning a future) plays each driver state, in a
subprocess so that the real import machinery loads it; its ``CuFile`` reads with
``os.pread`` into host memory. What runs is gpuio's: ``gpuio info`` and the kvikio
backend's read of a real file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

KVIKIO = '''
import enum, os
__version__ = "26.10.0"
class CompatMode(enum.IntEnum):
    OFF = 0
    ON = 1
    AUTO = 2
STATE = {state!r}
registered = []
def memory_register(buf):
    registered.append(buf.size)
    if STATE.get("register_fails"):
        raise RuntimeError("cuFile error: CU_FILE_INTERNAL_ERROR (BAR1 memory exhausted)")
def memory_deregister(buf):
    pass
class _Done:
    def __init__(self, n):
        self.n = n
    def get(self):
        return self.n
class CuFile:
    def __init__(self, path, flags="r"):
        self.fd = os.open(path, os.O_RDONLY)
    def pread(self, buf, size, file_offset=0):
        return _Done(os.preadv(self.fd, [memoryview(buf)[:size]], file_offset))
    def close(self):
        os.close(self.fd)
'''
DEFAULTS = '''
import kvikio
_settings = {"compat_mode": kvikio.CompatMode.AUTO}
def set(config):
    _settings.update(config)
def get(name):
    return _settings[name]
def is_compat_mode_preferred():
    return bool(kvikio.STATE["compat"])
'''
DRIVER = '''
import kvikio
def get(name):
    if name != "is_gds_available":
        raise KeyError(name)
    if kvikio.STATE.get("driver_error"):
        raise RuntimeError("cuFile error: CU_FILE_DRIVER_NOT_INITIALIZED")
    return kvikio.STATE["gds"]
'''


def run(tmp_path, state, script, *, nvfs, driver=True):
    pkg = tmp_path / "kvikio"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text(KVIKIO.format(state=state))
    (pkg / "defaults.py").write_text(DEFAULTS)
    if driver:
        (pkg / "cufile_driver.py").write_text(DRIVER)
    nvfs_path = tmp_path / "nvidia-fs"
    if nvfs:
        nvfs_path.mkdir(exist_ok=True)
    prelude = f"import gpuio.storage._kvikio\ngpuio.storage._kvikio.NVIDIA_FS = {str(nvfs_path)!r}\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    done = subprocess.run([sys.executable, "-W", "always", "-c", prelude + textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def info_line(tmp_path, state, **kw):
    out = run(tmp_path, state, "from gpuio import cli\ncli.main(['info'])\n", **kw).stdout
    return next(x for x in out.splitlines() if x.strip().startswith("kvikio"))


@pytest.mark.parametrize("state, nvfs, driver, want", [
    ({"compat": True, "gds": True}, True, True, "kvikio compat mode: POSIX reads"),
    ({"compat": False, "gds": True}, False, True, "cuFile compat mode: POSIX reads; no nvidia-fs driver"),
    ({"compat": False, "gds": False}, True, True, "cuFile compat mode: POSIX reads; cuFile reports no GDS"),
    ({"compat": False, "gds": True, "driver_error": True}, False, True, "cuFile compat mode: POSIX reads"),
    ({"compat": False, "gds": True}, True, True, "GDS (kvikio 26.10.0; cuFile with the nvidia-fs driver)"),
    ({"compat": False}, True, False, "GDS (kvikio 26.10.0; nvidia-fs loaded, cuFile's driver properties unreadable"),
])
def test_info_says_gds_only_when_cufile_uses_it(tmp_path, state, nvfs, driver, want):
    line = info_line(tmp_path, state, nvfs=nvfs, driver=driver)
    assert want in line, line
    assert ("-> GDS" in line) == want.startswith("GDS"), line


READ = """
import os
import numpy as np
from gpuio.storage.buffers import BufferPool
from gpuio.index import Extents, SampleIndex
from gpuio.storage.plan import build_plan
from gpuio.storage._kvikio import KvikioBackend
import kvikio

blob = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8)
with open("data.bin", "wb") as f:
    f.write(blob.tobytes())
files = SampleIndex([os.path.abspath("data.bin")], {"data": Extents(np.zeros(1), np.zeros(1), np.ones(1))}).files
backend = KvikioBackend(threads=2)
pool = BufferPool(1 << 24)
for batch in range(3):  # three batches, each into a new buffer (the earlier ones are still held)
    offsets, lengths = np.array([100 * batch, 5000]), np.array([70_000, 123_456])
    plan = build_plan(np.zeros(2, np.int64), offsets, lengths, gap=0, align=1, task_size=1 << 16, parts=1)
    lease = pool.acquire(plan.nbytes, "cpu")
    backend.read(plan, files, lease)
    got = np.asarray(lease)
    for d, o, n in zip(plan.sample_dest.tolist(), offsets.tolist(), lengths.tolist()):
        assert (got[d: d + n] == blob[o: o + n]).all()
    globals()["keep%d" % batch] = lease
print("gds", backend.gds, "registered", len(kvikio.registered), "unregistered", backend.unregistered)
"""


def test_refused_registration_reads_unregistered_and_warns_once(tmp_path):
    done = run(tmp_path, {"compat": False, "gds": True, "register_fails": True}, READ, nvfs=True)
    assert "gds True registered 1 unregistered cuFile cannot register" in done.stdout, done.stdout
    assert done.stderr.count("RuntimeWarning") == 1 and "unregistered GPU memory" in done.stderr, done.stderr


def test_buffers_are_registered_once_each_where_gds_is_used(tmp_path):
    done = run(tmp_path, {"compat": False, "gds": True}, READ, nvfs=True)
    assert "gds True registered 3 unregistered None" in done.stdout, done.stdout


def test_no_registration_where_cufile_reads_in_compat_mode(tmp_path):
    done = run(tmp_path, {"compat": False, "gds": True}, READ, nvfs=False)
    assert "gds False registered 0 unregistered None" in done.stdout, done.stdout
