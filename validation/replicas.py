"""Every copy on every rank: replicated parameters and optimizer state checked bit for bit.

A consolidated ``state_dict()`` keeps one canonical copy of each piece (DP rank 0's under ``sc``,
TP rank 0's for TP-replicated parameters), so a replica that drifted on another rank would never
be seen by a check that reads it. Here every rank exports *all* it holds, keyed by what it is a
copy of, and rank 0 requires every copy of the same thing to be identical (``torch.equal``):

- ``param:<name>[@tp<t>]``: the model's (TP-local) value; every DP replica, and for parameters
  not split over TP every TP rank, holds the same bits;
- ``master:<name>[<start>:<end>][@tp<t>]`` and ``state:...``: an owner's fp32 master and
  optimizer state for that piece (``sc`` keeps one on every DP rank; TP-replicated parameters
  one per TP rank);
- ``host:<name>``: a TP host's full master and state (the ``sync`` schedule keeps one on every
  TP rank, ``sc`` on every DP rank too).

This reads runtime internals (pieces, masters, inner optimizers, TP engine), like the checkpoint
export does, and runs only in validation workers, never in the training hot path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from canzona.runtime.buffer import local_tensor
from validation.compare import Comparator, flatten_state

__all__ = ["local_params", "local_replicas", "compare_replicas"]


def _cpu(v: Any) -> Any:
    return v.detach().to("cpu").clone() if torch.is_tensor(v) else v


def _split(model: nn.Module, tp_dims: Mapping[str, int]) -> dict[str, bool]:
    out = {}
    for n, p in model.named_parameters():
        placements = getattr(p, "placements", None)
        out[n] = n in tp_dims or bool(placements and any(getattr(pl, "dim", None) is not None for pl in placements))
    return out


def local_params(model: nn.Module, tp_dims: Mapping[str, int], tp_rank: int) -> dict[str, torch.Tensor]:
    """``param:`` entries of this rank (see the module docstring)."""
    split = _split(model, tp_dims)
    return {f"param:{n}" + (f"@tp{tp_rank}" if split[n] else ""): _cpu(local_tensor(p.detach())) for n, p in model.named_parameters()}


def local_replicas(dopt: Any, tp_rank: int) -> dict[str, dict[str, Any]]:
    """``master:``/``state:``/``host:`` entries of this rank: {key: {"master": tensor, "state.<k>": leaf}}."""
    rt = dopt.runtime
    out: dict[str, dict[str, Any]] = {}
    for pc in rt.pieces:
        if pc.role == "tp":
            continue  # hosted by the TP engine: exported below as host:<name>
        spec = rt.specs[pc.name]
        key = f"owner:{pc.name}[{pc.start}:{pc.end}]" + (f"@tp{tp_rank}" if spec.tp_split else "")
        master = rt.masters[pc]
        opt = rt.matrix_opt if pc.role == "matrix" else rt.elementwise_opt
        st = opt.state.get(master, {}) if opt is not None else {}
        entry: dict[str, Any] = {"master": _cpu(master)}
        entry.update({k: _cpu(v) for k, v in flatten_state(st)})
        out[key] = entry
    eng = rt.tp_engine
    if eng is not None:
        states = eng.state_dict()
        for name in eng.hosted:
            entry = {"master": _cpu(eng.masters[name])}
            entry.update({k: _cpu(v) for k, v in flatten_state(states.get(name, {}))})
            out[f"host:{name}"] = entry
    return out


def _param_of(key: str) -> str:
    body = key.split(":", 1)[1]
    return body.split("[", 1)[0].split("@", 1)[0]


def compare_replicas(per_rank: Sequence[Mapping[str, Mapping[str, Any]] | Mapping[str, Any]], cmp: Comparator, *, label: str = "") -> int:
    """Require every copy of the same key on every rank to equal the lowest rank's copy, bit for
    bit. ``per_rank[r]`` maps keys to a tensor (``param:`` entries) or to a dict of leaves. A
    mismatch is recorded as ``replica@rank<r><label>:<what>``; returns the number of keys held by
    more than one rank."""
    holders: dict[str, list[int]] = {}
    for r, d in enumerate(per_rank):
        for k in d:
            holders.setdefault(k, []).append(r)
    shared = 0
    for key, ranks in holders.items():
        if len(ranks) < 2:
            continue
        shared += 1
        base = per_rank[ranks[0]][key]
        for r in ranks[1:]:
            other = per_rank[r][key]
            what = f"replica@rank{r}{label}"
            name = _param_of(key)
            if torch.is_tensor(base):
                cmp.tensors(name, f"{what}:{key.split(':', 1)[0]}", base, other)
                continue
            for leaf in sorted(set(base) | set(other)):
                if leaf not in other or leaf not in base:
                    cmp.missing(name, f"{what}:{leaf}", "present" if leaf in base else "absent", "missing" if leaf not in other else "present")
                elif torch.is_tensor(base[leaf]) or torch.is_tensor(other[leaf]):
                    cmp.tensors(name, f"{what}:{leaf}", base[leaf], other[leaf])
                elif base[leaf] != other[leaf]:
                    cmp.missing(name, f"{what}:{leaf}", repr(base[leaf]), repr(other[leaf]))
                else:
                    cmp.compared += 1
    return shared
