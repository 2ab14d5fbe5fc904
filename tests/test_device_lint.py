"""CuPy work on worker threads happens inside the GPU it is for (issue 24, defect 3).

CuPy allocates, copies and launches on the *current* device, which is per thread and is
GPU 0 on any thread that has not entered another. A stage or pool thread of a loader on
``cuda:1`` that calls ``cp.empty``, ``xp.stack`` or ``array.copy()`` outside
``with cp.cuda.Device(1)`` puts the result on GPU 0 (without peer access CuPy refuses
it; with it, a ``cuda:1`` tensor lies over GPU-0 memory).

The lint, precisely:

- **Worker-thread entries** are the functions (and lambdas) named as
  ``threading.Thread(target=...)``, as the first argument of ``<pool>.submit`` or
  ``<pool>.map``, and as the function of a ``Stage`` whose ``gpu`` is not given or a
  literal false (the executor runs a GPU stage inside its device; a ``gpu=`` expression
  counts as a GPU stage, since on the CPU no CuPy is in play). Wrappers such as
  ``functools.partial(f, ...)`` and ``_weak(f)`` are looked through.
- **Reached functions** are the entries and, transitively, what they call *outside* a
  device block: plain names (functions of the module, nested ones included, and names
  imported from gpuio modules), ``self.``/``cls.`` methods of the enclosing class, and
  ``module.function`` through a gpuio module imported by name.
- **Flagged**, in a reached function and not inside a ``with <...>.cuda.Device(...)``
  block *of that same function* (a lambda or nested function may run on another
  thread, so an enclosing function's block does not count): every call on ``cp``,
  ``cupy`` or ``xp`` (the array module, which is CuPy on a GPU) except the few that
  allocate nothing (``NO_DEVICE_WORK``), and the array methods ``COPY_METHODS`` unless
  their receiver is provably a NumPy value (a ``np.`` call, or a local name only ever
  assigned from one).

What it cannot see, so that a clean run is read for what it is: calls through other
objects (``reader.read()``, ``stage.fn()``, an op's ``__call__``), arithmetic and
indexing on CuPy arrays (kernels on the current device too), and array methods outside
``COPY_METHODS``. The runtime rule stays: a function that a worker thread runs enters
the GPU of its data before any CuPy work.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"gpuio": "gpuio", "ops": "gpuio.ops", "formats": "gpuio.formats"}  # folder -> import name

ARRAY_MODULES = {"cp", "cupy", "xp"}
# calls on the array module that neither allocate nor run anything on a device
NO_DEVICE_WORK = {"dtype", "get_array_module", "asnumpy", "result_type", "promote_types", "can_cast", "iinfo",
                  "finfo", "isscalar", "ndim", "shape", "size", "Device",
                  "bool_", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
                  "float32", "float64", "complex64", "complex128"}
COPY_METHODS = {"copy", "astype", "flatten", "ravel"}
HOST_MODULES = {"np", "numpy"}

# Worker-thread CuPy work outside the device that another change fixes (issue 24: the
# serve batcher); each file must still have such a finding, so that the list only shrinks.
KNOWN_OFFENDERS: set[str] = {"gpuio/serve.py"}

# Entries that run only where no GPU is in play, with the reason.
CPU_ONLY_ENTRIES = {
    # Loader._stages: on a GPU, collate is a GPU stage of its own; on the CPU it is
    # chained after the last stage, the Stage this lint sees.
    ("gpuio/loader.py", "_collate"),
}

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass
class Module:
    rel: str  # path from the repository root
    tree: ast.Module
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    defs: dict[str, list[ast.AST]] = field(default_factory=dict)  # every def by name, nested and methods
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (gpuio module, name)

    @classmethod
    def parse(cls, rel: str, source: str) -> Module:
        m = cls(rel, ast.parse(source))
        for node in ast.walk(m.tree):
            for child in ast.iter_child_nodes(node):
                m.parents[child] = node
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                m.defs.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gpuio":
                for alias in node.names:
                    m.imports[alias.asname or alias.name] = (node.module, alias.name)
        return m

    def up(self, node: ast.AST, kind: type | tuple[type, ...]) -> ast.AST | None:
        node = self.parents.get(node)
        while node is not None and not isinstance(node, kind):
            node = self.parents.get(node)
        return node

    def in_device(self, node: ast.AST) -> bool:
        """Inside a ``with <...>.cuda.Device(...)`` block of the function that holds ``node``."""
        node = self.parents.get(node)
        while node is not None and not isinstance(node, _FUNCTIONS):
            if isinstance(node, ast.With) and any(
                    isinstance(item.context_expr, ast.Call)
                    and ast.unparse(item.context_expr.func).endswith("cuda.Device") for item in node.items):
                return True
            node = self.parents.get(node)
        return False


def _name(node: ast.AST) -> str:
    return getattr(node, "name", "<lambda>")


def _host_names(fn: ast.AST) -> set[str]:
    """Local names of ``fn`` that hold NumPy values wherever they are read: parameters
    annotated with a NumPy type or rebound from a NumPy call by the body's first
    statement that names them, and names only ever assigned from NumPy calls (or from
    calls on such names). The largest such set: a name is dropped once any of its values
    is not provably on the host."""
    values: dict[str, list[ast.AST | None]] = {}  # None: a value not known (a parameter, a loop variable)
    params = [] if isinstance(fn, ast.Lambda) else [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    body = fn.body if isinstance(fn.body, list) else [fn.body]
    on_host = ast.Call(ast.Name("np"), [], [])  # what a NumPy call gives
    for arg in params:
        first = next((stmt for stmt in body if any(isinstance(n, ast.Name) and n.id == arg.arg
                                                   for n in ast.walk(stmt))), None)
        rebound = (isinstance(first, ast.Assign) and len(first.targets) == 1
                   and isinstance(first.targets[0], ast.Name) and first.targets[0].id == arg.arg)
        typed = arg.annotation is not None and ast.unparse(arg.annotation).split(".")[0] in HOST_MODULES
        values.setdefault(arg.arg, []).append(on_host if typed or rebound else None)
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.comprehension)) else []
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    # a part of a tuple, a loop variable: not the whole value
                    whole = isinstance(target, ast.Name) and isinstance(node, (ast.Assign, ast.AnnAssign))
                    values.setdefault(name.id, []).append(node.value if whole else None)
    host = set(values)
    while True:
        dropped = {n for n in host if not all(v is not None and _is_host(v, host) for v in values[n])}
        if not dropped:
            return host
        host -= dropped


def _is_host(expr: ast.AST, host: set[str]) -> bool:
    while isinstance(expr, (ast.Call, ast.Attribute, ast.Subscript)):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return isinstance(expr, ast.Name) and (expr.id in HOST_MODULES or expr.id in host)


class Project:
    """The modules of the package, with the lint's two questions: which functions run on
    worker threads outside a device block, and what CuPy work they do there."""

    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules  # import name -> module

    @classmethod
    def from_tree(cls, root: Path = ROOT) -> Project:
        modules = {}
        for folder, package in PACKAGES.items():
            for path in sorted((root / folder).rglob("*.py")):
                parts = [p for p in path.relative_to(root / folder).with_suffix("").parts if p != "__init__"]
                modules[".".join([package, *parts])] = Module.parse(str(path.relative_to(root)), path.read_text())
        return cls(modules)

    @classmethod
    def from_sources(cls, sources: dict[str, str]) -> Project:
        """``{import name: source}``, for the lint's own tests."""
        return cls({name: Module.parse(name.replace(".", "/") + ".py", textwrap.dedent(src))
                    for name, src in sources.items()})

    def _module_functions(self, module: str, name: str) -> list[tuple[Module, ast.AST]]:
        m = self.modules.get(module)
        if m is None:
            return []
        return [(m, d) for d in m.defs.get(name, []) if isinstance(m.parents.get(d), ast.Module)]

    def resolve(self, m: Module, expr: ast.AST, site: ast.AST) -> list[tuple[Module, ast.AST]]:
        """The functions ``expr`` (a callee or a function passed on) may be."""
        if isinstance(expr, ast.Lambda):
            return [(m, expr)]
        if isinstance(expr, ast.Name):
            if expr.id in m.imports:
                return self._module_functions(*m.imports[expr.id])
            return [(m, d) for d in m.defs.get(expr.id, []) if not isinstance(m.parents.get(d), ast.ClassDef)]
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            base = expr.value.id
            if base in ("self", "cls"):
                owner = m.up(site, ast.ClassDef)
                return [(m, d) for d in getattr(owner, "body", [])
                        if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d.name == expr.attr]
            if base in m.imports:
                return self._module_functions(".".join(m.imports[base]), expr.attr)
        if isinstance(expr, ast.Call):  # a wrapper: functools.partial(f, ...), _weak(f)
            return [found for arg in expr.args for found in self.resolve(m, arg, site)]
        return []

    def entries(self) -> list[tuple[Module, ast.AST]]:
        """The functions that start worker threads' work (see the module docstring)."""
        found = []
        for m in self.modules.values():
            for call in ast.walk(m.tree):
                if not isinstance(call, ast.Call):
                    continue
                callee = ast.unparse(call.func)
                given = {k.arg: k.value for k in call.keywords}
                if callee.split(".")[-1] == "Thread" and "target" in given:
                    found += self.resolve(m, given["target"], call)
                elif isinstance(call.func, ast.Attribute) and call.func.attr in ("submit", "map") and call.args:
                    found += self.resolve(m, call.args[0], call)
                elif callee.split(".")[-1] == "Stage" and len(call.args) >= 2:
                    gpu = given.get("gpu")
                    if gpu is None or (isinstance(gpu, ast.Constant) and not gpu.value):
                        found += self.resolve(m, call.args[1], call)
        return [(m, fn) for m, fn in found if (m.rel, _name(fn)) not in CPU_ONLY_ENTRIES]

    def worker_cupy_outside_device(self) -> dict[str, list[str]]:
        """``{file: ["line function: call", ...]}`` of CuPy work that worker threads do
        outside a ``with <cupy>.cuda.Device(...)`` block."""
        found: dict[str, list[str]] = {}
        seen: set[int] = set()
        todo = self.entries()
        while todo:
            m, fn = todo.pop()
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            host = _host_names(fn)
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call) or m.in_device(node):
                    continue
                todo += self.resolve(m, node.func, node)
                func = node.func
                if not isinstance(func, ast.Attribute):
                    continue
                root = func.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                on_module = isinstance(root, ast.Name) and root.id in ARRAY_MODULES
                if (on_module and func.attr not in NO_DEVICE_WORK) or (
                        not on_module and func.attr in COPY_METHODS and not _is_host(func.value, host)):
                    found.setdefault(m.rel, []).append(f"{node.lineno} {_name(fn)}: {ast.unparse(node)[:80]}")
        return found


