"""The code's shape: no import cycles between modules or between proxy's stage packages,
and a routing core that knows nothing of HTTP. Read from the sources (every import,
including those inside functions and under TYPE_CHECKING), not from what happens to be
loaded."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "backends", "loadtest")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> Iterator[str]:
    """Every module of ours that ``name`` imports (``from pkg import mod`` included)."""
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                yield t


GRAPH = {m: set(_imports(m)) for m in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path, or None (iterative DFS, colours)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        state[start] = 1
        path = [start]
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return None


def _stage(module: str) -> str:
    """proxy.<package> for a module of a stage package (proxy.<module> for the app, the
    command line and the shared errors beside them), else its top-level package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "proxy" else parts[0]


@pytest.mark.parametrize(("graph", "cycle"), [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": {"d"}, "d": {"b"}}, ["b", "c", "d", "b"]),
])
def test_cycle_finder(graph: dict[str, set[str]], cycle: list[str] | None) -> None:
    assert _cycle(graph) == cycle


def test_no_module_import_cycles() -> None:
    assert _cycle(GRAPH) is None


def test_no_cycles_between_packages() -> None:
    """proxy's stage packages (and backends, loadtest) depend on each other one way. A
    package's ``__main__`` is a command on top of everything: it may use any package."""
    pkgs: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        if m.endswith(".__main__"):
            continue
        pkgs.setdefault(_stage(m), set()).update(_stage(d) for d in deps if _stage(d) != _stage(m))
    assert _cycle(pkgs) is None


