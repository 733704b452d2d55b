"""Packaging: the import graph of the spd_engine packages and the layout docs/design.md section 4
lists, both read from the source (fast, static; the plain install into a fresh virtual
environment is tests/test_install.py).

Import rules (docs/design.md 4), checked on the source with `ast`, nothing imported, over every
import, those inside functions included (`if TYPE_CHECKING:` blocks never run and do not count):
- layering: a module imports only its own layer and the layers before it in `kernels <
  engine.protocol < engine.comm < engine.model < engine.runtime < checkpoint_tools < train <
  costmodel < bench < server < tools` (tools may import everything, nothing imports tools; the
  protocol's pure rules import no other part of the engine);
- no import cycle among the modules;
- no two modules share a name, and packages are imported through their namespace only
  (`spd_engine.engine...`), never as top-level `engine`, `tools`, ..., which do not exist once
  installed.
"""
from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "spd_engine"
LAYERS = ("kernels", "engine.protocol", "engine.comm", "engine.model", "engine.runtime", "checkpoint_tools", "train",
          "costmodel", "bench", "server", "tools", "api")
PACKAGES = sorted({layer.split(".")[0] for layer in LAYERS})


# ---- the static import graph ----

def package_modules() -> dict[str, Path]:
    """spd_engine.<package>[.<sub>...][.<module>] -> source file, for every module of every package."""
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = (f.relative_to(ROOT).with_suffix("")).parts
            mods[".".join((NAMESPACE, *(parts[:-1] if f.stem == "__init__" else parts)))] = f
    return mods