def test_worker_threads_do_cupy_work_inside_the_device():
    found = Project.from_tree().worker_cupy_outside_device()
    new = {f: lines for f, lines in found.items() if f not in KNOWN_OFFENDERS}
    assert not new, f"CuPy work on a worker thread outside `with cp.cuda.Device(...)` (file: line function): {new}"
    fixed = KNOWN_OFFENDERS - set(found)
    assert not fixed, f"{sorted(fixed)} no longer do CuPy work outside the device: take them off KNOWN_OFFENDERS"


def test_the_lint_sees_every_kind_of_entry_and_work():
    project = Project.from_sources({"gpuio.helpers": """
        import numpy as np

        def copy_rows(data):
            return data.copy()

        def host_only(n):
            rows = np.arange(n)
            return rows.copy(), np.zeros(3).astype(np.int8)
    """, "gpuio.work": """
        import functools
        import threading

        from gpuio.helpers import copy_rows, host_only
        from gpuio import helpers

        class Stages:
            def start(self, pool, cp):
                threading.Thread(target=self._loop).start()
                pool.submit(functools.partial(self._one, 1))
                Stage("read", _weak(self._read), workers=1)
                Stage("op", self._gpu_op, gpu=True)
                with cp.cuda.Device(1):
                    pool.map(lambda i: cp.empty(i), range(3))  # the lambda runs on the pool's thread

            def _loop(self, xp, rows):
                out = xp.stack(rows)
                with cp.cuda.Device(1):
                    inside = xp.stack(rows), copy_rows(rows)  # called inside: runs on the device
                return out, xp.float32, host_only(3)

            def _one(self, k, data):
                return helpers.copy_rows(data)

            def _read(self, data):
                return data.astype("f4")

            def _gpu_op(self, cp):
                return cp.zeros(3)
    """})
    found = project.worker_cupy_outside_device()
    lines = sorted(entry.split(" ", 1)[1] for entries in found.values() for entry in entries)
    assert lines == ["<lambda>: cp.empty(i)", "_loop: xp.stack(rows)", "_read: data.astype('f4')",
                     "copy_rows: data.copy()"], found
