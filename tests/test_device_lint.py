"""CuPy work on worker threads happens inside the GPU it is for; the ops' GPU code reads no
device value on the host that nobody meant to (the second lint, at the end).

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
  imported from gpuio modules), ``self.``/``cls.`` methods of the enclosing class,
  ``module.function`` through a gpuio module imported by name, and ``self.x(...)`` /
  ``self.x.method(...)`` where the class stores in ``self.x`` an object of a known class
  (``self.x = Class(...)``, or a parameter annotated ``Class``), and ``p.method(...)``
  on a parameter ``p`` annotated ``Class`` (or ``Class | None``). A function is followed
  once per set of its parameters that its caller passes NumPy values or ``np`` to
  (``stack(rows, np)`` is host work; ``stack(rows, batch.xp)`` is not).
- **Flagged**, in a reached function and not inside a ``with <...>.cuda.Device(...)``
  block (or ``with f(...)`` where ``f`` returns ``<...>.cuda.Device(...)``, possibly
  behind a conditional) *of that same function* (a lambda or nested function may run
  on another thread, so an enclosing function's block does not count): every call on
  ``cp``, ``cupy`` or ``xp`` (the array module, which is CuPy on a GPU; not where it is
  provably NumPy) except the few that allocate nothing (``NO_DEVICE_WORK``), and the
  array methods ``COPY_METHODS`` unless their receiver is provably a NumPy value (a
  ``np.`` call, or a name only ever holding one).

What it cannot see, so that a clean run is read for what it is: calls through other
objects whose class it does not know (``stage.fn()``, an op's ``__call__``, a backend's
``read``), arithmetic and indexing on CuPy arrays (kernels
on the current device too), and array methods outside ``COPY_METHODS``. The runtime
rule stays: a function that a worker thread runs enters the GPU of its data before any
CuPy work.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable
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

# Worker-thread CuPy work outside the device that another change is to fix; each file
# must still have such a finding, so that the list only shrinks.
KNOWN_OFFENDERS: set[str] = set()

# Entries that run only where no GPU is in play, with the reason.
CPU_ONLY_ENTRIES = {
    # Loader._stages: on a GPU, collate is a GPU stage of its own; on the CPU it is
    # chained after the last stage, the Stage this lint sees.
    ("gpuio/pipeline/loader.py", "_collate"),
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

    def in_device(self, node: ast.AST, enters: Callable[[Module, ast.AST], bool]) -> bool:
        """Inside a ``with`` block of the function that holds ``node`` whose context
        ``enters(module, call)`` says enters a GPU."""
        node = self.parents.get(node)
        while node is not None and not isinstance(node, _FUNCTIONS):
            if isinstance(node, ast.With) and any(
                    isinstance(item.context_expr, ast.Call) and enters(self, item.context_expr) for item in node.items):
                return True
            node = self.parents.get(node)
        return False


def _methods(m: Module, cls: ast.AST | None, name: str) -> list[tuple[Module, ast.AST]]:
    return [(m, d) for d in getattr(cls, "body", []) if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef))
            and d.name == name]


def _class_name(annotation: ast.AST | None) -> str | None:
    """The class an annotation names first (``Reader | None`` -> ``Reader``)."""
    if annotation is None:
        return None
    return ast.unparse(annotation).split("|")[0].strip().strip("'\"") or None


def _enters_cuda_device(call: ast.AST) -> bool:
    return isinstance(call, ast.Call) and ast.unparse(call.func).endswith("cuda.Device")


def _device_contexts(rel: str = "gpuio/batch.py") -> set[str]:
    """The methods of ``Batch`` that are context managers yielding inside
    ``with <...>.cuda.Device(...)``: ``with batch.on_device() as cp:`` is a device block."""
    tree = ast.parse((ROOT / rel).read_text())
    return {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
            and any(isinstance(w, ast.With) and any(_enters_cuda_device(i.context_expr) for i in w.items)
                    and any(isinstance(y, ast.Yield) for y in ast.walk(w)) for w in ast.walk(f))}


DEVICE_CONTEXTS = _device_contexts()


def _is_device_call(call: ast.AST) -> bool:
    """``<...>.cuda.Device(...)``, or ``<batch>.on_device()`` (``DEVICE_CONTEXTS``)."""
    return _enters_cuda_device(call) or (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                                         and call.func.attr in DEVICE_CONTEXTS)


def _name(node: ast.AST) -> str:
    return getattr(node, "name", "<lambda>")


def _host_names(fn: ast.AST, given: frozenset[str] = frozenset()) -> set[str]:
    """Local names of ``fn`` that hold NumPy values wherever they are read: parameters
    in ``given`` (a caller passed NumPy values or ``np`` itself), annotated with a NumPy
    type or rebound from a NumPy call by the body's first statement that names them,
    and names only ever assigned from NumPy calls (or from calls on such names). The
    largest such set: a name is dropped once any of its values is not provably on the
    host."""
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
        values.setdefault(arg.arg, []).append(on_host if typed or rebound or arg.arg in given else None)
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.comprehension)) else []
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    # an assigned value (a part of a NumPy tuple, as np.unique's, is NumPy
                    # too); a loop variable: not known
                    known = isinstance(node, (ast.Assign, ast.AnnAssign))
                    values.setdefault(name.id, []).append(node.value if known else None)
    host = set(values)
    while True:
        dropped = {n for n in host if not all(v is not None and _is_host(v, host) for v in values[n])}
        if not dropped:
            return host
        host -= dropped


def _host_params(fn: ast.AST, call: ast.Call, host: set[str]) -> frozenset[str]:
    """The parameters of ``fn`` that ``call`` passes NumPy values (or ``np``) to."""
    if isinstance(fn, ast.Lambda):
        return frozenset()
    names = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
    if names[:1] in (["self"], ["cls"]) and isinstance(call.func, ast.Attribute):
        names = names[1:]
    passed = [*zip(names, call.args), *((k.arg, k.value) for k in call.keywords if k.arg)]
    return frozenset(name for name, value in passed if _is_host(value, host))


def _is_host(expr: ast.AST, host: set[str]) -> bool:
    if isinstance(expr, ast.Constant):
        return True
    if isinstance(expr, (ast.BinOp, ast.Compare, ast.UnaryOp, ast.Tuple)):  # NumPy in, NumPy out
        parts = [getattr(expr, k) for k in ("left", "right", "operand") if hasattr(expr, k)]
        parts += getattr(expr, "comparators", []) + getattr(expr, "elts", [])
        return all(_is_host(p, host) for p in parts)
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
                found = _methods(m, owner, expr.attr)
                if not found:  # an attribute holding an object of a known class: its __call__
                    found = [f for cm, c in self.attribute_classes(m, owner).get(expr.attr, [])
                             for f in _methods(cm, c, "__call__")]
                return found
            if base in m.imports:
                return self._module_functions(".".join(m.imports[base]), expr.attr)
            fn = m.up(site, (ast.FunctionDef, ast.AsyncFunctionDef))  # a parameter annotated with a class
            kinds = {a.arg: _class_name(a.annotation) for a in [*fn.args.args, *fn.args.kwonlyargs]} if fn else {}
            if kinds.get(base):
                return [f for cm, c in self.find_class(m, kinds[base]) for f in _methods(cm, c, expr.attr)]
        if (isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Attribute)
                and isinstance(expr.value.value, ast.Name) and expr.value.value.id == "self"):
            owner = m.up(site, ast.ClassDef)  # self.attr.method(...)
            return [f for cm, c in self.attribute_classes(m, owner).get(expr.value.attr, [])
                    for f in _methods(cm, c, expr.attr)]
        if isinstance(expr, ast.Call):  # a wrapper: functools.partial(f, ...), _weak(f)
            return [found for arg in expr.args for found in self.resolve(m, arg, site)]
        return []

    def find_class(self, m: Module, name: str) -> list[tuple[Module, ast.ClassDef]]:
        """The class ``name`` means in ``m``: defined there, or imported from a gpuio module."""
        if name in m.imports:
            module, name = m.imports[name]
            m = self.modules.get(module)
            if m is None:
                return []
        return [(m, c) for c in m.tree.body if isinstance(c, ast.ClassDef) and c.name == name]

    def attribute_classes(self, m: Module, owner: ast.AST | None) -> dict[str, list[tuple[Module, ast.ClassDef]]]:
        """``self.<attr>`` of class ``owner`` -> the classes of the objects its methods
        store there: ``self.x = Class(...)``, or ``self.x = param`` of a parameter
        annotated ``Class`` (tuple assignments paired)."""
        out: dict[str, list[tuple[Module, ast.ClassDef]]] = {}
        for fn in getattr(owner, "body", []):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            annotated = {a.arg: _class_name(a.annotation) for a in [*fn.args.args, *fn.args.kwonlyargs]}
            for node in ast.walk(fn):
                if not isinstance(node, ast.Assign):
                    continue
                for target in node.targets:
                    pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                             and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                    for t, v in pairs:
                        if not (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                and t.value.id == "self"):
                            continue
                        name = (v.func.id if isinstance(v, ast.Call) and isinstance(v.func, ast.Name)
                                else annotated.get(v.id) if isinstance(v, ast.Name) else None)
                        if name:
                            out.setdefault(t.attr, []).extend(self.find_class(m, name))
        return out

    def enters_device(self, m: Module, call: ast.Call) -> bool:
        """``<...>.cuda.Device(...)``, or a call of a function that returns one (a
        helper such as ``self._on_device()``, which may return a null context on the CPU)."""
        if _is_device_call(call):
            return True
        returned = [ret.value for _, fn in self.resolve(m, call.func, call) for ret in ast.walk(fn)
                    if isinstance(ret, ast.Return)]
        returned += [v for ret in returned if isinstance(ret, ast.IfExp) for v in (ret.body, ret.orelse)]
        return any(_is_device_call(v) for v in returned)

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
        seen: set[tuple[int, frozenset[str]]] = set()
        # (module, function, its parameters known to hold NumPy values at this call)
        todo = [(m, fn, frozenset()) for m, fn in self.entries()]
        while todo:
            m, fn, given = todo.pop()
            if (id(fn), given) in seen:
                continue
            seen.add((id(fn), given))
            host = _host_names(fn, given)
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call) or m.in_device(node, self.enters_device):
                    continue
                todo += [(cm, callee, _host_params(callee, node, host))
                         for cm, callee in self.resolve(m, node.func, node)]
                func = node.func
                if not isinstance(func, ast.Attribute):
                    continue
                root = func.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                on_module = isinstance(root, ast.Name) and root.id in ARRAY_MODULES and root.id not in host
                if (on_module and func.attr not in NO_DEVICE_WORK) or (
                        not on_module and func.attr in COPY_METHODS and not _is_host(func.value, host)):
                    found.setdefault(m.rel, []).append(f"{node.lineno} {_name(fn)}: {ast.unparse(node)[:80]}")
        return found


def test_batch_on_device_is_a_device_block_for_the_lints():
    assert DEVICE_CONTEXTS == {"on_device"}
    block = ast.parse("with batch.on_device() as cp:\n    cp.empty(3)\n").body[0]
    assert _is_device_call(block.items[0].context_expr)
    assert _gpu_regions(ast.parse("def f(batch):\n" + textwrap.indent(ast.unparse(block), "    "))) != []


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

        def stacked(rows, xp):
            return xp.stack(rows)

        def host_parts(n):
            values, counts = np.unique(np.arange(n), return_counts=True)
            return (counts > 1).astype(np.int8), values.copy()

        @contextlib.contextmanager
        def unrelated():
            yield

        def host_only(n):
            rows = np.arange(n)
            return rows.copy(), np.zeros(3).astype(np.int8)
    """, "gpuio.work": """
        import functools
        import threading

        from gpuio.helpers import copy_rows, host_only
        from gpuio import helpers

        class Pipeline:
            def __call__(self, rows, xp):
                return xp.concatenate(rows)

            def run(self, rows, xp):
                return xp.asarray(rows)

            def read(self, xp):
                return xp.empty(3)

        class Stages:
            def __init__(self, pipeline: Pipeline):
                self.pipeline, self.other = pipeline, Pipeline()

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
                with self._on_device():
                    inside = xp.zeros(3)
                with helpers.unrelated():
                    outside = xp.ones(3)
                return out, xp.float32, host_only(3), helpers.stacked(rows, np), helpers.stacked(rows, xp=xp)

            def _on_device(self):
                return contextlib.nullcontext() if self.cpu else cp.cuda.Device(self.index)

            def _one(self, k, data, xp):
                return helpers.copy_rows(data), self.pipeline(data, xp), self.other.run(data, xp)

            def _read(self, data, xp, reader: Pipeline | None = None):
                return data.astype("f4"), reader.read(xp), helpers.host_parts(4)

            def _gpu_op(self, cp):
                return cp.zeros(3)
    """})
    found = project.worker_cupy_outside_device()
    lines = sorted(entry.split(" ", 1)[1] for entries in found.values() for entry in entries)
    assert lines == ["<lambda>: cp.empty(i)", "__call__: xp.concatenate(rows)", "_loop: xp.ones(3)",
                     "_loop: xp.stack(rows)", "_read: data.astype('f4')", "copy_rows: data.copy()",
                     "read: xp.empty(3)", "run: xp.asarray(rows)", "stacked: xp.stack(rows)"], found


