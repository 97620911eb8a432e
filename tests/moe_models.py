"""Small models with every parameter shape the role rule must handle, and the single-device
reference the MoE tests compare against (each matrix task alone, on its logical shape)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class Conv1D(nn.Module):
    """GPT-2's ``transformers.pytorch_utils.Conv1D`` layout: weight stored (in, out), ``nf`` = out."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class Experts(nn.Module):
    """Stacked experts as transformers 5.x keeps them: ``gate_up_proj`` (E, 2F, H), ``down_proj`` (E, H, F)."""

    def __init__(self, e: int, h: int, f: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, h) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(e, h, f) * 0.2)


class ToyMoE(nn.Module):
    """Tied embedding + head, a position embedding, a Conv1D, a router, stacked experts, a 1 x H
    gate, a plain linear and (optionally) a conv weight."""

    def __init__(self, *, conv: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(16, 8)
        self.wpe = nn.Embedding(12, 8)
        self.c_attn = Conv1D(24, 8)
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = Experts(4, 8, 6)
        self.shared_expert_gate = nn.Linear(8, 1, bias=False)
        self.proj = nn.Linear(8, 10)
        self.norm = nn.LayerNorm(10)
        if conv:
            self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.wte.weight  # tied


def logical_tasks(name: str, role: str, transposed: bool, p: torch.Tensor) -> list[torch.Tensor]:
    """The matrices the single-device optimizer sees for one parameter (copies, contiguous)."""
    t = p.detach()
    if role == "experts":
        return [t[e].clone() for e in range(t.shape[0])]
    if role == "matrix":
        if transposed:
            return [t.T.contiguous()]
        return [t.reshape(t.shape[0], -1).clone()]
    return [t.clone()]


def from_tasks(role: str, transposed: bool, tasks: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    if role == "experts":
        return torch.stack(tasks)
    if role == "matrix" and transposed:
        return tasks[0].T.contiguous()
    return tasks[0].reshape(shape)


class TaskReference:
    """Single device: ``matrix_cls`` on every matrix task alone (experts one by one, Conv1D on its
    (out, in) transpose, conv weights reshaped), ``ew_cls`` on the rest."""

    def __init__(self, model: nn.Module, roles: Mapping[str, tuple[str, bool]], matrix_cls: Any, mkw: Mapping, ew_cls: Any, ekw: Mapping) -> None:
        self.model = copy.deepcopy(model)
        self.roles = dict(roles)
        self.tasks = {n: logical_tasks(n, *self.roles[n], p) for n, p in self.model.named_parameters()}
        mat = [t for n, ts in self.tasks.items() if self.roles[n][0] != "elementwise" for t in ts]
        ew = [t for n, ts in self.tasks.items() if self.roles[n][0] == "elementwise" for t in ts]
        self.opts = ([matrix_cls(mat, **mkw)] if mat else []) + ([ew_cls(ew, **ekw)] if ew else [])

    def step(self, grads: Mapping[str, torch.Tensor]) -> None:
        for n, ts in self.tasks.items():
            role, tr = self.roles[n]
            gs = logical_tasks(n, role, tr, grads[n]) if n in grads else [None] * len(ts)
            for t, g in zip(ts, gs):
                t.grad = g
        for o in self.opts:
            o.step()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                role, tr = self.roles[n]
                p.copy_(from_tasks(role, tr, self.tasks[n], tuple(p.shape)))
                for t in self.tasks[n]:
                    t.grad = None

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def momentum(self, name: str) -> list[torch.Tensor]:
        """Each task's Muon momentum buffer (zeros_like for a task never stepped)."""
        out = []
        for t in self.tasks[name]:
            st = self.opts[0].state.get(t, {})
            out.append(st["momentum_buffer"].clone() if "momentum_buffer" in st else torch.zeros_like(t))
        return out


# ------------------------------------------------------------------------------ FSDP2 variants
def _inject(module: nn.Module, prefix: str, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``sum(p * g)`` over the module's own parameters: their gradients are ``g`` exactly."""
    total = torch.zeros(())
    for n, p in module.named_parameters(recurse=False):
        if f"{prefix}{n}" in grads:
            total = total + (p * grads[f"{prefix}{n}"]).sum()
    return total


class InjectEmbedding(nn.Embedding):
    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return _inject(self, "embed.", grads)


class InjectLinear(nn.Linear):
    def __init__(self, prefix: str, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.prefix = prefix

    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return _inject(self, self.prefix, grads)


class InjectExperts(Experts):
    """Three stacks: 4 experts (two per rank on dp_shard 2) and 3 experts (uneven: 2 and 1)."""

    def __init__(self) -> None:
        super().__init__(4, 8, 6)
        self.odd = nn.Parameter(torch.randn(3, 5, 4) * 0.2)

    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _inject(self, "mlp.experts.", grads)


class FSDPMoE(nn.Module):
    """An embedding, a router, stacked experts and a projection whose forward injects gradients."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = InjectEmbedding(16, 8)
        self.mlp = nn.Module()
        self.mlp.gate = InjectLinear("mlp.gate.", 8, 4, bias=False)
        self.mlp.experts = InjectExperts()
        self.proj = InjectLinear("proj.", 8, 10)

    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.embed(grads) + self.mlp.gate(grads) + self.mlp.experts(grads) + self.proj(grads)
