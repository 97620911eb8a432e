"""Which parameters a matrix optimizer takes, and the matrix / element-wise split.

Muon, Shampoo and SOAP precondition hidden-layer weight matrices; the token embedding, the output
head and MoE routers are left to AdamW (Jordan et al. 2024 recommend AdamW for embeddings and the
head; Liu et al. 2025, arXiv 2502.16982, do the same at scale). Canzona's planner (arXiv 2602.06079,
Sec. 3.1) treats exactly the matrix parameters as atomic; the rule lives in :mod:`canzona.specs`
(the lowest layer) and is re-exported here, so both sides agree by construction.

The rule (names are matched case-insensitively):

1. The tensor must be 2-D (vectors, scalars and >2-D tensors are element-wise).
2. It is *not* a matrix parameter if its name contains any of ``embed``, ``lm_head``,
   ``output_layer`` or ``router``, or if its last two dotted components are ``gate.weight``
   (the MoE router of Qwen3-MoE / Mixtral: ``mlp.gate.weight``; a dense MLP's
   ``mlp.gate_proj.weight`` stays a matrix).
3. Otherwise it is a matrix parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays unimported for the planner, which only needs is_matrix_param
    import torch
    from torch import Tensor

from canzona.specs import MATRIX_EXCLUDE_PATTERNS, is_matrix_param

__all__ = ["MATRIX_EXCLUDE_PATTERNS", "is_matrix_param", "split_param_groups"]


def split_param_groups(
    model_or_named_params: torch.nn.Module | Iterable[tuple[str, Tensor]],
) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """Split named parameters into ``(matrix, elementwise)`` lists of ``(name, param)``.

    Accepts an ``nn.Module`` (its ``named_parameters()``, tied weights listed once) or an iterable
    of ``(name, tensor)`` pairs. Parameters with ``requires_grad=False`` are left out of both
    lists, since no optimizer should step them. Order follows the input. Both lists can be handed
    straight to torch optimizers, which then record the names in ``param_groups[i]["param_names"]``:

    >>> matrix, elementwise = split_param_groups(model)  # doctest: +SKIP
    >>> opt_m, opt_e = Muon(matrix, lr=0.02), torch.optim.AdamW(elementwise, lr=3e-4)  # doctest: +SKIP
    """
    import torch

    if isinstance(model_or_named_params, torch.nn.Module):
        named = list(model_or_named_params.named_parameters())
    else:
        named = list(model_or_named_params)
    matrix: list[tuple[str, Tensor]] = []
    elementwise: list[tuple[str, Tensor]] = []
    seen_names: set[str] = set()
    seen_tensors: set[int] = set()
    for i, item in enumerate(named):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"entry {i} is not a (name, tensor) pair: {item!r:.80}")
        name, param = item
        if not isinstance(name, str) or not isinstance(param, torch.Tensor):
            raise TypeError(f"entry {i} must be (str, Tensor), got ({type(name).__name__}, {type(param).__name__})")
        if name in seen_names:
            raise ValueError(f"parameter name {name!r} appears twice")
        if id(param) in seen_tensors:
            raise ValueError(f"parameter {name!r} is the same tensor as an earlier entry (tied weights)")
        seen_names.add(name)
        seen_tensors.add(id(param))
        if not param.requires_grad:
            continue
        (matrix if is_matrix_param(name, param.shape) else elementwise).append((name, param))
    return matrix, elementwise
