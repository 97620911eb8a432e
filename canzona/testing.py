"""Helpers shared by the distributed tests and the exactness-validation suite.

Importing this module has no side effects (no process groups, no global seeds, no threads).

- :class:`ToyModel`: a small model with awkward, mutually prime shapes (matrices, biases, a norm
  scale, an embedding and an output head), so bucket cuts land everywhere and element-wise
  parameters get cut by ``zero1``.
- :func:`integer_grads`: gradients that reduce *exactly* in any order: small integers times a
  power of two, so every partial sum of up to a few hundred ranks is representable and the
  reduction order of a collective cannot change a bit. :func:`mean_grads` is the reference
  reduction (sum, then divide by the DP size).
- :func:`inject_grads`: drive gradients through a real backward pass (``(p * g).sum()``, whose
  gradient is ``g`` exactly), so backward hooks fire as they do in training.
- :class:`ReferenceRunner`: the single-process ground truth: the same optimizers on the same
  reduced gradients, matrix parameters to the matrix optimizer, element-wise ones to the
  element-wise optimizer, optional fp32 masters for low-precision models.
- :func:`held_snapshot` / :func:`load_refused`: what a rank holds of an optimizer (masters, state,
  model pieces), and whether a refused checkpoint load left all of it untouched.
- :func:`attempt` / :func:`case_results`: a worker that runs many cases records each outcome, and
  each test reads its own case (a failure names the case and the rank, not the whole run).
- :func:`file_init_method` / :func:`process_group` (from :mod:`canzona.runtime.launch`): a
  ``file://`` rendezvous in a fresh directory and a bounded, self-destroying process group around it.
- :class:`HostReads`: counts the operations that read tensor values back to the host (``item()``,
  ``bool(t)``, ``nonzero``, ``tolist()``...), each with the line that asked: on CUDA each is a synchronization,
  so a test on CPU can check that a step's count does not grow with the model.
"""

from __future__ import annotations

import collections
import copy
import io
import os
import time
import traceback
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from canzona.runtime.buffer import local_tensor as _local
from canzona.runtime.launch import file_init_method, process_group  # re-exported: the launcher's rendezvous
from canzona.specs import is_matrix_param