# ---------------------------------------------------------------- host syncs in GPU code
#
# Each GPU stage runs on a stream of its own so that stages overlap; a host read of a
# device value waits for everything queued on the stream first, and stops that overlap.
# The lint below finds such reads in the ops' GPU code:
#
# - **GPU code** is the body of a ``with <...>.cuda.Device(...)`` block (or of ``with
#   f(...)`` where ``f`` is a generator of the same module that yields inside one), and
#   every function that takes the array module (a ``cp`` or ``xp`` parameter): on a GPU
#   batch ``xp`` is CuPy.
# - **Flagged** there: ``float(v)``, ``int(v)``, ``bool(v)``, ``v.item()``, ``v.tolist()``
#   and ``v.get()`` (no argument: not a dict's) of a value ``v`` not provably on the host;
#   every ``asnumpy`` and ``synchronize()``; and the CuPy calls that read device values
#   back to size their result or check their input (``SYNCING_CALLS``).
# - **On the host** (not flagged): constants, NumPy calls and what is computed from them,
#   an array's metadata (``.shape``, ``.dtype``, ``.ndim``, ``.size`` ...), ``batch.index``
#   and an op's own settings (``self.<name>``), ``len()``, and names only ever assigned
#   such values (loop variables over them included).
#
# Not seen: syncs inside other CuPy calls than those listed, boolean-mask indexing, and
# calls through objects; a GPU run of the ops' tests inside ``cupyx.allow_synchronize
# (False)`` (tests/gpu_sync.py) catches CuPy's own reads back at run time.

