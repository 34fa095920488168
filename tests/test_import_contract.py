"""The import contract, read from the source with ast: filters/ never imports stream/, its algorithm modules do no I/O,
no package has an import cycle, and bench/ never imports tests/."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("filters", "stream", "bench", "tests")
# The modules of filters/ that talk to the outside world: the Redis backend (its slot, spread and compact layouts).
IO_MODULES = {"filters.index.redis", "filters.index.redis_spread", "filters.index.redis_compact"}
IO_IMPORTS = ("socket", "redis", "asyncio", "aiokafka", "aiohttp", "urllib.request", "http", "subprocess", "faust")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, ast.Module]:
    return {_module(p): ast.parse(p.read_text(encoding="utf-8"), str(p))
            for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


SOURCES = _sources()


def _imports(module: str, tree: ast.Module) -> set[str]:
    """Every module `module` imports, at the top or inside a function (a lazy import still ties the two)."""
    out: set[str] = set()
    package = module.rsplit(".", 1)[0] if "." in module else module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)  # `from filters import _native`
    return out


def _local(names: set[str]) -> set[str]:
    """The modules of this repository among `names` (submodule names beyond a module's end dropped)."""
    found = set()
    for name in names:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in SOURCES:
                found.add(candidate)
                break
    return found


GRAPH = {module: _local(_imports(module, tree)) - {module} for module, tree in SOURCES.items()}


def test_filters_never_imports_stream() -> None:
    bad = {m: sorted(i for i in _imports(m, t) if i.split(".")[0] == "stream")
           for m, t in SOURCES.items() if m.startswith("filters")}
    assert not {m: i for m, i in bad.items() if i}


def test_the_algorithm_modules_do_no_io() -> None:
    bad: dict[str, list[str]] = {}
    for module, tree in SOURCES.items():
        if not module.startswith("filters") or module in IO_MODULES:
            continue
        found = [i for i in _imports(module, tree) if any(i == n or i.startswith(n + ".") for n in IO_IMPORTS)]
        found += [f"open() at line {n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "open"]
        if found:
            bad[module] = found
    assert not bad


def test_bench_never_imports_tests() -> None:
    bad = {m: sorted(i for i in GRAPH[m] if i.split(".")[0] == "tests") for m in GRAPH if m.startswith("bench")}
    assert not {m: i for m, i in bad.items() if i}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize(("graph", "cycles"), [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], cycles: list[list[str]]) -> None:
    assert _cycles(graph) == cycles


def test_the_engine_never_asks_which_backend_it_has() -> None:
    """The index is the engine's one door (`CandidateIndex.decide`): no isinstance/hasattr on it, no reach into
    a backend's table, no backend class named in filters/engine.py (an index given as a URL string is opened)."""
    tree = SOURCES["filters.engine"]
    asked = [f"line {n.lineno}" for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "isinstance")
             and "index" in ast.unparse(n.args[0]) and ast.unparse(n.args[1]) != "str"]  # a URL is opened
    asked += [f"line {n.lineno}: .{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "table"]
    asked += [f"line {n.lineno}: {n.id}" for n in ast.walk(tree)
              if isinstance(n, ast.Name) and n.id in ("MemoryIndex", "RedisIndex", "PyTable")]
    assert not asked


def test_the_index_protocol_imports_none_of_its_backends() -> None:
    """`filters.index` is the protocol and the shared types; its backends import it, never the reverse."""
    assert not {m for m in GRAPH["filters.index"] if m.startswith("filters.index.")}


# Each part of the compiled core's source sits beside the Python reference it is tested against.
COMPILED_PARTS = {
    "filters/_shingles.pxi": "filters/shingles.py",
    "filters/_edits.pxi": "filters/edits.py",
    "filters/_sketch.pxi": "filters/sketch.py",
    "filters/index/_table.pxi": "filters/index/memory.py",
    "filters/index/_redis_codec.pxi": "filters/index/redis_codec.py",
    "filters/index/_compact_codec.pxi": "filters/index/compact_codec.py",
    "filters/index/_group_codec.pxi": "filters/index/group_codec.py",
    "filters/_records.pxi": "filters/records.py",
    "filters/_normalize.pxi": "filters/normalize.py",
}


def test_each_compiled_part_sits_beside_its_reference_and_is_built() -> None:
    """`_native.pyx` includes exactly these parts, each in its reference's directory, and pyproject lists
    them as the extension's `depends` (so that a change rebuilds it and the sdist carries them)."""
    pyx = (ROOT / "filters" / "_native.pyx").read_text(encoding="utf-8")
    included = {f"filters/{name}" for name in re.findall(r'^include "([^"]+)"$', pyx, re.M)}
    assert included == set(COMPILED_PARTS)
    for part, reference in COMPILED_PARTS.items():
        assert (ROOT / part).is_file() and (ROOT / reference).is_file()
        assert Path(part).parent == Path(reference).parent
    [native] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["ext-modules"]
    assert set(native["depends"]) == set(COMPILED_PARTS)
