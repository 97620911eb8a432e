"""The import direction of docs/architecture.md ("Layers"), enforced on the source.

Every ``import`` statement counts, at module level or inside a function: a lazy import is still a
dependency. A second check imports the torch-free layers in a fresh interpreter and looks at what
came along.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import canzona

PACKAGE = Path(canzona.__file__).parent

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
                        "canzona.distributed"),
    # the library loop and front end never import the command line
    "canzona.distributed": ("canzona.commands", "canzona.cli", "canzona.train"),
    "canzona.train": ("canzona.commands", "canzona.cli"),
    "canzona.models": ("canzona.commands", "canzona.cli", "canzona.runtime"),
    "canzona.viz": ("canzona.commands", "canzona.cli"),
    "canzona.profiling": ("canzona.commands", "canzona.cli"),
    "canzona.testing": ("canzona.commands", "canzona.cli"),
}

#: known back-edges, each to be removed (a new one fails the test; a removed one must leave here too)
ALLOWED: set[tuple[str, str]] = {
    # checkpoints read and restore DistributedOptimizer's hyperparameters (docs/architecture.md)
    ("canzona.runtime.checkpoint", "canzona.distributed"),
    ("canzona.runtime.checkpoint", "canzona.distributed.DistributedOptimizer"),
    # the sharded (DCP) format reads the same front-end hyperparameters
    ("canzona.runtime.dcp", "canzona.distributed"),
    ("canzona.runtime.dcp", "canzona.distributed.DistributedOptimizer"),
    ("canzona.runtime.dcp", "canzona.distributed.SCHEDULED_KEYS"),
}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
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


@pytest.mark.parametrize("name,path", _modules(), ids=[n for n, _ in _modules()])
def test_module_imports_point_one_way(name: str, path: Path) -> None:
    forbidden = _rule(name)
    bad = sorted(m for m in _imports(name, path) if _hits(m, forbidden) and (name, m) not in ALLOWED)
    assert not bad, f"{name} imports {bad}: see docs/architecture.md, 'Layers'"


def test_allowed_back_edges_still_exist() -> None:
    """An allowance outlives its back-edge only by mistake: drop it when the import goes."""
    paths = dict(_modules())
    stale = sorted(edge for edge in ALLOWED if edge[1] not in _imports(edge[0], paths[edge[0]]))
    assert not stale, f"remove from ALLOWED: {stale}"


def test_rule_catches_a_back_edge() -> None:
    """The checker itself: a runtime module importing the CLI, or the planner importing torch, is found."""
    assert _hits("canzona.commands.train", _rule("canzona.runtime.dp"))
    assert _hits("torch.distributed", _rule("canzona.plan.build"))
    assert _hits("canzona.optim.muon", _rule("canzona.plan"))
    assert not _hits("canzona.optimizers", _rule("canzona.plan"))  # the registry of names is not optimizer math


def test_planner_and_simulator_import_without_torch() -> None:
    code = (
        "import sys, canzona.plan, canzona.sim, canzona.cost, canzona.optimizers, canzona.phase_names, canzona.paper; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'canzona.runtime', 'canzona.commands'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
