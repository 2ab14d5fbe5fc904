"""The Python 3.12 environment the serving tests and bench/serve.py run the server in.

PyTriton 0.7's Triton loads models only under Python 3.12 (see ``gpuio.serve``), and the
tests run under the project's Python (3.11 in CI). This makes, once, a 3.12 virtual
environment with ``gpuio[serve]`` (gpuio installed editable from this checkout, its C
extensions built for 3.12; no torch) in the cache folder, and checks it on every use:

    python tests/serve_env.py        # make or check it; prints its python

The 3.12 interpreter: ``$GPUIO_SERVE_PYTHON``, else ``python3.12`` on PATH (through pyenv,
the newest 3.12 it has). Anything missing is an error, never a skip.
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("nvidia-pytriton", "tritonclient")  # the serve extra, checked by import below


class ServeEnvError(RuntimeError):
    """The 3.12 serving environment cannot be made; the message says what failed."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago (for Triton's
    HTTP, gRPC and metrics endpoints), drawn below the kernel's ephemeral range: every
    outgoing connection takes its local port from that range, and one made while the
    server starts could take a port picked there (Triton then never becomes ready)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    candidates = list(range(10_000, ephemeral))
    random.shuffle(candidates)  # two runs at once rarely try the same ports
    ports = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise ServeEnvError(f"fewer than {n} free TCP ports between 10000 and {ephemeral}")


def _base_python() -> tuple[list[str], dict[str, str]]:
    """The command and environment that run a Python 3.12 interpreter."""
    env = dict(os.environ)
    given = os.environ.get("GPUIO_SERVE_PYTHON")
    if given:
        return [given], env
    if shutil.which("pyenv"):
        versions = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True, text=True).stdout.split()
        found = sorted((v for v in versions if v.startswith("3.12.")), key=lambda v: [int(x) for x in v.split(".")
                                                                                        if x.isdigit()])
        if found:
            env["PYENV_VERSION"] = found[-1]
    if shutil.which("python3.12", path=env.get("PATH")) is None:
        raise ServeEnvError("the serving tests need Python 3.12 (PyTriton's Triton loads models only under 3.12): "
                            "none on PATH; install it or set GPUIO_SERVE_PYTHON to one")
    return ["python3.12"], env


def venv_dir() -> str:
    """The environment's folder, one per checkout (its gpuio is installed editable from
    there) and dependency list."""
    cache = os.environ.get("GPUIO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpuio")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:  # changed dependencies make a new one
        project = tomllib.load(f)["project"]
    needs = [ROOT, *project["dependencies"], *project["optional-dependencies"]["serve"]]
    key = hashlib.sha1("\n".join(needs).encode()).hexdigest()[:10]
    return os.path.join(cache, f"serve-venv-py312-{key}")


def gpuio_source(python: str) -> str | None:
    """The folder holding the gpuio package ``python`` imports (a checkout, for an editable
    install), if gpuio.ops and gpuio.formats come from there too; else None. Asked from
    outside any checkout and isolated (-I): run in a checkout, ``import gpuio`` finds that
    checkout's package whatever the environment has installed."""
    probe = "import gpuio, gpuio.ops, gpuio.formats; print(gpuio.__file__, gpuio.ops.__file__, gpuio.formats.__file__)"
    with tempfile.TemporaryDirectory() as away:
        done = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, cwd=away)
    if done.returncode != 0:
        return None
    files = done.stdout.split()
    top = os.path.dirname(os.path.dirname(files[0]))
    return top if all(f.startswith(top + os.sep) for f in files) else None


def _run(cmd: list[str], what: str, **kw: object) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise ServeEnvError(f"{what} failed ({' '.join(cmd)}), exit {done.returncode}:\n"
                            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def _ready(python: str) -> bool:
    """gpuio imports from this checkout with its 3.12 extensions, built after their C
    sources and headers (pyproject.toml's ext-modules) changed last, and PyTriton imports."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extensions = tomllib.load(f)["tool"]["setuptools"]["ext-modules"]
    for ext in extensions:
        inputs = [os.path.join(ROOT, p) for p in ext["sources"] + ext.get("depends", [])]
        folder = os.path.dirname(inputs[0])
        built = glob.glob(os.path.join(folder, ext["name"].rsplit(".", 1)[1] + ".cpython-312-*.so"))
        if built and os.path.getmtime(built[0]) < max(os.path.getmtime(p) for p in inputs):
            return False
    if gpuio_source(python) != ROOT:
        return False
    probe = "import gpuio.ops._resample, gpuio.storage._readloop, pytriton.triton, tritonclient.http, tritonclient.grpc"
    with tempfile.TemporaryDirectory() as away:
        return subprocess.run([python, "-I", "-c", probe], capture_output=True, cwd=away).returncode == 0


def _replaced(path: str) -> bool:
    """Whether an environment is out of use: this checkout's for another dependency list, or
    one whose checkout is gone, or one made before environments recorded their checkout.
    Another checkout's stays, and so does an unfinished one for an hour (being made)."""
    try:
        with open(os.path.join(path, ".complete")) as f:
            made_from = f.read().strip()
    except OSError:
        return time.time() - os.path.getmtime(path) > 3600
    return made_from in ("", ROOT) or not os.path.isdir(made_from)


def ensure(log=print) -> str:
    """The 3.12 environment's python, made or brought up to date first (minutes, once)."""
    path = venv_dir()
    python = os.path.join(path, "bin", "python")
    if os.path.exists(python) and _ready(python):
        return python
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(path, ".complete")):
        log(f"making the Python 3.12 serving environment in {path} (once)")
        shutil.rmtree(path, ignore_errors=True)
        for old in glob.glob(os.path.join(os.path.dirname(path), "serve-venv-py312-*")):
            if _replaced(old):
                shutil.rmtree(old, ignore_errors=True)
        cmd, env = _base_python()
        _run([*cmd, "-m", "venv", path], "making the virtual environment", env=env)
        _run([python, "-m", "pip", "install", "-q", "setuptools>=74.1", "wheel"], "installing setuptools")
        _run([python, "-m", "pip", "install", "-q", "--no-build-isolation", "-e", f"{ROOT}[serve]"],
             "installing gpuio[serve]")
        with open(os.path.join(path, ".complete"), "w") as f:
            f.write(ROOT + "\n")  # the checkout it serves
    else:  # this checkout's extensions are not built for 3.12 yet, or its C sources changed
        _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", ROOT],
             "installing gpuio from this checkout")
    if not _ready(python):
        raise ServeEnvError(f"{path}: gpuio (from {ROOT}) or PyTriton does not import there after installing")
    log(f"serving environment ready in {time.perf_counter() - t0:.0f} s: {python}")
    return python


if __name__ == "__main__":
    try:
        print(ensure(log=lambda m: print(m, file=sys.stderr)))
    except ServeEnvError as exc:
        print(f"serve_env: {exc}", file=sys.stderr)
        sys.exit(1)
