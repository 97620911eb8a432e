"""The import direction of docs/architecture.md ("Layers"), enforced on the source.

Every ``import`` statement counts, at module level or inside a function: a lazy import is still a
dependency. Three rules: each layer names only the layers below it; the product (``canzona/``)
reaches its lab (``validation/``, ``tests/``) only through :func:`canzona.lab.suite`; and no
import cycle exists among the modules of ``canzona/`` and ``validation/``. A last check imports
the torch-free layers in a fresh interpreter and looks at what came along.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import canzona

PACKAGE = Path(canzona.__file__).parent
ROOT = PACKAGE.parent
SUITE = ROOT / "validation"
TESTS = ROOT / "tests"

#: the one module of the product that may reach the exactness suite (lazily, by name)
LAB_DOOR = "canzona.lab"

#: module prefix -> import prefixes it must never name
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # the planner is pure: shapes and ints in, a frozen plan out
    "canzona.plan": ("torch", "canzona.runtime", "canzona.distributed", "canzona.train", "canzona.sim",
                     "canzona.commands", "canzona.cli", "canzona.viz", "canzona.models", "canzona.optim."),
    "canzona.cost": ("torch", "canzona.runtime", "canzona.commands", "canzona.cli"),
    "canzona.config": ("torch", "canzona.runtime", "canzona.commands", "canzona.cli"),
    "canzona.phase_names": ("torch", "canzona."),
    # the simulator models a cluster from a plan; it never runs collectives
    "canzona.sim": ("torch.distributed", "canzona.runtime", "canzona.distributed", "canzona.train",
                    "canzona.commands", "canzona.cli"),
    # optimizer math never communicates
    "canzona.optim": ("torch.distributed", "canzona.runtime", "canzona.distributed", "canzona.plan",
                      "canzona.commands", "canzona.cli"),
    # the runtime executes a plan; it never re-plans from a name or reaches up to the front ends
    "canzona.runtime": ("canzona.commands", "canzona.cli", "canzona.train", "canzona.viz", "canzona.profiling",
                        "canzona.distributed", "canzona.layouts", "canzona.hf", "canzona.torchtitan"),
    # layouts sit below the one front end; the settings record below both
    "canzona.layouts": ("canzona.distributed", "canzona.commands", "canzona.cli", "canzona.train"),
    "canzona.settings": ("canzona.distributed", "canzona.layouts", "canzona.commands", "canzona.cli"),
    # the library loop and front end never import the command line
    "canzona.distributed": ("canzona.commands", "canzona.cli", "canzona.train"),
    "canzona.train": ("canzona.commands", "canzona.cli"),
    "canzona.models": ("canzona.commands", "canzona.cli", "canzona.runtime"),
    "canzona.viz": ("canzona.commands", "canzona.cli"),
    "canzona.profiling": ("canzona.commands", "canzona.cli"),
    # the exactness suite uses the library, never its command line or its door back to the suite
    "validation": ("canzona.commands", "canzona.cli", "canzona.lab", "canzona.pytest_plugin"),
}

def _modules(*packages: Path) -> list[tuple[str, Path]]:
    """(dotted name, path) of every module of ``packages`` (default: the product, ``canzona/``)."""
    out = []
    for package in packages or (PACKAGE,):
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out.append((name, path))
    return out


def _imports(name: str, path: Path) -> set[str]:
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)  # `from canzona import runtime`
    return found


def _rule(name: str) -> tuple[str, ...]:
    best = ""
    for prefix in FORBIDDEN:
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return FORBIDDEN.get(best, ())


def _hits(imported: str, forbidden: tuple[str, ...]) -> bool:
    return any(imported == f or imported.startswith(f if f.endswith(".") else f + ".") for f in forbidden)


@pytest.mark.parametrize("name,path", _modules(PACKAGE, SUITE), ids=[n for n, _ in _modules(PACKAGE, SUITE)])
def test_module_imports_point_one_way(name: str, path: Path) -> None:
    forbidden = _rule(name)
    bad = sorted(m for m in _imports(name, path) if _hits(m, forbidden))
    assert not bad, f"{name} imports {bad}: see docs/architecture.md, 'Layers'"


def test_rule_catches_a_back_edge() -> None:
    """The checker itself: a runtime module importing the CLI, or the planner importing torch, is found."""
    assert _hits("canzona.commands.train", _rule("canzona.runtime.dp"))
    assert _hits("torch.distributed", _rule("canzona.plan.build"))
    assert _hits("canzona.optim.muon", _rule("canzona.plan"))
    assert not _hits("canzona.optimizers", _rule("canzona.plan"))  # the registry of names is not optimizer math
    # checkpoints reach the front ends only through canzona.runtime.checkpoint.Checkpointable
    assert _hits("canzona.distributed.DistributedOptimizer", _rule("canzona.runtime.checkpoint"))
    assert _hits("canzona.layouts.fsdp2", _rule("canzona.runtime.dcp"))
    assert _hits("canzona.distributed", _rule("canzona.layouts.zero1"))
    assert not _hits("canzona.runtime.checkpoint", _rule("canzona.runtime.dcp"))


def test_checkpoint_modules_name_no_front_end() -> None:
    """The former back-edge, checked on the source: the checkpoint formats import no front end,
    not even for type annotations, and the front ends import the contract from the runtime."""
    paths = dict(_modules())
    for mod in ("canzona.runtime.checkpoint", "canzona.runtime.dcp"):
        front = sorted(m for m in _imports(mod, paths[mod]) if m.startswith(("canzona.distributed", "canzona.layouts")))
        assert front == [], f"{mod} imports {front}"
    for mod in ("canzona.distributed", "canzona.layouts.base", "canzona.layouts.zero1", "canzona.layouts.fsdp2"):
        assert "canzona.runtime.checkpoint" in _imports(mod, paths[mod]), f"{mod} must implement canzona.runtime.checkpoint's contract"


def test_planner_and_simulator_import_without_torch() -> None:
    code = (
        "import sys, canzona.plan, canzona.sim, canzona.cost, canzona.optimizers, canzona.phase_names, canzona.paper; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'canzona.runtime', 'canzona.commands'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ----------------------------------------------------------------------------- product and lab
def _lab_names() -> set[str]:
    """Top-level import names of the lab: the suite's package, the tests' package and every module
    of ``tests/`` (pytest puts that folder on ``sys.path``, so ``import harness`` would resolve)."""
    return {"validation", "tests"} | {p.stem for p in TESTS.glob("*.py")}


def _names_by_string(path: Path) -> set[str]:
    """Modules named by a string literal to ``importlib.import_module`` / ``__import__``: an
    import the statement check would miss."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if called in ("import_module", "__import__"):
                found.add(node.args[0].value)
    return found