def test_routing_core_is_free_of_http() -> None:
    core = [m for m in MODULES if m.startswith("proxy.routing")]
    assert len(core) > 5
    for m in core:
        ours = {d for d in GRAPH[m] if not d.startswith("proxy.routing")}
        assert not ours, f"{m} imports {ours}"
        tree = ast.parse(MODULES[m].read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                 for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & {"aiohttp", "asyncio", "httptools", "structlog"}, m


def test_architecture_doc_names_every_package() -> None:
    """docs/architecture.md lists each package of proxy/ and names nothing that is gone."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    packages = {f"proxy/{p.parent.relative_to(ROOT / 'proxy')}/"
                for p in (ROOT / "proxy").rglob("__init__.py") if p.parent != ROOT / "proxy"}
    named = set(re.findall(r"`(proxy/[a-z_/]+/)`", doc))
    assert packages - named == set()
    assert named - packages == set()
    for path in re.findall(r"`(proxy/[a-z_]+\.py)`", doc):
        assert (ROOT / path).exists(), path
    for pkg in packages:
        assert ast.get_docstring(ast.parse((ROOT / pkg / "__init__.py").read_text())), pkg


# a backend's kind, as backends.config names it and as config.yaml spells it
_KIND_NAMES = frozenset({"LLAMA", "OPENAI"})
_KIND_VALUES = frozenset({"llama", "openai"})
DIALECT_MODULE = "backends.dialect"


def _kind_name(node: ast.AST) -> bool:
    """backends.config's name of a kind (LLAMA, OPENAI) anywhere in ``node``."""
    return any(isinstance(n, ast.Name) and n.id in _KIND_NAMES for n in ast.walk(node))


def _kind_value(node: ast.AST) -> bool:
    """A kind as config.yaml spells it ("llama", "openai") anywhere in ``node``."""
    return any(isinstance(n, ast.Constant) and n.value in _KIND_VALUES
               for n in ast.walk(node))


def _is_kind(node: ast.AST) -> bool:
    """``kind``, ``x.kind``, ``backend_kind``: what holds a backend's kind."""
    name = node.id if isinstance(node, ast.Name) else \
        node.attr if isinstance(node, ast.Attribute) else ""
    return name == "kind" or name.endswith("_kind")


def _kind_comparisons(source: str) -> list[int]:
    """Lines of ``source`` that compare with a backend's kind: with LLAMA or OPENAI, or
    a kind with its spelling (``kind != "openai"``, ``match kind: case "llama":``). Other
    comparisons with those words (a load test's client API) are not the backend's."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = (node.left, *node.comparators)
            if any(_kind_name(x) for x in operands) or (
                    any(_is_kind(x) for x in operands) and any(_kind_value(x) for x in operands)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Match) and (_kind_name(node.subject) or _is_kind(node.subject)):
            lines += [c.pattern.lineno for c in node.cases
                      if _kind_name(c.pattern) or _kind_value(c.pattern)]
    return lines


@pytest.mark.parametrize(("source", "found"), [
    ("if info.kind == LLAMA: pass", [1]),
    ("x = 1\nok = kind != OPENAI", [2]),
    ("ok = b.kind in ('llama', 'x')", [1]),
    ("match kind:\n    case 'openai': pass", [2]),
    ("ok = cfg.backend_kind is 'openai'", [1]),
    ("ok = kind not in BACKEND_KINDS", []),
    ("b = Info(kind=LLAMA)\nok = e.kind == Kind.START", []),
    ("ok = req.api == 'llama'", []),
])
def test_kind_comparison_finder(source: str, found: list[int]) -> None:
    assert _kind_comparisons(source) == found


def test_backend_kinds_are_compared_only_by_their_dialect() -> None:
    """What a kind of backend accepts is read from its `Dialect` (backends/dialect.py),
    the one module that tells kinds apart: elsewhere, `info.dialect.pins_slots` and the
    like, never `kind == LLAMA`."""
    assert DIALECT_MODULE in MODULES
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line}" for m in sorted(MODULES)
             if m != DIALECT_MODULE for line in _kind_comparisons(MODULES[m].read_text())]
    assert not wrong


def _defined(name: str) -> set[str]:
    """Names a module defines itself (not those it imports)."""
    out: set[str] = set()
    for node in ast.parse(MODULES[name].read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target,
                                                                            ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.If | ast.Try):  # conditional definitions
            out |= {n.name for n in ast.walk(node)
                    if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    return out


def test_names_are_imported_from_their_owner() -> None:
    """No re-export chains: `from a.b import X` only where a.b defines X (or X is a
    module of package a.b)."""
    wrong = []
    sources = [*MODULES.values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py")]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in MODULES:
                continue
            owned = _defined(node.module)
            wrong += [f"{path.relative_to(ROOT)}: {a.name} from {node.module}"
                      for a in node.names
                      if a.name not in owned and f"{node.module}.{a.name}" not in MODULES]
    assert not wrong


def _fields_class(cls: ast.ClassDef) -> bool:
    """A dataclass, NamedTuple or TypedDict: its bare annotations are fields, which the
    generated __init__ assigns."""
    marks = [*cls.decorator_list, *cls.bases]
    names = {ast.unparse(m.func if isinstance(m, ast.Call) else m).rpartition(".")[2]
             for m in marks}
    return bool(names & {"dataclass", "NamedTuple", "TypedDict"})


def _own_nodes(cls: ast.ClassDef) -> Iterator[ast.AST]:
    """The nodes of ``cls``'s body, not those of the classes nested in it."""
    todo: list[ast.AST] = [n for n in cls.body if not isinstance(n, ast.ClassDef)]
    while todo:
        node = todo.pop()
        yield node
        todo += [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.ClassDef)]


def _private_stubs(source: str) -> list[str]:
    """Class.name for each private name a class declares as a bare class-level annotation
    (``_x: T``, no value) and never assigns itself (``self._x = ...``): a stub of a member
    that some other class owns (a mixin's view of its siblings' state, its type erased)."""
    out = []
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef) or _fields_class(cls):
            continue
        declared = [n.target.id for n in cls.body
                    if isinstance(n, ast.AnnAssign) and n.value is None
                    and isinstance(n.target, ast.Name) and n.target.id.startswith("_")
                    and not n.target.id.startswith("__")]
        bare = {id(n.target) for n in _own_nodes(cls)
                if isinstance(n, ast.AnnAssign) and n.value is None}
        assigned = {n.attr for n in _own_nodes(cls)
                    if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
                    and id(n) not in bare}
        out += [f"{cls.name}.{name}" for name in declared if name not in assigned]
    return out


