"""The exactness suite's ground truth and its test inputs: a model, gradients and a reference.

Shared by :mod:`validation.checks`, :mod:`validation.fsdp_harness`, the GPU check
(:mod:`validation.gpu`) and the repository's tests. Importing this module has no side effects (no
process groups, no global seeds, no threads).

- :class:`ToyModel`: a small model with awkward, mutually prime shapes (matrices, biases, a norm
  scale, an embedding and an output head), so bucket cuts land everywhere and element-wise
  parameters get cut by ``zero1``.
- :func:`integer_grads`: gradients that reduce *exactly* in any order: small integers times a
  power of two, so every partial sum of up to a few hundred ranks is representable and the
  reduction order of a collective cannot change a bit. :func:`mean_grads` is the reference
  reduction (sum, then divide by the DP size).
- :func:`tp_cut` / :func:`tp_local`: the TP-local piece of a full-shape gradient or tensor.
- :func:`inject_grads`: drive gradients through a real backward pass (``(p * g).sum()``, whose
  gradient is ``g`` exactly), so backward hooks fire as they do in training.
- :class:`ReferenceRunner`: the single-process ground truth: the same optimizers on the same
  reduced gradients, matrix parameters to the matrix optimizer, element-wise ones to the
  element-wise optimizer, optional fp32 masters for low-precision models.
- :func:`tensors_equal`, :func:`pack` / :func:`unpack`: bitwise comparison of named tensors, and
  tensors as bytes for a worker's return value.

Invariant: every comparison here is ``torch.equal``; nothing takes a tolerance.
"""

from __future__ import annotations

import copy
import io
import zlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from canzona.runtime.buffer import local_tensor as _local
from canzona.specs import is_matrix_param

__all__ = [
    "ReferenceRunner",
    "ToyModel",
    "inject_grads",
    "integer_grads",
    "mean_grads",
    "pack",
    "params_of",
    "tensors_equal",
    "tp_cut",
    "tp_local",
    "unpack",
]