SYNC_BUILTINS = {"float", "int", "bool"}
SYNC_METHODS = {"item", "tolist", "get"}
SYNCING_CALLS = {"asnumpy", "bincount", "nonzero", "flatnonzero", "argwhere", "unique", "histogram", "extract",
                 "compress"}
HOST_ATTRIBUTES = {"shape", "ndim", "dtype", "size", "nbytes", "strides", "itemsize", "index", "seeds", "device",
                   "is_cuda"}
HOST_CALLS = {"len", "range", "min", "max", "abs", "round", "sum", "sorted", "zip", "enumerate", "list", "tuple",
              "isinstance", "getattr", "hasattr", "str", "repr", "divmod", "np", "numpy", "math"}
# ... of those, the ones whose result is on the host whatever they are given (the others
# pass their arguments' values on)
HOST_RESULTS = {"len", "range", "isinstance", "hasattr", "str", "repr", "np", "numpy", "math"}

# The syncs that are meant, with the reason: (file, function) -> why.
INTENDED_SYNCS = {
    ("ops/augment.py", "host_copies"): "the one wait of a batch whose values the host needs (histograms, the "
                                       "JPEG codec): copies to pinned memory, then one synchronize",
    ("ops/mix.py", "_labels"): "class indices a caller put on the GPU are read back once to be checked",
    ("ops/ragged.py", "segment_span"): "nonsilent_region's begin and length are host arrays, as DALI's; "
                                       "three reads back where one would do (to be merged)",
    ("ops/video.py", "keep"): "picture.getPTS() is a decoded frame's timestamp, a host int (no device value)",
}


