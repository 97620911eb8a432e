"""Phase names lead to code: the registry of :mod:`canzona.phase_names` and the literals that
open ranges agree both ways, and each name is spelled where it is opened (a grep for its text
lands on that line, or on the layout that hands it to the shared exchange engine)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from canzona import phase_names as P

ROOT = Path(__file__).resolve().parents[1]
#: the code whose strings are checked (tests are left out: they try names that must not parse)
CODE = [p for d in ("canzona", "validation", "profiling", "examples") for p in sorted((ROOT / d).rglob("*.py"))]
#: calls whose literal arguments open a range (``phase``) or name an exchange engine's ranges
OPENERS = ("phase", "exchange_phases")


def _text(node: ast.AST) -> str | None:
    """A string literal's text, an f-string's with each ``{...}`` read as ``0``; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "0" for v in node.values)
    return None


def _strings(tree: ast.AST) -> list[ast.AST]:
    """Every string literal and f-string of ``tree``, the literal parts of an f-string not again."""
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return [n for n in ast.walk(tree) if _text(n) is not None and id(n) not in parts]


def _literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string in ``path`` that names a canzona phase: ``canzona/`` and a
    literal first segment (``f"canzona/{kind}/..."``, a store key of the agreement, is not one),
    no file-name characters."""
    out = []
    for node in _strings(ast.parse(path.read_text(encoding="utf-8"))):
        text = _text(node)
        literal = isinstance(node, ast.Constant) or (isinstance(node.values[0], ast.Constant) and node.values[0].value != "canzona/")
        # a phase name has no dot, star or space (``canzona/*.py``, ``canzona/data/x.json`` are paths)
        if text.startswith("canzona/") and len(text) > len("canzona/") and literal and not any(c in text for c in ".* "):
            out.append((node.lineno, text))
    return out


def _opened(path: Path) -> set[str]:
    """Base names spelled literally inside the arguments of a ``phase(...)`` or ``exchange_phases(...)`` call."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if called in OPENERS:
                for arg in node.args:
                    for sub in _strings(arg):
                        text = _text(sub)
                        if text.startswith("canzona/"):
                            found.add(P.base_phase(text))
    return found


def test_every_name_in_the_code_is_registered() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in CODE for line, text in _literals(p) if P.base_phase(text) not in P.PHASES]
    assert not bad, "phase names not in canzona.phase_names.PHASES: " + "; ".join(bad)


def test_every_registered_name_is_opened_where_it_is_spelled() -> None:
    opened = set().union(*(_opened(p) for p in CODE if p.name != "phase_names.py"))
    assert sorted(set(P.PHASES) - opened) == [], "registered but never opened by a literal"
    assert opened <= set(P.PHASES)


def test_the_exchange_names_are_chosen_by_each_layout() -> None:
    """TP's engine opens canzona/tp/*, FSDP2's shard-group engine canzona/shard/*: each literal is
    in that layout's own module, none in the shared engine."""
    runtime = ROOT / "canzona" / "runtime"
    assert {n for n in _opened(runtime / "tp.py") if n.startswith("canzona/tp/")} == {P.TP_GATHER, P.TP_COMPUTE, P.TP_SCATTER, P.TP_APPLY}
    assert {n for n in _opened(runtime / "shard.py") if n.startswith("canzona/shard/")} == {P.SHARD_GATHER, P.SHARD_COMPUTE, P.SHARD_SCATTER, P.SHARD_APPLY}
    assert not _literals(runtime / "exchange.py"), "the shared engine spells no name: its owner passes them"
    assert not [t for _, t in _literals(runtime / "shard.py") if t.startswith("canzona/tp/")]


def test_exchange_phases_refuse_a_mixed_or_unknown_set() -> None:
    assert P.exchange_phases(P.SHARD_GATHER, P.SHARD_COMPUTE, P.SHARD_SCATTER, P.SHARD_APPLY).scatter == "canzona/shard/scatter"
    with pytest.raises(ValueError, match="one dimension"):
        P.exchange_phases(P.TP_GATHER, P.SHARD_COMPUTE, P.TP_SCATTER, P.TP_APPLY)
    with pytest.raises(ValueError, match="one dimension"):
        P.exchange_phases(P.TP_SCATTER, P.TP_COMPUTE, P.TP_GATHER, P.TP_APPLY)
    with pytest.raises(ValueError, match="one dimension"):
        P.exchange_phases("canzona/ep/gather", "canzona/ep/compute", "canzona/ep/scatter", "canzona/ep/apply")


def test_one_definition_of_communication() -> None:
    """COMM_PHASES is phase_names's; the trace summary and the benchmarks use that one, and the
    step's optimizer exchanges and the compute phases are subsets of the registry."""
    from canzona.profiling import bench, traces

    assert traces.COMM_PHASES is P.COMM_PHASES and traces.COMPUTE_PHASES is P.COMPUTE_PHASES
    assert bench.COMPUTE is P.COMPUTE_PHASES
    assert P.OPTIMIZER_COMM_PHASES <= P.COMM_PHASES <= set(P.PHASES) and P.COMPUTE_PHASES <= set(P.PHASES)
    assert not P.COMM_PHASES & P.COMPUTE_PHASES
    assert all(P.is_communication(f"{b}/group0/wait") for b in P.COMM_PHASES)
    assert not P.is_communication("canzona/shard/compute/group0")


def test_docs_list_every_registered_name() -> None:
    doc = (ROOT / "docs" / "profiling.md").read_text(encoding="utf-8")
    assert [n for n in P.PHASES if f"`{n}`" not in doc] == []


def test_the_checker_finds_an_unregistered_literal(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('def f(k):\n    with phase(f"canzona/tp/shuffle/group{k}/wait"):\n        pass\n', encoding="utf-8")
    ((line, text),) = _literals(probe)
    assert line == 2 and P.base_phase(text) == "canzona/tp/shuffle" not in P.PHASES
    assert _opened(probe) == {"canzona/tp/shuffle"}
