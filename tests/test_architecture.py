"""The shape of the code, as docs/architecture.md draws it: which part may import which, no
import cycle, no library file over 600 lines, no function over 80.

The import graph counts every import, at the top of a module or inside a function (a
function-level import hides an edge from a reader, not from this test). A new edge between parts
fails here until docs/architecture.md and ``MAY_USE`` say why it is right.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIRS = {"solar": "solar", "io_backends": "solar.io_backends", "cache": "solar.cache"}
PACKAGES = ("solar.io_backends", "solar.cache", "solar.codec", "solar.checkpoint", "solar.ingest", "solar.cli",
            "solar.testing", "solar.demo")

#: part -> the parts it may import (besides itself); solar.errors is everyone's
MAY_USE = {
    "solar.registry": set(),
    "solar.failfast": set(),
    "solar.fileio": set(),
    "solar.layout": set(),
    "solar.memory": set(),
    "solar.stats": set(),  # one loader's per-epoch records: reads the counters it is given
    "solar.order": set(),
    "solar.ownership": set(),
    "solar.permute": set(),
    "solar.exchange": set(),
    "solar.dist": {"solar.failfast"},
    "solar.collective": {"solar.failfast"},
    "solar.schedule": {"solar.order", "solar.ownership", "solar.permute"},
    # sharded planning (NOTE [ Sharded planning ]): each rank plans its share; the order once per node
    "solar.rankplan": set(),
    "solar.shardplan": {"solar.schedule", "solar.order", "solar.permute", "solar.exchange", "solar.rankplan"},
    "solar.firststeps": {"solar.dist"},  # an epoch's head first, its plan behind the head's passes
    "solar.nodeshare": {"solar.order"},
    "solar.prefetch": {"solar.dist"},
    "solar.capabilities": {"solar", "solar.dist"},
    "solar.cache": {"solar.registry"},
    "solar.options": {"solar.cache"},  # spill= names a registered cache tier, checked when the loader is built
    "solar.codec": {"solar.registry"},
    "solar.io_backends": {"solar.registry", "solar.capabilities", "solar.collective", "solar.dist", "solar.failfast"},
    # the data path, in the order a batch travels
    "solar.reads": {"solar.collective", "solar.layout"},
    "solar.slots": set(),  # a pass's batch tensors: reused memory, rows copied in when taken
    "solar.fetch": {"solar.cache", "solar.layout", "solar.slots"},
    "solar.dataset": {"solar.io_backends", "solar.codec", "solar.collective", "solar.layout", "solar.reads",
                      "solar.fetch"},
    "solar.subset": {"solar.dataset"},
    "solar.concat": {"solar.dataset", "solar.subset", "solar.fetch", "solar.collective"},
    "solar.views": {"solar.dataset", "solar.subset", "solar.concat"},
    "solar.decoded": {"solar.cache", "solar.fetch", "solar.codec"},  # decoded copies in the buffer's left-over bytes
    "solar.passes": {"solar.fetch", "solar.schedule", "solar.failfast", "solar.decoded"},
    "solar.iterators": {"solar.fetch", "solar.stats"},  # the loader's iterators around torch's
    "solar.sampler": {"solar.options", "solar.schedule", "solar.passes", "solar.prefetch", "solar.cache",
                      "solar.collective", "solar.dist", "solar.shardplan", "solar.nodeshare", "solar.exchange",
                      "solar.firststeps", "solar.decoded"},
    "solar.loader": {"solar.sampler", "solar.options", "solar.memory", "solar.schedule", "solar.order", "solar.subset",
                     "solar.views", "solar.dist", "solar.fetch", "solar.stats", "solar.iterators"},
    # consumers of the data path and of the tiers
    "solar.dali": {"solar.loader", "solar.dist"},
    "solar.checkpoint": {"solar.cache", "solar.fileio"},
    "solar.ingest": {"solar", "solar.io_backends", "solar.cache", "solar.codec", "solar.dist", "solar.fileio",
                     "solar.layout"},
    "solar.synthetic": {"solar.dist"},
    "solar.testing": {"solar.io_backends", "solar.codec", "solar.schedule", "solar.dist"},
    # the demo: an application of the whole product (torch's baseline loader from solar.testing); only the CLI
    # imports it
    "solar.demo": {"solar", "solar.capabilities", "solar.checkpoint", "solar.dist", "solar.ingest", "solar.io_backends",
                   "solar.synthetic", "solar.testing"},
    # nothing imports the CLI; it may use every part
    "solar.cli": None,
}


def _modules() -> dict[str, str]:
    out = {}
    for top, pkg in PACKAGE_DIRS.items():
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, top))[:-3].split(os.sep)
                    name = ".".join([pkg, *[p for p in rel if p != "__init__"]]).rstrip(".")
                    out[name] = os.path.join(d, f)
    return out


def _part(module: str) -> str:
    for pkg in PACKAGES:
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return module


def _imports(name: str, path: str, modules: dict[str, str]):
    tree = ast.parse(open(path).read())
    is_pkg = path.endswith("__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in found:
            if target in modules and target != name:
                yield target, node.lineno


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return modules, {name: list(_imports(name, path, modules)) for name, path in modules.items()}


def test_every_part_imports_only_what_docs_architecture_allows(graph):
    modules, edges = graph
    bad = []
    for name, targets in edges.items():
        mine = _part(name)
        allowed = MAY_USE.get(mine, set()) if mine != "solar" else None
        for target, line in targets:
            other = _part(target)
            if allowed is None or other in (mine, "solar.errors") or other in allowed:
                continue
            bad.append(f"{modules[name]}:{line}: {mine} imports {target} ({other} is not among its parts)")
    assert not bad, "\n".join(bad)
    assert "solar.cli" not in {_part(t) for n, ts in edges.items() if _part(n) != "solar.cli" for t, _ in ts}


def test_no_import_cycle_between_modules(graph):
    modules, edges = graph
    # a package's own ``from . import sub`` is not an edge back to the package
    succ = {n: {t for t, _ in ts if not n.startswith(t + ".")} for n, ts in edges.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(n: str, path: list[str]) -> bool:
        state[n] = 1
        for t in succ.get(n, ()):
            if state.get(t) == 1:
                cycle.extend(path[path.index(t):] + [n, t] if t in path else [n, t])
                return True
            if state.get(t) is None and visit(t, path + [n]):
                return True
        state[n] = 2
        return False

    for n in sorted(succ):
        if state.get(n) is None and visit(n, []):
            break
    assert not cycle, " -> ".join(cycle)


def test_library_files_and_functions_stay_small(graph):
    modules, _ = graph
    long_files, long_funcs = [], []
    for name, path in modules.items():
        src = open(path).read()
        if src.count("\n") > 600:
            long_files.append(f"{os.path.relpath(path, ROOT)}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_funcs.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name}: "
                                  f"{node.end_lineno - node.lineno + 1} lines")
    assert not long_files, long_files
    assert not long_funcs, long_funcs