def layer_of(module: str) -> str:
    """The layer a module of the namespace belongs to (the engine's own __init__: its lowest)."""
    rest = module.removeprefix(f"{NAMESPACE}.")
    if rest == "engine":
        return "engine.protocol"
    found = [layer for layer in LAYERS if rest == layer or rest.startswith(layer + ".")]
    assert found, f"{module} belongs to no layer: add its package to LAYERS"
    return max(found, key=len)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(module: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> Iterator[str]:
    """Dotted names an import statement may load: `from a.b import c` gives a.b and a.b.c."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:  # relative: resolve against the importing module's package
        parts = module.split(".")
        parts = parts[:len(parts) - node.level + int(is_package)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    yield base
    yield from (f"{base}.{alias.name}" for alias in node.names)


def imports_of(module: str, path: Path) -> Iterator[tuple[str, int, bool]]:
    """(imported name, line, at module level) for every import statement in the file."""
    def walk(nodes: list[ast.stmt], top: bool) -> Iterator[tuple[str, int, bool]]:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported_names(module, node, path.stem == "__init__"):
                    yield name, node.lineno, top
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(node.body, False)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, False)
                yield from walk(node.orelse, top)
            else:  # class bodies, if / try / with / loops at module level run at import time
                for field in ("body", "orelse", "finalbody"):
                    yield from walk(getattr(node, field, None) or [], top)
                for handler in getattr(node, "handlers", None) or []:
                    yield from walk(handler.body, top)
    yield from walk(ast.parse(path.read_text(), str(path)).body, True)


def import_edges(mods: dict[str, Path]) -> list[tuple[str, str, int, bool]]:
    """(importer, imported module, line, at module level), between modules of the package."""
    edges = []
    for mod, path in mods.items():
        for name, line, top in imports_of(mod, path):
            if name in mods and name != mod:
                edges.append((mod, name, line, top))
    return edges


def strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                comps.append(sorted(comp))
    return comps


def import_cycles(mods: dict[str, Path], edges: list[tuple[str, str, int, bool]]) -> list[list[str]]:
    """Cycles among the modules over every import, those inside functions included: a cycle hidden
    behind a late import is still two modules that need each other."""
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in edges:
        graph.setdefault(src, set()).add(dst)
    return [c for c in strongly_connected(sorted(mods), graph) if len(c) > 1]


def layering_violations(edges: list[tuple[str, str, int, bool]]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    bad = []
    for src, dst, line, _ in edges:
        a, b = layer_of(src), layer_of(dst)
        if rank[b] > rank[a]:
            bad.append(f"{src}:{line} imports {dst} ({a} may not import {b})")
    return bad


def test_strongly_connected_finds_cycles_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    comps = strongly_connected(["a", "b", "c", "d", "e"], graph)
    assert sorted(c for c in comps if len(c) > 1) == [["a", "b", "c"]]
    assert sorted(comps) == [["a", "b", "c"], ["d"], ["e"]]


def test_import_scanner_tells_module_level_from_function_level(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                   "import spd_engine.engine.protocol.tick\n"
                   "try:\n    from spd_engine.engine.protocol import schedule\nexcept ImportError:\n    pass\n"
                   "if TYPE_CHECKING:\n    from spd_engine.tools.common import x\n"
                   "def f():\n    from ..train import evaluate\n")
    found = {(name, top) for name, _, top in imports_of("spd_engine.bench.m", src)}
    assert ("spd_engine.engine.protocol.tick", True) in found
    assert ("spd_engine.engine.protocol.schedule", True) in found
    assert ("spd_engine.tools.common", False) in found
    assert ("spd_engine.train.evaluate", False) in found  # relative import resolved


def test_layering_rule_flags_upward_imports_only():
    edges = [("spd_engine.engine.runtime.driver", "spd_engine.tools.common", 3, False),
             ("spd_engine.tools.common", "spd_engine.engine.runtime.driver", 4, True),
             ("spd_engine.kernels.anchor_gather", "spd_engine.engine.model.pdm", 5, True),
             ("spd_engine.bench.speed", "spd_engine.train.evaluate", 6, True)]
    assert layering_violations(edges) == [
        "spd_engine.engine.runtime.driver:3 imports spd_engine.tools.common (engine.runtime may not import tools)",
        "spd_engine.kernels.anchor_gather:5 imports spd_engine.engine.model.pdm (kernels may not import engine.model)"]
    inside = [("spd_engine.engine.protocol.tick", "spd_engine.engine.comm.transport", 7, False),
              ("spd_engine.engine.comm.transport", "spd_engine.engine.protocol.messages", 8, True),
              ("spd_engine.server.app", "spd_engine.bench.stats", 9, True)]
    assert layering_violations(inside) == [
        "spd_engine.engine.protocol.tick:7 imports spd_engine.engine.comm.transport "
        "(engine.protocol may not import engine.comm)"]


def test_cycle_rule_counts_imports_inside_functions():
    mods = {"spd_engine.train.a": Path("a.py"), "spd_engine.train.b": Path("b.py")}
    edges = [("spd_engine.train.a", "spd_engine.train.b", 1, True), ("spd_engine.train.b", "spd_engine.train.a", 9, False)]
    assert import_cycles(mods, edges) == [["spd_engine.train.a", "spd_engine.train.b"]]


def test_no_import_cycle_among_module_level_imports():
    mods = package_modules()
    assert f"{NAMESPACE}.engine.protocol.tick" in mods and f"{NAMESPACE}.tools.cli" in mods
    assert f"{NAMESPACE}.bench.sync_time" in mods  # sub-packages are scanned
    cycles = import_cycles(mods, import_edges(mods))
    assert not cycles, f"import cycles: {cycles}"


def test_every_module_in_a_layer_and_no_two_modules_share_a_name():
    mods = package_modules()
    for mod in mods:
        layer_of(mod)
    stems: dict[str, list[str]] = {}
    for mod, path in mods.items():
        if path.stem != "__init__":
            stems.setdefault(path.stem, []).append(mod)
    assert not {s: m for s, m in stems.items() if len(m) > 1}


def test_no_package_imports_a_later_layer():
    mods = package_modules()
    edges = import_edges(mods)
    assert any(e[0].startswith(f"{NAMESPACE}.tools.") for e in edges)  # the scan sees imports at all
    assert not layering_violations(edges)


def test_package_folders_are_imported_through_the_namespace_only():
    bad = []
    for mod, path in package_modules().items():
        for name, line, _ in imports_of(mod, path):
            if name.split(".")[0] in PACKAGES:
                bad.append(f"{mod}:{line} imports {name} (write {NAMESPACE}.{name})")
    assert not bad, bad


# ---- docs/design.md section 4 lists the tree ----

def design_layout() -> dict[str, set[str]]:
    """Package folder -> the module names docs/design.md section 4 lists under it."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## 4. Layout"):text.index("## 5.")]
    block = section.split("```")[1]
    listed: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        words = re.split(r"\s{2,}", line.strip())[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if words.endswith("/"):
            folder = "/".join([*(s[1] for s in stack[-1:]), words.rstrip("/")])
            stack.append((indent, folder))
            listed.setdefault(folder, set())
        elif stack:
            listed[stack[-1][1]].update(w.strip() for w in words.split(","))
    return listed


def test_design_section_4_lists_every_module_and_no_other():
    listed = design_layout()
    actual = {str(f.parent.relative_to(ROOT)): set() for f in package_modules().values()}
    for path in package_modules().values():
        if path.stem != "__init__":
            actual[str(path.parent.relative_to(ROOT))].add(path.stem)
    for folder, mods in actual.items():
        assert listed.get(folder) == mods, (folder, "missing from the doc:", mods - listed.get(folder, set()),
                                            "not in the tree:", listed.get(folder, set()) - mods)
    assert {f for f in listed if f not in ("engine", "heads", "tests")} == set(actual) - {"engine"}