class ToyModel(nn.Module):
    """Embedding -> up projection (+bias) -> scale -> tanh -> down projection -> residual -> mix
    (+bias) -> output head. Shapes are small and awkward on purpose (``vocab=13, hidden=6,
    ffn=10``): 4 matrix parameters (up, glu, down, mix) and 5 element-wise ones (embedding,
    two biases, a norm scale, the output head)."""

    def __init__(self, vocab: int = 13, hidden: int = 6, ffn: int = 10, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def param(*shape: int, scale: float = 0.3) -> nn.Parameter:
            return nn.Parameter((torch.randn(*shape, generator=g) * scale).to(dtype))

        self.embed = nn.Module()
        self.embed.weight = param(vocab, hidden)
        self.up = nn.Module()
        self.up.weight = param(ffn, hidden)
        self.up.bias = param(ffn)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(ffn, dtype=dtype) + param(ffn, scale=0.1).detach())
        self.down = nn.Module()
        self.down.weight = param(hidden, ffn)
        self.glu = nn.Module()
        self.glu.weight = param(ffn, hidden)
        self.mix = nn.Module()
        self.mix.weight = param(hidden, hidden)
        self.mix.bias = param(hidden)
        self.lm_head = nn.Module()
        self.lm_head.weight = param(vocab, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed.weight[ids]
        h = torch.tanh((x @ self.up.weight.T + self.up.bias) * self.norm.weight) * torch.sigmoid(x @ self.glu.weight.T)
        x = x + h @ self.down.weight.T
        x = x @ self.mix.weight.T + self.mix.bias
        return x @ self.lm_head.weight.T

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy on ``ids`` [batch, seq]."""
        logits = self(ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def integer_grads(
    shapes: Mapping[str, Sequence[int]] | nn.Module,
    *,
    step: int,
    rank: int,
    seed: int = 0,
    bound: int = 8,
    exponent: int = -4,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Integers in [-bound, bound] times 2**exponent for every parameter (TP-local shapes for a module).

    Deterministic in (seed, step, rank, name). A sum over R ranks is an integer of magnitude at most
    ``bound * R`` times the same power of two, hence exact in fp32 while ``bound * R < 2**24``, and the
    mean is exact when R is a power of two. bf16 values (8-bit significand) are exact while
    ``bound <= 256``; their sums are formed in fp32 by the runtime.
    """
    if isinstance(shapes, nn.Module):
        shapes = {n: tuple(_local(p.detach()).shape) for n, p in shapes.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        key = zlib.crc32(f"{seed}/{step}/{rank}/{name}".encode())
        g = torch.Generator().manual_seed(key)
        ints = torch.randint(-bound, bound + 1, tuple(shape), generator=g)
        out[name] = (ints.to(torch.float64) * 2.0**exponent).to(dtype)
    return out


def tp_cut(
    full: Mapping[str, torch.Tensor],
    tp_dims: Mapping[str, int],
    tp_rank: int,
    tp: int,
    *,
    partial: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """This TP rank's part of every full-shape gradient in ``full``: parameters named in ``tp_dims``
    get their contiguous shard along that dim (Megatron's and DTensor's ``Shard`` layout alike);
    replicated ones the whole tensor, except names in ``partial``, whose gradients the model
    all-reduces over TP in backward (each rank holds a partial sum, e.g. the tiny Qwen3's per-head
    q/k norms): those get ``full / tp`` (exact for a power-of-two ``tp`` and dyadic values), so the
    all-reduce restores ``full``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        dim = tp_dims.get(name)
        if dim is not None and tp > 1:
            out[name] = t.chunk(tp, dim=dim)[tp_rank].contiguous()
        elif name in partial:
            out[name] = t / tp
        else:
            out[name] = t
    return out


def tp_local(
    full: Mapping[str, torch.Tensor], specs: Sequence[Any], tp_rank: int, *, partial: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """:func:`tp_cut` with the split dims and TP size read from ``specs`` (ParamSpec objects), for
    the parameters ``specs`` names."""
    tp = max((spec.tp for spec in specs), default=1)
    dims = {spec.name: spec.tp_dim for spec in specs if spec.tp_split}
    return tp_cut({spec.name: full[spec.name] for spec in specs}, dims, tp_rank, tp, partial=partial)


def mean_grads(per_rank: Sequence[Mapping[str, torch.Tensor]], *, dtype: torch.dtype = torch.float32, reduce: str = "mean") -> dict[str, torch.Tensor]:
    """The reference DP reduction: sum over ranks in rank order (in ``dtype``), then divide by their number."""
    out: dict[str, torch.Tensor] = {}
    for name in per_rank[0]:
        acc = torch.zeros_like(per_rank[0][name], dtype=dtype)
        for g in per_rank:
            acc += g[name].to(dtype)
        out[name] = acc / len(per_rank) if reduce == "mean" else acc
    return out


def inject_grads(model: nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Run a backward pass whose gradient for parameter ``n`` is exactly ``grads[n]`` (TP-local shape).

    ``d/dp sum(p * g) = g`` with no rounding, so the backward hooks see the injected values bit for bit.
    """
    named = dict(model.named_parameters())
    total: torch.Tensor | None = None
    for name, g in grads.items():
        p = named[name]
        term = (_local(p) * g.to(_local(p.detach()).dtype)).sum()
        total = term if total is None else total + term
    if total is not None:
        total.backward()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the model's (TP-local) parameter values."""
    return {n: _local(p.detach()).clone() for n, p in model.named_parameters()}


def tensors_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (or exist on one side only); empty when all are equal."""
    bad = sorted(set(a) ^ set(b))
    bad += [n for n in a if n in b and not (a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]))]
    return bad


class ReferenceRunner:
    """Single-process ground truth: ``matrix_cls`` on matrix parameters, ``elementwise_cls`` on the
    rest (on everything when ``all_elementwise``, as ``zero1`` does), over fp32 (``master_dtype``)
    masters of the model's parameters; values are written back to the model after each step.

    ``kinds`` overrides the name rule per parameter (``matrix``, ``elementwise`` or ``experts``).
    An ``experts`` parameter, an ``(E, M, N)`` stack, is E independent ``(M, N)`` matrices: each
    its own master and optimizer state, stepped by ``matrix_cls`` as if it were alone; the stack's
    master is their stack, and :meth:`states` stacks each per-expert state tensor along the expert
    index (the layout canzona's consolidated checkpoint keeps)."""

    def __init__(
        self,
        model: nn.Module,
        matrix_cls: type[torch.optim.Optimizer],
        matrix_kwargs: Mapping[str, Any] | None = None,
        elementwise_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        elementwise_kwargs: Mapping[str, Any] | None = None,
        *,
        all_elementwise: bool = False,
        master_dtype: torch.dtype = torch.float32,
        kinds: Mapping[str, str] | None = None,
    ) -> None:
        self.model = copy.deepcopy(model)
        self.master_dtype = master_dtype
        self.masters = {n: p.detach().to(master_dtype, copy=True) for n, p in self.model.named_parameters()}
        kinds = dict(kinds or {})
        #: per expert stack, its experts' own masters (the ones the matrix optimizer steps)
        self.experts: dict[str, list[torch.Tensor]] = {}
        mat, ew = [], []
        for n, p in self.model.named_parameters():
            kind = kinds.get(n) or ("matrix" if is_matrix_param(n, p.shape) else "elementwise")
            if kind == "experts" and not all_elementwise:
                self.experts[n] = [self.masters[n][e].clone() for e in range(p.shape[0])]
                mat.extend(self.experts[n])
                continue
            (ew if all_elementwise or kind == "elementwise" else mat).append(self.masters[n])
        self.optimizers = []
        if mat:
            self.optimizers.append(matrix_cls(mat, **dict(matrix_kwargs or {})))
        if ew:
            self.optimizers.append(elementwise_cls(ew, **dict(elementwise_kwargs or {})))

    def step(self, grads: Mapping[str, torch.Tensor]) -> None:
        for n, m in self.masters.items():
            g = grads[n].to(self.master_dtype) if n in grads else None
            if n in self.experts:
                for e, t in enumerate(self.experts[n]):
                    t.grad = None if g is None else g[e].clone()
            else:
                m.grad = g
        for opt in self.optimizers:
            opt.step()
        with torch.no_grad():
            for n, tasks in self.experts.items():
                self.masters[n].copy_(torch.stack(tasks))
                for t in tasks:
                    t.grad = None
            for n, p in self.model.named_parameters():
                self.masters[n].grad = None
                p.copy_(self.masters[n])

    def params(self) -> dict[str, torch.Tensor]:
        return params_of(self.model)

    def master_values(self) -> dict[str, torch.Tensor]:
        return {n: m.detach().clone() for n, m in self.masters.items()}

    def _state_of(self, t: torch.Tensor) -> Mapping[str, Any] | None:
        for opt in self.optimizers:
            if t in opt.state:
                return opt.state[t]
        return None

    def states(self) -> dict[str, Mapping[str, Any]]:
        """Each parameter's optimizer state (live, not copied; an expert stack's per-expert
        tensors stacked, its numbers from expert 0, which every expert shares), keyed by name;
        parameters no optimizer has stepped yet are absent."""
        out: dict[str, Mapping[str, Any]] = {}
        for n, m in self.masters.items():
            if n in self.experts:
                per = [self._state_of(t) for t in self.experts[n]]
                if all(st for st in per):
                    out[n] = {
                        k: torch.stack([st[k] for st in per]) if torch.is_tensor(v) and v.dim() > 0 else v
                        for k, v in per[0].items()
                    }
                continue
            st = self._state_of(m)
            if st is not None:
                out[n] = st
        return out


def pack(obj: Any) -> bytes:
    """Serialize tensors (and plain containers) to bytes for a worker's return value.

    Tensors put on a ``torch.multiprocessing`` queue travel as shared-memory file descriptors that
    die with the worker process; bytes do not.
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    """Inverse of :func:`pack` (``weights_only=True``: data, not code)."""
    return torch.load(io.BytesIO(data), weights_only=True)
