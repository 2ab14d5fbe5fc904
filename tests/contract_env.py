"""The cached virtual environments the wheel contract (``tests/gpu_contract.py``) runs in.

One per flavor of ``tests/gpu_wheels.txt`` (cu13, cu12): the pinned GPU wheels installed
into a new virtual environment of its own, which sees the packages of the interpreter
that makes it (gpuio among them) through a ``.pth`` file that adds that interpreter's
site-packages folders. Not ``venv --system-site-packages``: run from a virtual
environment, that exposes the *base* interpreter's packages, not the environment's.
The pinned wheels come first on ``sys.path``, so they win over any other copy.

An environment is made once and reused while its key holds: the interpreter (version and
prefix), the folders it exposes, this checkout and the pins. It is made with the
package index (pip's download cache makes it seconds after the first time).

    python tests/contract_env.py cu13        # make it if needed; prints its python
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "tests" / "gpu_wheels.txt"


class ContractEnvError(RuntimeError):
    """The contract environment cannot be made; the message says what failed."""


def wheels() -> dict[str, list[str]]:
    """``tests/gpu_wheels.txt`` as flavor -> pinned requirements."""
    out: dict[str, list[str]] = {}
    for line in PINS.read_text().splitlines():
        words = line.split("#")[0].split()
        if words:
            out.setdefault(words[0], []).append(words[1])
    return out


def site_dirs() -> list[str]:
    """The running interpreter's site-packages folders: a virtual environment's own (and
    the base interpreter's when it includes them), and the user's when it is in use."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.getusersitepackages() in sys.path:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def cache_dir() -> Path:
    return Path(os.environ.get("GPUIO_CONTRACT_DIR") or Path.home() / ".cache" / "gpuio-contract")


def ensure(flavor: str, cache: Path | None = None) -> Path:
    """The python of ``flavor``'s contract environment, made first if needed."""
    pins = wheels()[flavor]
    parents = site_dirs()
    made_for = {"python": sys.version, "prefix": sys.prefix, "checkout": str(ROOT), "site": parents, "pins": pins}
    key = hashlib.sha1(json.dumps(made_for, sort_keys=True).encode()).hexdigest()[:12]
    cache = cache or cache_dir()
    target = cache / f"{flavor}-{key}"
    python = target / "bin" / "python"
    if (target / "complete").exists():
        return python
    building = cache / f"{flavor}-{key}.{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    t0 = time.monotonic()
    _run([sys.executable, "-m", "venv", "--without-pip", str(building)], "making the virtual environment")
    purelib = _run([str(building / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   "asking the new environment for its site-packages").strip()
    # one line that Python's site module runs at start-up: the running interpreter's folders
    # after the environment's own, with their .pth files (editable installs) processed
    adds = "; ".join(f"site.addsitedir({d!r})" for d in parents)
    Path(purelib, "_gpuio_contract_parent.pth").write_text(f"import site; {adds}\n")
    # the running interpreter's pip (visible through that file) installs into the new
    # environment; --ignore-installed: a pinned wheel the parent has too still lands here
    _run([str(building / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-compile", "--ignore-installed",
          "--disable-pip-version-check", "--quiet", "--only-binary=:all:", *pins],
         f"installing the {flavor} GPU wheels (package index unreachable?)")
    for stale in cache.glob(f"{flavor}-*"):
        if stale != building and _replaced(stale, made_for):
            shutil.rmtree(stale, ignore_errors=True)
    building.rename(target)  # venv scripts name their folder; bin/python itself does not
    made_for["seconds"] = round(time.monotonic() - t0, 1)
    (target / "complete").write_text(json.dumps(made_for) + "\n")
    return python


def _replaced(env: Path, made_for: dict) -> bool:
    """Whether an older environment is for the same interpreter and checkout (earlier pins
    or packages), or for an interpreter or checkout that is gone; another checkout's stays."""
    try:
        old = json.loads((env / "complete").read_text())
    except (OSError, ValueError):  # unfinished, or from before this format: another run may be making it
        return time.time() - env.stat().st_mtime > 3600
    same = old.get("prefix") == made_for["prefix"] and old.get("checkout") == made_for["checkout"]
    return same or not (os.path.isdir(old.get("prefix", "")) and os.path.isdir(old.get("checkout", "")))


def _run(cmd: list[str], what: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise ContractEnvError(f"{what} failed: {' '.join(cmd)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


if __name__ == "__main__":
    try:
        print(ensure(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else None))
    except (ContractEnvError, KeyError, IndexError) as exc:
        sys.exit(f"contract_env: {exc!r}; usage: python tests/contract_env.py FLAVOR [CACHE_DIR]")