def _gpu_regions(tree: ast.Module) -> list[ast.AST]:
    """The GPU code of a module (see above): ``with`` blocks and functions."""
    def enters(item: ast.withitem, helpers: set[str]) -> bool:
        call = item.context_expr
        return isinstance(call, ast.Call) and (_is_device_call(call) or ast.unparse(call.func).split(".")[-1] in helpers)

    generators = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                  and any(isinstance(n, ast.Yield) for n in ast.walk(f))]
    helpers = {f.name for f in generators if any(isinstance(w, ast.With) and any(enters(i, set()) for i in w.items)
                                                 for w in ast.walk(f))}
    out: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(enters(item, helpers) for item in node.items):
            out.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and {
                a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]} & {"cp", "xp"}:
            out.append(node)
    return out


def _loop_pairs(target: ast.AST, iterable: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(target, a value it takes) of a loop: ``zip`` and ``enumerate`` pair their parts."""
    if isinstance(target, ast.Tuple) and isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name):
        parts = {"zip": iterable.args, "enumerate": [ast.Constant(0), *iterable.args[:1]]}.get(iterable.func.id)
        if parts is not None and len(parts) == len(target.elts):
            return [pair for t, it in zip(target.elts, parts) for pair in _loop_pairs(t, it)]
    return [(target, ast.Subscript(iterable, ast.Constant(0)))]  # an element of the iterable


class _HostValues:
    """Which expressions of one function provably hold host values; ``host_functions``:
    the module's functions annotated to return NumPy values (or tuples of them)."""

    def __init__(self, fn: ast.AST | None, host_functions: set[str] = frozenset()) -> None:
        self.host_functions = host_functions
        self.values: dict[str, list[ast.AST | None]] = {}
        self.host: set[str] = set()
        if fn is None:
            return
        for arg in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
            typed = arg.annotation is not None and ast.unparse(arg.annotation).split(".")[0].split("[")[0] in (
                *HOST_MODULES, "int", "float", "bool", "str", "tuple", "Sequence")
            self.values.setdefault(arg.arg, []).append(ast.Constant(0) if typed else None)
        for node in ast.walk(fn):
            pairs: list[tuple[ast.AST, ast.AST | None]] = []
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                pairs = [(t, node.value) for t in targets]
            elif isinstance(node, ast.AugAssign):
                pairs = [(node.target, ast.BinOp(node.target, node.op, node.value))]
            elif isinstance(node, (ast.For, ast.comprehension)):
                pairs = _loop_pairs(node.target, node.iter)
            for target, value in pairs:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        self.values.setdefault(name.id, []).append(value)
        self.host = set(self.values)
        while True:
            dropped = {n for n in self.host if not all(v is not None and self.on_host(v) for v in self.values[n])}
            if not dropped:
                break
            self.host -= dropped

    def on_host(self, expr: ast.AST) -> bool:
        if isinstance(expr, (ast.Constant, ast.JoinedStr)):
            return True
        if isinstance(expr, ast.Name):
            return expr.id in self.host or expr.id in HOST_MODULES
        if isinstance(expr, ast.Attribute):
            return (expr.attr in HOST_ATTRIBUTES or (isinstance(expr.value, ast.Name) and expr.value.id == "self")
                    or self.on_host(expr.value))
        if isinstance(expr, ast.Subscript):
            return self.on_host(expr.value) and self.on_host(expr.slice)
        if isinstance(expr, ast.Slice):
            return all(p is None or self.on_host(p) for p in (expr.lower, expr.upper, expr.step))
        if isinstance(expr, ast.Call):
            func = expr.func
            root = func
            while isinstance(root, ast.Attribute):
                root = root.value
            if ast.unparse(func).split(".")[-1] in self.host_functions:
                return True
            if isinstance(root, ast.Name) and root.id in HOST_CALLS | SYNC_BUILTINS:
                return root.id in HOST_RESULTS or all(self.on_host(a) for a in expr.args)
            return isinstance(func, ast.Attribute) and self.on_host(func.value) and all(
                self.on_host(a) for a in expr.args)
        parts = [c for c in ast.iter_child_nodes(expr) if isinstance(c, ast.expr)]
        if isinstance(expr, (ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.IfExp, ast.Tuple, ast.List)):
            return all(self.on_host(p) for p in parts)
        return False


def _is_numpy_test(test: ast.AST, negated: bool) -> bool:
    """``xp is np`` (``negated``: ``xp is not np``)."""
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot if negated
                                                                                   else ast.Is)
            and {ast.unparse(test.left), ast.unparse(test.comparators[0])} & ARRAY_MODULES != set()
            and {ast.unparse(test.left), ast.unparse(test.comparators[0])} & HOST_MODULES != set())