__all__ = [
    "HostReads",
    "ReferenceRunner",
    "ToyModel",
    "attempt",
    "case_results",
    "file_init_method",
    "held_snapshot",
    "load_refused",
    "process_group",
    "raised",
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


def held_snapshot(opt: Any) -> dict[str, torch.Tensor]:
    """Copies of every master, optimizer-state tensor and model piece this rank holds of ``opt``
    (either front end: anything implementing :class:`canzona.runtime.checkpoint.Checkpointable`)."""
    out: dict[str, torch.Tensor] = {}
    for i, h in enumerate(opt.held()):
        if h.master is not None:
            out[f"{i}.{h.name}.master"] = h.master.detach().clone()
        for k, v in h.state().items():
            if torch.is_tensor(v):
                out[f"{i}.{h.name}.{k}"] = v.detach().clone()
    for mp in opt.model_pieces():
        out[f"model.{mp.name}"] = mp.local.detach().clone()
    return out


def load_refused(opt: Any, load: Callable[[Any], Any]) -> dict[str, Any]:
    """Run ``load(opt)``, which must raise one ``CheckpointError``: returns its message (``"loaded"``
    when nothing was raised) and whether everything :func:`held_snapshot` sees stayed bit for bit."""
    from canzona.runtime.checkpoint import CheckpointError

    before = held_snapshot(opt)
    try:
        load(opt)
        msg = "loaded"
    except CheckpointError as exc:
        msg = str(exc)
    return {"error": msg, "untouched": tensors_equal(before, held_snapshot(opt)) == []}


class ReferenceRunner:
    """Single-process ground truth: ``matrix_cls`` on matrix parameters, ``elementwise_cls`` on the
    rest (on everything when ``all_elementwise``, as ``zero1`` does), over fp32 (``master_dtype``)
    masters of the model's parameters; values are written back to the model after each step."""

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
        mat, ew = [], []
        for n, p in self.model.named_parameters():
            kind = kinds.get(n) or ("matrix" if is_matrix_param(n, p.shape) else "elementwise")
            (ew if all_elementwise or kind == "elementwise" else mat).append(self.masters[n])
        self.optimizers = []
        if mat:
            self.optimizers.append(matrix_cls(mat, **dict(matrix_kwargs or {})))
        if ew:
            self.optimizers.append(elementwise_cls(ew, **dict(elementwise_kwargs or {})))

    def step(self, grads: Mapping[str, torch.Tensor]) -> None:
        for n, m in self.masters.items():
            m.grad = grads[n].to(self.master_dtype) if n in grads else None
        for opt in self.optimizers:
            opt.step()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                self.masters[n].grad = None
                p.copy_(self.masters[n])

    def params(self) -> dict[str, torch.Tensor]:
        return params_of(self.model)

    def master_values(self) -> dict[str, torch.Tensor]:
        return {n: m.detach().clone() for n, m in self.masters.items()}

    def states(self) -> dict[str, Mapping[str, Any]]:
        """Each parameter's optimizer state (live, not copied), keyed by name; parameters no
        optimizer has stepped yet are absent."""
        out: dict[str, Mapping[str, Any]] = {}
        for n, m in self.masters.items():
            for opt in self.optimizers:
                if m in opt.state:
                    out[n] = opt.state[m]
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


# ----------------------------------------------------------------------------- harness
def attempt(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """Run one case inside a worker and record its outcome instead of letting it end the run:
    ``{"result": value}`` or ``{"error": "<type>: <message>\\n<traceback>"}``. A worker that runs
    many cases wraps each, so one broken case fails its own test (:func:`case_results`). A case
    that raises on one rank can leave its peers waiting in a collective until the group's timeout;
    the cases after it then fail on their own too, each naming itself."""
    try:
        return {"result": fn(*args)}
    except Exception as exc:  # noqa: BLE001 - recorded and re-raised in the parent as a test failure
        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}


def raised(fn: Callable[[], Any]) -> tuple[str, str, float] | None:
    """Call ``fn()`` expecting an error: ``(type name, message, seconds until it was raised)``, or
    None when nothing was raised (so a test can check which error, its wording, and that no rank
    hung waiting for it)."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the caller inspects whatever was raised
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


def case_results(per_rank: Sequence[Mapping[str, Any]], section: str, key: object = None) -> list[Any]:
    """Every rank's result of case ``key`` in ``section`` of a multi-case run (each rank returned
    ``{section: {key: attempt(...)}}``); AssertionError naming the case and the first failing rank
    with its traceback when the case raised there."""
    out = []
    for rank, res in enumerate(per_rank):
        outcome = res[section][key]
        if "error" in outcome:
            name = section if key is None else f"{section}[{key!r}]"
            raise AssertionError(f"case {name} failed on rank {rank}: {outcome['error']}")
        out.append(outcome["result"])
    return out


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep  # frames from here are torch's, not the caller's


class HostReads:
    """Context manager counting, on this thread, the tensor operations whose result the host must
    read: ``aten._local_scalar_dense`` (``item()``, ``bool(t)``, ``int(t)``, ``float(t)``),
    ``nonzero``, ``equal``, ``is_nonzero`` and ``masked_select`` (their output size depends on
    the values). On CUDA each of them waits for the device (a host synchronization), so counting
    them in a CPU run shows where a GPU step would stall, and a test can check that a step's count
    does not grow with the number of parameters, buckets or micro-groups.

    ``Tensor.tolist()``, ``.cpu()`` and ``.numpy()`` dispatch no operation on a CPU tensor (on a
    CUDA tensor each copies to the host), so while the block runs those methods are wrapped and
    counted too (this patches ``torch.Tensor`` for every thread of the process: a test helper).

    ``where`` counts each read by the innermost frame outside torch (``file:function:line``), so a
    failing check names the line that added a read. Not seen: ``.to("cpu")`` of a CPU tensor (a
    no-op that dispatches nothing) and reads inside gloo's threads. A read of a tensor that stays
    on the CPU in a GPU run (the status exchange's vector, ``torch.optim.AdamW``'s step counter) is
    counted too: it costs no synchronization there.
    """

    OPS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default",
                     "aten.is_nonzero.default", "aten.masked_select.default"})
    #: tensor methods counted as reads by a patch while the block runs (they dispatch nothing on a
    #: CPU tensor; on a CUDA tensor each copies to the host)
    METHODS = ("tolist", "cpu", "numpy")

    def __init__(self) -> None:
        #: reads per operation name
        self.ops: collections.Counter[str] = collections.Counter()
        #: reads per asking line (``file:function:line``, the innermost frame outside torch)
        self.where: collections.Counter[str] = collections.Counter()
        self._mode: Any = None
        self._patched: dict[str, Any] = {}  # method name -> the original, while the block runs

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __enter__(self) -> "HostReads":
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
                name = str(func)
                if name in HostReads.OPS:
                    reads._count(name)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        # reads that dispatch no operation on a CPU tensor (on a CUDA tensor each copies to the host)
        for method in HostReads.METHODS:
            real = getattr(torch.Tensor, method)
            self._patched[method] = real

            def counted(t: torch.Tensor, *a: Any, _real: Any = real, _name: str = f"Tensor.{method}", **k: Any) -> Any:
                reads._count(_name)
                return _real(t, *a, **k)

            setattr(torch.Tensor, method, counted)
        return self

    def _count(self, name: str) -> None:
        self.ops[name] += 1
        frame = next((f for f in reversed(traceback.extract_stack()[:-2])
                      if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__), None)
        self.where[f"{os.path.basename(frame.filename)}:{frame.name}:{frame.lineno}" if frame else "?"] += 1

    def __exit__(self, *exc: Any) -> None:
        for method, real in self._patched.items():
            setattr(torch.Tensor, method, real)
        self._patched = {}
        self._mode.__exit__(*exc)
        self._mode = None
