"""The storage core's and the formats' C compile without a warning under -Wall -Wextra
(a warning there is often a real defect: a value unused, a sign mixed up, a field left
out), with the compiler and Python headers the extensions are built with."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("source", ["gpuio/storage/_readloop.c", "formats/_tar.c"])
def test_c_compiles_without_warnings(source):
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler {cc!r}")
    done = subprocess.run([cc, "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-std=gnu11",
                           f"-I{sysconfig.get_paths()['include']}", str(REPO / source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
