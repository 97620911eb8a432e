"""Bitwise comparison of named tensors and optimizer states, with the first difference located.

Exactness is ``torch.equal`` (same dtype, same shape, same bits up to ``-0.0 == 0.0`` and NaN
never equal). When tensors differ the comparison reports the largest absolute difference and the
first differing *flat* index (row-major over the full, unsharded shape), so a report can name the
parameter and element a defect touched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = ["Mismatch", "Comparison", "compare_tensors", "flatten_state", "Comparator"]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Where two runs first differ: parameter name, what was compared (``value``, ``value@dp1``,
    ``master``, ``state.exp_avg``, ``loss``), flat index (None: shape/dtype/key mismatch), values;
    ``expert``: for an ``(E, M, N)`` expert stack, the expert the flat index falls in."""

    param: str
    what: str
    index: int | None
    expected: float | str | None
    got: float | str | None
    expert: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"param": self.param, "what": self.what, "index": self.index, "expected": self.expected, "got": self.got}
        if self.expert is not None:
            out["expert"] = self.expert
        return out

    def __str__(self) -> str:
        at = f"[{self.index}]" if self.index is not None else ""
        who = f"{self.param} expert {self.expert}" if self.expert is not None else self.param
        return f"{who} {self.what}{at}: expected {self.expected}, got {self.got}"


@dataclass(slots=True)
class Comparison:
    """Outcome of one comparison: equal bit for bit, max |a - b| (None when incomparable) and the first mismatch."""

    equal: bool
    max_abs_diff: float | None
    mismatch: Mismatch | None


def _num(x: torch.Tensor) -> float:
    return float(x.to(torch.float64).item())


def compare_tensors(param: str, what: str, expected: Any, got: Any) -> Comparison:
    """Compare two tensors (or numbers, as 0-dim tensors) bit for bit."""
    if not torch.is_tensor(expected):
        expected = torch.as_tensor(expected)
    if not torch.is_tensor(got):
        got = torch.as_tensor(got)
    if expected.shape != got.shape:
        return Comparison(False, None, Mismatch(param, what, None, f"shape {tuple(expected.shape)}", f"shape {tuple(got.shape)}"))
    if expected.dtype != got.dtype:
        return Comparison(False, None, Mismatch(param, what, None, f"dtype {expected.dtype}", f"dtype {got.dtype}"))
    if torch.equal(expected, got):
        return Comparison(True, 0.0, None)
    e = expected.detach().reshape(-1).to(torch.float64)
    g = got.detach().reshape(-1).to(torch.float64)
    diff = (e - g).abs()
    # NaN on either side is a mismatch (torch.equal said so); count it as an infinite difference
    bad = (e != g) | torch.isnan(e) | torch.isnan(g)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    index = int(torch.nonzero(bad)[0, 0]) if bool(bad.any()) else 0
    mx = float(diff.max()) if diff.numel() else 0.0
    return Comparison(False, mx, Mismatch(param, what, index, _num(e[index]), _num(g[index])))


def flatten_state(state: Mapping[str, Any], prefix: str = "state") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf) pairs of a per-parameter optimizer state, recursing into dicts, lists
    and tuples; leaves are tensors, numbers, strings, bools or None."""
    for k in sorted(state, key=str):
        yield from _flatten(state[k], f"{prefix}.{k}")


def _flatten(v: Any, key: str) -> Iterator[tuple[str, Any]]:
    if isinstance(v, Mapping):
        for k in sorted(v, key=str):
            yield from _flatten(v[k], f"{key}.{k}")
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            yield from _flatten(x, f"{key}.{i}")
    else:
        yield key, v


@dataclass(slots=True)
class Comparator:
    """Accumulates comparisons in order; keeps the first mismatch and the overall max |diff|.
    ``experts`` maps each expert stack's name to its expert count E: a mismatch in a tensor of
    that parameter whose leading dimension is E (its values, its master, a per-expert state
    stacked along the expert index) names the expert it lies in."""

    first: Mismatch | None = None
    max_abs_diff: float = 0.0
    incomparable: bool = False
    compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    experts: Mapping[str, int] = field(default_factory=dict)

    def tensors(self, param: str, what: str, expected: Any, got: Any) -> None:
        c = compare_tensors(param, what, expected, got)
        n_experts = self.experts.get(param)
        if c.mismatch is not None and c.mismatch.index is not None and n_experts and torch.is_tensor(expected):
            if expected.dim() >= 1 and expected.shape[0] == n_experts:
                per_expert = expected.numel() // n_experts
                c.mismatch = replace(c.mismatch, expert=c.mismatch.index // per_expert)
        self._add(c)

    def _add(self, c: Comparison) -> None:
        self.compared += 1
        if c.equal:
            return
        if c.max_abs_diff is None:
            self.incomparable = True
        else:
            self.max_abs_diff = max(self.max_abs_diff, c.max_abs_diff)
        assert c.mismatch is not None
        self.mismatches.append(c.mismatch)
        if self.first is None:
            self.first = c.mismatch

    def missing(self, param: str, what: str, expected: str, got: str) -> None:
        self._add(Comparison(False, None, Mismatch(param, what, None, expected, got)))

    def states(self, param: str, expected: Mapping[str, Any], got: Mapping[str, Any]) -> None:
        """Compare two per-parameter optimizer states key by key (both flattened)."""
        e = dict(flatten_state(expected))
        g = dict(flatten_state(got))
        for key in sorted(set(e) | set(g)):
            if key not in g:
                self.missing(param, key, "present", "missing")
            elif key not in e:
                self.missing(param, key, "absent", "present")
            elif torch.is_tensor(e[key]) or torch.is_tensor(g[key]) or isinstance(e[key], (int, float)) and not isinstance(e[key], bool):
                self.tensors(param, key, e[key], g[key])
            elif e[key] != g[key]:
                self.missing(param, key, repr(e[key]), repr(g[key]))
            else:
                self.compared += 1

    @property
    def equal(self) -> bool:
        return self.first is None

    def reported_max(self) -> float | None:
        """The max |diff| for the report: None only when every mismatch was incomparable."""
        if self.first is None:
            return 0.0
        if self.incomparable and self.max_abs_diff == 0.0:
            return None
        return self.max_abs_diff

    def names(self) -> Sequence[str]:
        return sorted({m.param for m in self.mismatches})
