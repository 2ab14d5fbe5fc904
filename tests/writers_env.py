"""The writers of other libraries that the format tests need but pip cannot install as
test extras: mosaicml-streaming and litdata require torchvision, whose PyPI build does not
load beside the CPU torch the README installs (and streaming caps numpy below 2.2). Their
writers and readers need neither, so they are installed here without their dependencies
(what they do import is in the test extra), once per machine, into the user's cache folder
(``~/.cache/gpuio-test/writers-<hash>``), and put on ``sys.path``. A package the
environment already has is taken from there.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sys

PACKAGES = {"streaming": "mosaicml-streaming==0.13.0", "litdata": "litdata==0.2.76"}


def add_writers() -> None:
    """Make ``streaming`` and ``litdata`` importable (installing the missing ones)."""
    missing = [spec for module, spec in PACKAGES.items()
               if module not in sys.modules and importlib.util.find_spec(module) is None]
    if not missing:
        return
    tag = hashlib.sha256(" ".join(sorted(PACKAGES.values())).encode()).hexdigest()[:12]
    folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpuio-test",
                          f"writers-{tag}")
    done = os.path.join(folder, ".installed")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install per machine, whoever asks first
        if not os.path.exists(done):
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                            os.path.join(folder, "site"), *sorted(PACKAGES.values())], check=True, timeout=600)
            open(done, "w").close()
    site = os.path.join(folder, "site")
    if site not in sys.path:
        sys.path.append(site)  # after the environment's own packages; spawned workers inherit sys.path
    importlib.invalidate_caches()