@pytest.mark.parametrize(("source", "stubs"), [
    ("class A:\n    _x: int\n    def f(self):\n        return self._x\n", ["A._x"]),
    ("class A:\n    _x: int\n    def __init__(self):\n        self._x = 1\n", []),
    ("class A:\n    _x: int\n    def f(self):\n        self._x += 1\n", []),
    ("class A:\n    _x: int\n    _y: int\n    def f(self):\n        self._x, self._y = 1, 2\n",
     []),
    ("class A:\n    _x: int\n    def f(self):\n        self._x: int\n", ["A._x"]),
    ("class A:\n    _x: int = 0\n", []),  # a class attribute with its value
    ("class A:\n    x: int\n", []),  # (public: a protocol's, say)
    ("@dataclass\nclass A:\n    _x: int\n", []),  # a field
    ("@dataclasses.dataclass(frozen=True)\nclass A:\n    _x: int\n", []),
    ("class A(NamedTuple):\n    _x: int\n", []),
    # a nested class's assignment is its own
    ("class A:\n    _x: int\n    class B:\n        def f(self):\n            self._x = 1\n",
     ["A._x"]),
])
def test_private_stub_finder(source: str, stubs: list[str]) -> None:
    assert _private_stubs(source) == stubs


def test_no_private_re_declarations() -> None:
    """No class of proxy/ or backends/ re-declares another's private members as type
    stubs: each component owns its state, and the others reach it through its public
    interface."""
    stubs = [f"{path.relative_to(ROOT)}: {stub}" for path in sorted(MODULES.values())
             if path.is_relative_to(ROOT / "proxy") or path.is_relative_to(ROOT / "backends")
             for stub in _private_stubs(path.read_text())]
    assert not stubs


# Declarations that are long by nature: one line per metric, read as a table.
LONG_ALLOWED = frozenset({"proxy.observability.metrics.ProxyMetrics.__init__"})
MAX_LINES, MAX_PARAMS = 60, 7


def _functions(source: str, module: str) -> Iterator[tuple[str, int, int]]:
    """(qualified name, lines, parameters) of each function in ``source``; ``self`` and
    ``cls`` are not counted."""
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (
                    a.vararg, a.kwarg))]
                if params and params[0].arg in ("self", "cls"):
                    params = params[1:]
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                yield f"{prefix}.{child.name}", lines, len(params)
                yield from walk(child, f"{prefix}.{child.name}")
            else:
                yield from walk(child, prefix)
    yield from walk(ast.parse(source), module)


@pytest.mark.parametrize(("source", "found"), [
    ("def f(a, b):\n    return a\n", [("m.f", 2, 2)]),
    ("class A:\n    def f(self, a):\n        pass\n", [("m.A.f", 2, 1)]),
    ("class A:\n    @classmethod\n    def f(cls, *a, b, **k):\n        pass\n",
     [("m.A.f", 2, 3)]),
    ("def f():\n    def g(x):\n        pass\n", [("m.f", 3, 0), ("m.f.g", 2, 1)]),
    ("async def f(a, /, b, *, c):\n    pass\n", [("m.f", 2, 3)]),
])
def test_function_measure(source: str, found: list[tuple[str, int, int]]) -> None:
    assert list(_functions(source, "m")) == found


def test_proxy_functions_are_short_and_take_few_parameters() -> None:
    """proxy/: functions of at most 60 lines and 7 parameters (self aside); what takes
    more is a value of its own (a NamedTuple or dataclass), or steps with names."""
    over = [f"{name}: {lines} lines, {params} parameters"
            for module, path in sorted(MODULES.items()) if module.startswith("proxy.")
            for name, lines, params in _functions(path.read_text(), module)
            if (lines > MAX_LINES and name not in LONG_ALLOWED) or params > MAX_PARAMS]
    assert not over