def _numpy_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside ``if xp is np:``, the ``else`` of ``if xp is not np:``, or after an ``if xp
    is not np: ... return`` in the same block: code that runs only on the host."""
    child, up = node, parents.get(node)
    while up is not None:
        if isinstance(up, ast.If) and ((_is_numpy_test(up.test, False) and child in up.body)
                                       or (_is_numpy_test(up.test, True) and child in up.orelse)):
            return True
        for block in (getattr(up, "body", None), getattr(up, "orelse", None)):
            if isinstance(block, list) and child in block:
                earlier = block[:block.index(child)]
                if any(isinstance(s, ast.If) and _is_numpy_test(s.test, True) and isinstance(s.body[-1], ast.Return)
                       for s in earlier):
                    return True
        if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return False
        child, up = up, parents.get(up)
    return False


def host_syncs(rel: str, source: str) -> list[str]:
    """``["line function: call", ...]``: the host reads of device values in the GPU code
    of one module (see above), less ``INTENDED_SYNCS``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    host_functions = {f.name for f in functions if f.returns is not None and "Any" not in ast.unparse(f.returns)
                      and ast.unparse(f.returns).split("[")[0] in ("np.ndarray", "tuple", "dict", "list")
                      and "np." in ast.unparse(f.returns)}
    # helpers that read device values back (their callers wait too), unless meant
    syncing = {f.name for f in functions if (rel, f.name) not in INTENDED_SYNCS and any(
        isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] in ("asnumpy", "get") and not n.args[1:]
        and not (ast.unparse(n.func).endswith("get") and n.args) for n in ast.walk(f))}

    def function_of(node: ast.AST) -> ast.AST | None:
        node = parents.get(node)
        while node is not None and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node = parents.get(node)
        return node

    found: dict[int, str] = {}
    facts: dict[int, _HostValues] = {}
    for region in _gpu_regions(tree):
        for call in ast.walk(region):
            if not isinstance(call, ast.Call) or id(call) in found or _numpy_only(call, parents):
                continue
            fn = function_of(call)
            name = getattr(fn, "name", "<module>")
            if (rel, name) in INTENDED_SYNCS:
                continue
            host = facts.setdefault(id(fn), _HostValues(fn, host_functions))
            func = call.func
            what = None
            if isinstance(func, ast.Name) and func.id in SYNC_BUILTINS and call.args and not host.on_host(call.args[0]):
                what = "a device value read on the host"
            elif isinstance(func, ast.Name) and func.id in syncing:
                what = "a helper that reads device values back"
            elif isinstance(func, ast.Attribute):
                if func.attr in SYNC_METHODS and not (func.attr == "get" and call.args) and not host.on_host(func.value):
                    what = "a device value read on the host"
                elif func.attr == "synchronize":
                    what = "a wait for the GPU"
                elif func.attr in SYNCING_CALLS and isinstance(func.value, ast.Name) and func.value.id in ARRAY_MODULES:
                    what = "a CuPy call that reads device values back"
            if what:
                found[id(call)] = f"{call.lineno} {name}: {ast.unparse(call)[:70]} ({what})"
    return sorted(found.values(), key=lambda line: int(line.split()[0]))


