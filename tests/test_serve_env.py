"""The serving environment (``tests/serve_env.py``) serves only the checkout it was made
from: its check asks the environment, from outside any checkout, where its gpuio comes
from, and its folder is keyed by the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import serve_env
from contract_env import site_dirs

ROOT = Path(__file__).resolve().parents[1]


def _venv(where: Path, folders: list[str]) -> str:
    """A virtual environment (no packages of its own) that sees ``folders``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = str(where / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True,
                             capture_output=True, text=True).stdout.strip()
    adds = "; ".join(f"site.addsitedir({d!r})" for d in folders)
    Path(purelib, "test-env.pth").write_text(f"import site; {adds}\n" if folders else "")
    return python


def test_gpuio_is_looked_up_outside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # where the tests run: `import gpuio` from here finds the checkout's package
    assert serve_env.gpuio_source(_venv(tmp_path / "empty", [])) is None
    other = tmp_path / "other"  # another checkout's gpuio, installed as a wheel lays it out
    for package in ("gpuio", "gpuio/ops", "gpuio/formats"):
        (other / package).mkdir(parents=True)
        (other / package / "__init__.py").write_text("")
    assert serve_env.gpuio_source(_venv(tmp_path / "wheel", [str(other)])) == str(other)
    assert serve_env.gpuio_source(_venv(tmp_path / "this", site_dirs())) == str(ROOT)


def test_one_environment_per_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUIO_CACHE_DIR", str(tmp_path / "cache"))
    here = serve_env.venv_dir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    monkeypatch.setattr(serve_env, "ROOT", str(tmp_path))  # a second checkout of the same commit
    assert serve_env.venv_dir() != here
