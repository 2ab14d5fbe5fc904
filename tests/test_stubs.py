"""Every C extension has a .pyi stub beside its source whose functions are exactly the
module's public callables, so that the documented API cannot drift from the built one."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXTENSIONS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]


def test_every_extension_is_listed():
    assert {ext["name"] for ext in EXTENSIONS} == {"gpuio.storage._readloop", "gpuio.formats._tar",
                                                   "gpuio.ops._resample",
                                                   "gpuio.ops._augment", "gpuio.ops._audio", "gpuio.ops._flac",
                                                   "gpuio.ops._jpeg", "gpuio.ops._video"}


@pytest.mark.parametrize("ext", EXTENSIONS, ids=[ext["name"] for ext in EXTENSIONS])
def test_stub_functions_equal_the_built_module_s(ext):
    stub = REPO / Path(ext["sources"][0]).with_suffix(".pyi")
    assert stub.is_file(), f"{ext['name']}: no stub {stub.relative_to(REPO)}"
    tree = ast.parse(stub.read_text(), filename=str(stub))
    documented = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    undocumented = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                    and not ast.get_docstring(node)]
    assert not undocumented, f"{stub.name}: functions without a docstring: {undocumented}"
    try:
        module = importlib.import_module(ext["name"])
    except ImportError as exc:  # the install builds every one where a C compiler and libjpeg exist; CI has them
        pytest.fail(f"{ext['name']} was not built: {exc}")
    built = {name for name in dir(module) if not name.startswith("_") and callable(getattr(module, name))}
    assert documented == built, f"{stub.name}: stub {sorted(documented)}, built {sorted(built)}"