def test_gpu_code_of_the_ops_reads_no_device_value_on_the_host():
    found = {}
    for path in sorted((ROOT / "ops").glob("*.py")):
        rel = str(path.relative_to(ROOT))
        lines = host_syncs(rel, path.read_text())
        if lines:
            found[rel] = lines
    assert not found, ("host reads of device values in the ops' GPU code (each waits for the stream; "
                       f"list a meant one in INTENDED_SYNCS): {found}")
    for rel, name in INTENDED_SYNCS:  # each still exists, so that the list only holds real cases
        source = (ROOT / rel).read_text()
        assert f"def {name}(" in source, f"{rel}: no function {name} any more: take it off INTENDED_SYNCS"


def test_the_sync_lint_sees_each_kind_of_host_read():
    source = textwrap.dedent('''
        import contextlib
        import numpy as np

        def sizes(n: int) -> np.ndarray:
            return np.arange(n)

        def to_host(a):
            return a.get()

        @contextlib.contextmanager
        def on_device(batch):
            with cp.cuda.Device(batch.device.index):
                yield

        def op(batch, images, factors: np.ndarray):
            table = sizes(len(images))
            with cp.cuda.Device(batch.device.index):
                for img, f in zip(images, factors.tolist()):
                    a = float(img.mean()), float(f), int(img.shape[2]), int(table.sum()), int(batch.index[0])
                    b = cp.asnumpy(img), img.get(), img.max().item(), bool(img.any()), to_host(img)
                    c = {"k": 1}.get("k"), cp.flatnonzero(img), cp.cuda.get_current_stream().synchronize()
            with on_device(batch):
                d = int(images[0].sum())
            return int(images[0].sum())  # a CPU batch's

        def mixed(xp, x, lengths: np.ndarray):
            if xp is np:
                return int(x.sum())
            if xp is not np:
                return xp.repeat(x, lengths.tolist()), x.tolist()
            return x.tolist()
    ''')
    lines = [line.split(" ", 1)[1] for line in host_syncs("ops/example.py", source)]
    assert lines == [
        "op: float(img.mean()) (a device value read on the host)",
        "op: cp.asnumpy(img) (a CuPy call that reads device values back)",
        "op: img.get() (a device value read on the host)",
        "op: img.max().item() (a device value read on the host)",
        "op: bool(img.any()) (a device value read on the host)",
        "op: to_host(img) (a helper that reads device values back)",
        "op: cp.flatnonzero(img) (a CuPy call that reads device values back)",
        "op: cp.cuda.get_current_stream().synchronize() (a wait for the GPU)",
        "op: int(images[0].sum()) (a device value read on the host)",
        "mixed: x.tolist() (a device value read on the host)"], lines


