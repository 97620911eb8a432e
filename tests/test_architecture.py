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
                        "canzona.distributed", "canzona.fsdp", "canzona.hf", "validation.harness"),
    # the library loop and front end never import the command line
    "canzona.distributed": ("canzona.commands", "canzona.cli", "canzona.train"),
    "canzona.train": ("canzona.commands", "canzona.cli"),
    "canzona.models": ("canzona.commands", "canzona.cli", "canzona.runtime"),
    "canzona.viz": ("canzona.commands", "canzona.cli"),
    "canzona.profiling": ("canzona.commands", "canzona.cli"),
    "validation.harness": ("canzona.commands", "canzona.cli"),
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
    assert _hits("canzona.fsdp", _rule("canzona.runtime.dcp"))
    assert not _hits("canzona.runtime.checkpoint", _rule("canzona.runtime.dcp"))


def test_checkpoint_modules_name_no_front_end() -> None:
    """The former back-edge, checked on the source: the checkpoint formats import no front end,
    not even for type annotations, and the front ends import the contract from the runtime."""
    paths = dict(_modules())
    for mod in ("canzona.runtime.checkpoint", "canzona.runtime.dcp"):
        front = sorted(m for m in _imports(mod, paths[mod]) if m.startswith(("canzona.distributed", "canzona.fsdp")))
        assert front == [], f"{mod} imports {front}"
    for mod in ("canzona.distributed", "canzona.fsdp"):
        assert "canzona.runtime.checkpoint" in _imports(mod, paths[mod]), f"{mod} must implement canzona.runtime.checkpoint's contract"


def test_planner_and_simulator_import_without_torch() -> None:
    code = (
        "import sys, canzona.plan, canzona.sim, canzona.cost, canzona.optimizers, canzona.phase_names, canzona.paper; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'canzona.runtime', 'canzona.commands'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