def _reaches_lab(name: str, path: Path) -> list[str]:
    lab = _lab_names()
    named = _imports(name, path) | _names_by_string(path)
    return sorted(m for m in named if m.split(".")[0] in lab)


@pytest.mark.parametrize("name,path", _modules(), ids=[n for n, _ in _modules()])
def test_product_reaches_the_lab_only_through_its_door(name: str, path: Path) -> None:
    """No module of ``canzona/`` imports ``validation`` or a test module, lazily or not, except
    :mod:`canzona.lab`, which imports the suite by the name it keeps in ``SUITE``."""
    bad = [] if name == LAB_DOOR else _reaches_lab(name, path)
    assert not bad, f"{name} imports {bad}: the product reaches the exactness suite only through canzona.lab.suite()"


def test_the_door_names_the_suite_and_nothing_else() -> None:
    import canzona.lab

    paths = dict(_modules())
    assert canzona.lab.SUITE == "validation"
    assert _reaches_lab(LAB_DOOR, paths[LAB_DOOR]) == []  # by its constant, not by an import statement
    assert "importlib" in _imports(LAB_DOOR, paths[LAB_DOOR])


def test_lab_check_catches_a_lazy_import(tmp_path: Path) -> None:
    """The checker itself: a function-level import of the suite, an ``import_module`` of it by
    name, and an import of a test helper module are all found."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from validation.harness import ToyModel\n"
                     "def g():\n    import importlib; importlib.import_module('validation.faults')\n"
                     "def h():\n    import harness\n", encoding="utf-8")
    assert _reaches_lab("canzona.probe", probe) == ["harness", "validation.faults", "validation.harness", "validation.harness.ToyModel"]


# ----------------------------------------------------------------------------- import cycles
def _resolve(imported: str, known: set[str]) -> str | None:
    """The module an imported name lands on: the longest known module that is ``imported`` or a
    prefix of it (``from canzona.runtime import dp`` lands on ``canzona.runtime.dp``, ``from
    canzona.plan import Plan`` on ``canzona.plan``); None outside the two packages."""
    parts = imported.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in known:
            return cand
    return None


def _targets(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules among ``known`` that the statements of ``path`` import. ``from a import b``
    lands on module ``a.b`` when there is one, on ``a`` otherwise (``b`` is then a name of ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(_resolve(a.name, known) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.update(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else _resolve(mod, known) for a in node.names)
    return {t for t in out if t is not None and t != name}


def import_graph(modules: list[tuple[str, Path]]) -> dict[str, set[str]]:
    """Module -> the modules it imports (every statement, lazy ones too), among ``modules``.
    Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``; those implicit edges are
    left out (every package that re-exports its submodules would otherwise be a cycle), the
    explicit ones (``from a import name`` where ``name`` is defined by ``a/__init__``) count."""
    known = {n for n, _ in modules}
    return {name: _targets(name, path, known) for name, path in modules}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module
    (Tarjan's algorithm, iterative), in a deterministic order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.add(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        components.append(comp)
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return [_cycle_in(comp, graph) for comp in sorted(components, key=sorted)]


def _cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within it)."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & comp):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{sorted(comp)} is no cycle")


def test_no_import_cycle_among_product_and_suite_modules() -> None:
    graph = import_graph(_modules(PACKAGE, SUITE))
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_reports_the_cycle() -> None:
    """The checker itself, on a hand-made graph: a three-module loop is reported as its path, a
    diamond is not a cycle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d", "f"}, "f": {"d"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"x": {"y"}, "y": set()}) == []
    known = {"canzona.runtime", "canzona.runtime.dp", "canzona.plan"}
    assert _resolve("canzona.runtime.dp.DPRuntime", known) == "canzona.runtime.dp"
    assert _resolve("canzona.plan.Plan", known) == "canzona.plan"
    assert _resolve("torch.nn", known) is None