def test_every_op_runs_without_syncs_in_the_gpu_tests():
    """tests/gpu_sync.py wraps every op class gpuio.ops exports (and the ones they are made of)."""
    from gpu_sync import SYNCS_MEANT, op_classes

    from gpuio import ops
    from gpuio.batch import Op

    exported = {v for v in vars(ops).values() if isinstance(v, type) and issubclass(v, Op) and v is not Op}
    found = set(op_classes())
    assert len(exported) > 30 and exported <= found, sorted(c.__name__ for c in exported - found)
    assert set(SYNCS_MEANT) <= {c.__name__ for c in found}


def _upload_streams(path: Path) -> dict[str, list[str]]:
    """Per ``<array>.set(..., stream=s)`` (a host-to-device copy) in ``path``: how the
    function around it makes ``s`` (the source of each assignment to it)."""
    tree = ast.parse(path.read_text())
    out = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        made: dict[str, list[str]] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        made.setdefault(target.id, []).append(ast.unparse(node.value))
        for call in ast.walk(fn):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "set":
                stream = {k.arg: k.value for k in call.keywords}.get("stream")
                if stream is not None:
                    out[f"{path.name}:{call.lineno} {fn.name}"] = made.get(ast.unparse(stream), [ast.unparse(stream)])
    return out


def test_storage_uploads_run_on_a_stream_of_their_own():
    """A read thread's current stream is the legacy default stream, which waits for every
    blocking stream (the executor's stage streams): an upload there, and the wait after
    it, would stall behind the batches being computed. Uploads in gpuio/storage run on a
    non-blocking stream they make."""
    found = {}
    for path in sorted((ROOT / "gpuio" / "storage").glob("*.py")):
        found.update(_upload_streams(path))
    assert found, "no upload found in gpuio/storage"
    for where, sources in found.items():
        assert any("Stream(non_blocking=True)" in s for s in sources) and not any(
            "get_current_stream" in s for s in sources), f"{where}: the upload's stream comes from {sources}"
