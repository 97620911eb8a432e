"""Parameter specs: the plain-data view of a model that every planner works on.

A :class:`ParamSpec` says what the planner needs to know about one parameter and nothing more:
its name, global shape, tensor-parallel split dimension and size, and its *role*: the matrix
optimizer updates it whole (``matrix``: atomic), it is a stack of ``E`` independent expert
matrices (``experts``: shape ``(E, M, N)``, ``E`` matrix tasks of shape ``(M, N)``), or an
element-wise optimizer updates it (``elementwise``: divisible anywhere, as ZeRO-1 assumes).

Roles are data the user can see and change: :func:`module_roles` applies the default rule
(:func:`default_role`: by module type and shape, not only by name) and the user's ``roles=``
(a callable or a mapping of glob patterns), and :func:`role_table` prints what was decided. Specs come from a model config (:func:`specs_from_config`,
for the Megatron or the Hugging Face layout) or from a live ``nn.Module``
(:func:`specs_from_module`, also on the meta device and with DTensor parameters).

Specs are listed in *registration order* (the order ``named_parameters`` yields them); the
ZeRO-1 buffer reverses it (see ``canzona.plan.buckets``).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from canzona.config import ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "Kind",
    "KINDS",
    "Layout",
    "Roles",
    "RoleError",
    "check_transposed_support",
    "default_role",
    "expert_task_name",
    "split_task_name",
    "module_roles",
    "ParamSpec",
    "LAYOUTS",
    "EXPERT_LAYOUTS",
    "MATRIX_EXCLUDE_PATTERNS",
    "is_matrix_param",
    "specs_from_config",
    "specs_from_module",
    "total_numel",
]

Kind = Literal["matrix", "elementwise", "experts"]
KINDS: tuple[str, ...] = ("matrix", "elementwise", "experts")
#: what ``roles=`` accepts: a callable ``(name, param) -> role`` (None: the default rule) or a
#: mapping of glob patterns (``fnmatch``, matched against the full parameter name) to roles, the
#: first matching pattern winning
Roles = Callable[[str, "torch.Tensor"], "str | None"] | Mapping[str, str]
Layout = Literal["megatron", "hf"]
LAYOUTS: tuple[str, ...] = ("megatron", "hf")
#: how :func:`specs_from_config` lays out a MoE layer's experts
#: (``stacked``: ``(E, M, N)`` stacks replicated over TP; ``stacked-tp``: the same stacks split over
#: TP as Megatron-Core's expert tensor parallelism does, each expert a TP task; ``separate``: 2-D matrices)
EXPERT_LAYOUTS: tuple[str, ...] = ("stacked", "separate", "stacked-tp")

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: Name fragments (case-insensitive) of 2-D weights that stay with the element-wise optimizer, as in
#: the reference implementation: token embeddings, output heads and MoE routers are lookup tables or
#: classifiers, not linear maps between hidden states. A weight whose module is named ``gate``
#: (``*.gate.weight``: the router of Qwen3-MoE and Mixtral) is a router too.
MATRIX_EXCLUDE_PATTERNS: tuple[str, ...] = ("embed", "lm_head", "output_layer", "router")


def is_matrix_param(name: str, shape: Iterable[int]) -> bool:
    """True when the matrix optimizer owns this parameter: 2-D weights except token embeddings,
    output heads, MoE routers, 1 x N / N x 1 matrices (gates such as Qwen2-MoE's
    ``shared_expert_gate``) and 2-D biases (``bias`` or ``*_bias``: gpt-oss keeps its experts'
    biases as ``(E, N)`` stacks of vectors). Everything else (norms, biases, those) is element-wise. The name part
    of the rule; :func:`default_role` adds what only the module knows (embeddings by type, tied
    weights, expert stacks, GPT-2's ``Conv1D``).
    Pure function of name and shape, shared by the planner and :mod:`canzona.optim`."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    dims = tuple(shape)
    if len(dims) != 2 or 1 in dims:  # 1 x N and N x 1: gates and scalings, not linear maps
        return False
    lowered = name.lower()
    if any(pattern in lowered for pattern in MATRIX_EXCLUDE_PATTERNS):
        return False
    parts = lowered.split(".")
    if parts[-1] == "bias" or parts[-1].endswith("_bias"):  # a stack of bias vectors (gpt-oss's experts' (E, N) biases)
        return False
    return not (len(parts) >= 2 and parts[-2] == "gate" and parts[-1] == "weight")


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter as the planner sees it.

    ``shape`` is the global (unsplit) shape; ``tp_dim`` the dimension split across ``tp`` tensor-
    parallel ranks (None: replicated on every TP rank). ``kind`` is ``matrix`` (atomic for the
    matrix optimizer), ``experts`` (an ``(E, M, N)`` stack: ``E`` independent ``(M, N)`` matrix
    tasks; split over TP on its rows, ``tp_dim=1``, or columns, ``tp_dim=2``, each expert is a TP
    task; ``tp_dim=0`` is refused: whole experts per rank is expert parallelism) or
    ``elementwise``. A ``matrix`` of more than two dimensions (a conv weight the user
    opted in) is updated as the ``(shape[0], prod(shape[1:]))`` matrix it reshapes to.
    ``transposed``: the weight is stored ``(in, out)`` (GPT-2's ``Conv1D``), so the matrix the
    optimizer must see, and whose shape scales its learning rate, is the transpose.
    ``tp_blocks``: the split dim packs that many equal blocks (transformers' ``packed_colwise``
    ``[gate; up]``, a ``_StridedShard``), each split over TP on its own, so a rank holds its slice
    of every block; only for the rows of a TP-split expert stack (``tp_dim=1``).
    """

    name: str
    shape: tuple[int, ...]
    kind: Kind
    tp_dim: int | None = None
    tp: int = 1
    transposed: bool = False
    tp_blocks: int = 1

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a parameter needs a name")
        if not self.shape or any((not isinstance(d, int)) or d < 1 for d in self.shape):
            raise ValueError(f"{self.name}: shape must be a tuple of positive ints, got {self.shape!r}")
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "matrix" and len(self.shape) < 2:
            raise ValueError(f"{self.name}: a matrix parameter needs at least 2 dimensions, got shape {self.shape}")
        if self.kind == "experts" and len(self.shape) != 3:
            raise ValueError(f"{self.name}: an expert stack must be 3-D (experts, rows, cols), got shape {self.shape}")
        if self.tp < 1:
            raise ValueError(f"{self.name}: tp must be >= 1, got {self.tp}")
        if not isinstance(self.tp_blocks, int) or self.tp_blocks < 1 or (self.tp_blocks > 1 and self.tp_dim is None):
            raise ValueError(f"{self.name}: tp_blocks must be a positive int, and above 1 only for a TP-split parameter")
        if self.transposed and (self.kind != "matrix" or len(self.shape) != 2):
            raise ValueError(f"{self.name}: only a 2-D matrix parameter can be stored transposed")
        if self.tp_dim is not None:
            if not 0 <= self.tp_dim < len(self.shape):
                raise ValueError(f"{self.name}: tp_dim {self.tp_dim} out of range for shape {self.shape}")
            if self.shape[self.tp_dim] % self.tp:
                raise ValueError(
                    f"{self.name}: dimension {self.tp_dim} of shape {self.shape} does not divide by tp={self.tp}"
                )
            if self.tp > 1 and self.kind == "experts" and self.tp_dim == 0:
                raise ValueError(
                    f"{self.name}: an expert stack split over TP on its expert dim (dim 0) holds whole experts per rank, which "
                    "is expert parallelism, not a TP split; shard the rows (dim 1) or columns (dim 2) over tp, or use an ep mesh dimension"
                )
            if self.tp_blocks != 1 and (self.shape[self.tp_dim] % (self.tp * self.tp_blocks)
                                        or not (self.kind == "elementwise" or (self.kind == "experts" and self.tp_dim in (1, 2)))):
                raise ValueError(
                    f"{self.name}: {self.tp_blocks} packed blocks split over tp={self.tp} are supported on the rows (dim 1) or columns "
                    f"(dim 2) of an expert stack, or on any dim of an element-wise parameter, whose split dim divides by {self.tp * self.tp_blocks}; "
                    f"got a {self.kind} of shape {self.shape} split on dim {self.tp_dim}"
                )
            if self.tp > 1 and (self.transposed or (self.kind == "matrix" and len(self.shape) > 2)):
                raise ValueError(
                    f"{self.name}: a tensor-parallel split of a {'stored-transposed ' if self.transposed else ''}"
                    f"{len(self.shape)}-D {self.kind} parameter is not supported; mark it 'elementwise' with roles= "
                    "or keep it replicated over TP"
                )

    @property
    def n_tasks(self) -> int:
        """Matrix tasks this parameter is for the matrix optimizer: ``E`` for an expert stack, 1 for a
        matrix, 0 for an element-wise parameter."""
        if self.kind == "experts":
            return self.shape[0]
        return 1 if self.kind == "matrix" else 0

    @property
    def task_shape(self) -> tuple[int, ...]:
        """The shape the matrix optimizer sees for one task (the logical ``(out, in)`` matrix); the
        stored shape for an element-wise parameter."""
        if self.kind == "experts":
            return self.shape[1:]
        if self.kind == "matrix":
            if self.transposed:
                return (self.shape[1], self.shape[0])
            return (self.shape[0], math.prod(self.shape[1:]))
        return self.shape

    @property
    def task_tp_dim(self) -> int | None:
        """The split dim of one task's matrix (an expert's ``(M, N)``: the stack's split dim less one)."""
        if not self.tp_split:
            return None
        return self.tp_dim - 1 if self.kind == "experts" else self.tp_dim  # type: ignore[operator]

    @property
    def local_task_shape(self) -> tuple[int, ...]:
        """One task's shard on one TP rank: an expert's ``(M, N)`` TP shard, or the local shape."""
        return self.local_shape[1:] if self.kind == "experts" else self.local_shape

    @property
    def tp_split(self) -> bool:
        """True when the parameter is actually split (a split dim and more than one TP rank)."""
        return self.tp_dim is not None and self.tp > 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of one TP rank's shard (the piece that lives in that rank's ZeRO-1 buffer)."""
        if not self.tp_split:
            return self.shape
        s = list(self.shape)
        s[self.tp_dim] //= self.tp  # type: ignore[index]
        return tuple(s)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_numel(self) -> int:
        # same value as prod(local_shape) (the split dim divides by tp, checked above) without
        # building the shape tuple: Plan.validate asks for it several times per parameter
        n = math.prod(self.shape)
        return n // self.tp if self.tp_dim is not None and self.tp > 1 else n

    @property
    def layer(self) -> int | None:
        """Transformer layer index parsed from the name (``...layers.<i>....``), None outside layers."""
        m = _LAYER_RE.search(self.name)
        return int(m.group(1)) if m else None


_TASK_RE = re.compile(r"^(.+)\[(\d+)\]$")


def expert_task_name(name: str, expert: int) -> str:
    """The task name of expert ``expert`` of stack ``name`` (``name[expert]``): how micro-groups and
    the TP engine name one expert of a TP-split stack (a parameter name never holds brackets)."""
    return f"{name}[{expert}]"


def split_task_name(task: str) -> tuple[str, int | None]:
    """``(parameter name, expert index or None)`` of a task name (inverse of :func:`expert_task_name`)."""
    m = _TASK_RE.match(task)
    return (m.group(1), int(m.group(2))) if m else (task, None)


class RoleError(ValueError):
    """A parameter's role cannot be decided or is not valid for it (one line naming the parameter
    and what to pass in ``roles=``)."""


def _is_conv1d(module: object) -> bool:
    """GPT-2's ``transformers.pytorch_utils.Conv1D`` (weight stored ``(in, out)``), recognised by its
    class name or its ``nf`` attribute without importing transformers."""
    return type(module).__name__ == "Conv1D" or (isinstance(getattr(module, "nf", None), int) and hasattr(module, "weight"))


def default_role(name: str, param: torch.Tensor, owner: object, *, embedding: bool = False) -> tuple[str, bool]:
    """The default ``(role, transposed)`` of parameter ``name`` held by module ``owner``.

    * ``embedding`` (the parameter belongs to an ``nn.Embedding``, or is the same tensor as one's
      weight, as a tied output head is): element-wise;
    * 3-D under a module path with a component ``experts`` or ``*_experts`` (torchtitan's
      ``moe.routed_experts.inner_experts``): an expert stack (``experts``);
    * 2-D: :func:`is_matrix_param`, on the logical ``(out, in)`` shape for GPT-2's ``Conv1D``
      (``transposed``); 0-D and 1-D: element-wise;
    * any other rank (3-D elsewhere, 4-D conv weights): refused with a :class:`RoleError` naming
      the opt-in, so that no such parameter reaches the element-wise optimizer silently.
    """
    shape = tuple(param.shape)
    if embedding:
        return "elementwise", False
    if len(shape) == 3 and any(c == "experts" or c.endswith("_experts") for c in name.lower().split(".")[:-1]):
        return "experts", False
    if len(shape) > 2:
        what = "a conv weight" if len(shape) == 4 else f"a {len(shape)}-D parameter"
        raise RoleError(
            f"{name}: {what} of shape {shape} has no default role; pass roles={{{name!r}: 'matrix'}} to update it as the "
            f"({shape[0]}, {math.prod(shape[1:])}) matrix it reshapes to (as the Muon authors do), 'experts' for a stack of "
            "3-D expert matrices, or 'elementwise' for the element-wise optimizer"
        )
    transposed = len(shape) == 2 and _is_conv1d(owner)
    logical = shape[::-1] if transposed else shape
    return ("matrix", transposed) if is_matrix_param(name, logical) else ("elementwise", False)


def _user_role(roles: Roles | None, name: str, param: torch.Tensor) -> str | None:
    if roles is None:
        return None
    if callable(roles):
        got = roles(name, param)
    elif isinstance(roles, Mapping):
        got = next((r for pat, r in roles.items() if fnmatch.fnmatchcase(name, pat)), None)
    else:
        raise TypeError(f"roles must be a callable (name, param) -> role or a mapping of glob patterns to roles, got {type(roles).__name__}")
    if got is not None and got not in KINDS:
        raise RoleError(f"{name}: roles gave {got!r}; a role is one of {', '.join(KINDS)} (or None for the default rule)")
    return got


def module_roles(module: torch.nn.Module, roles: Roles | None = None) -> dict[str, tuple[str, bool]]:
    """``name -> (role, transposed)`` for every parameter of ``module`` (tied ones once, under the
    name ``named_parameters`` gives them): the user's ``roles`` first, :func:`default_role` where
    they give None. Embeddings are found by module type (``nn.Embedding``) and tied weights by
    tensor identity, not by name. Raises :class:`RoleError` (one line) for a role that cannot
    apply (``experts`` on a tensor that is not 3-D, ``matrix`` on a vector)."""
    from torch import nn

    embedding_ids = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding) and m.weight is not None}
    if isinstance(roles, Mapping):
        for pat, r in roles.items():
            if not isinstance(pat, str):
                raise TypeError(f"roles patterns must be strings, got {pat!r}")
    out: dict[str, tuple[str, bool]] = {}
    for name, p in module.named_parameters():
        prefix = name.rpartition(".")[0]
        owner = module.get_submodule(prefix) if prefix else module
        user = _user_role(roles, name, p)
        if user is None:
            out[name] = default_role(name, p, owner, embedding=id(p) in embedding_ids)
            continue
        ndim = p.dim()
        if user == "experts" and ndim != 3:
            raise RoleError(f"{name}: 'experts' needs a 3-D (experts, rows, cols) stack, got shape {tuple(p.shape)}")
        if user == "matrix" and ndim < 2:
            raise RoleError(f"{name}: 'matrix' needs at least 2 dimensions, got shape {tuple(p.shape)}")
        out[name] = (user, user == "matrix" and ndim == 2 and _is_conv1d(owner))
    return out


def check_transposed_support(specs: Iterable[ParamSpec], matrix_cls: type, elementwise_only: bool = False) -> None:
    """Refuse (one line) stored-transposed matrices for a matrix optimizer that cannot be told to
    update the transpose: its learning-rate scaling would read the flipped shape. canzona's
    optimizers say they can with a class attribute ``updates_transposed = True``."""
    if elementwise_only or getattr(matrix_cls, "updates_transposed", False):
        return
    flipped = [s.name for s in specs if s.transposed and s.kind == "matrix"]
    if flipped:
        raise RoleError(
            f"{flipped[0]}{f' and {len(flipped) - 1} more' if len(flipped) > 1 else ''}: stored (in, out) (GPT-2's Conv1D), "
            f"and {getattr(matrix_cls, '__name__', matrix_cls)} cannot be told to update the (out, in) transpose; use canzona's "
            "muon, or roles={...: 'elementwise'}"
        )


def _spec(name: str, shape: tuple[int, ...], tp_dim: int | None, tp: int) -> ParamSpec:
    kind: Kind = "matrix" if is_matrix_param(name, shape) else "elementwise"
    return ParamSpec(name=name, shape=shape, kind=kind, tp_dim=tp_dim, tp=tp)


def specs_from_config(cfg: ModelConfig, *, tp: int = 1, layout: str = "megatron", experts: str = "stacked") -> list[ParamSpec]:
    """Parameter specs of a Qwen3 model in registration order.

    ``megatron`` follows Megatron-Core GPT naming: fused ``linear_qkv`` [(q+2kv)*head_dim, hidden]
    and ``linear_fc1`` [2*ffn, hidden] column-parallel (split dim 0), ``linear_proj`` and
    ``linear_fc2`` row-parallel (split dim 1), embedding and output layer vocab-parallel (dim 0).
    ``hf`` follows Hugging Face Qwen3 naming with separate q/k/v/o and gate/up/down projections.
    MoE layers replace the MLP with a router (replicated, element-wise) and ``num_experts``
    experts. ``experts="stacked"`` (default) keeps them as transformers 5.x and
    :class:`canzona.models.Qwen3MoE` do: two ``experts`` stacks per layer, ``E`` matrix tasks
    each, replicated over TP, registered before the router (``hf``: ``mlp.experts.gate_up_proj``
    ``(E, 2F, H)``, ``mlp.experts.down_proj`` ``(E, H, F)``; ``megatron``:
    ``mlp.experts.linear_fc1.weight`` ``(E, 2F, H)``, ``mlp.experts.linear_fc2.weight``
    ``(E, H, F)``). ``experts="stacked-tp"`` splits the same stacks over TP (expert tensor
    parallelism: the up stack on its rows, dim 1, the down stack on its columns, dim 2), which makes
    every expert a TP task with a host (``E`` tasks per stack). ``experts="separate"`` is the older form:
    router first, then every expert as its own dense MLP of 2-D matrices, TP-split like one.
    """
    _check_spec_options(layout, experts, tp)
    build = _megatron_specs if layout == "megatron" else _hf_specs
    return build(cfg, tp=tp, experts=experts)


def _check_spec_options(layout: str, experts: str, tp: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown experts layout {experts!r}; choose one of {', '.join(EXPERT_LAYOUTS)}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")


def _mlp_specs(prefix: str, ffn: int, *, h: int, tp: int, layout: str) -> list[ParamSpec]:
    """A dense MLP of hidden ``h`` and width ``ffn``: up projections column-, down row-parallel."""
    if layout == "megatron":
        return [_spec(f"{prefix}.linear_fc1.weight", (2 * ffn, h), 0, tp), _spec(f"{prefix}.linear_fc2.weight", (h, ffn), 1, tp)]
    return [
        _spec(f"{prefix}.gate_proj.weight", (ffn, h), 0, tp),
        _spec(f"{prefix}.up_proj.weight", (ffn, h), 0, tp),
        _spec(f"{prefix}.down_proj.weight", (h, ffn), 1, tp),
    ]


def _expert_stack_specs(cfg: ModelConfig, prefix: str, *, tp: int, layout: str, experts: str) -> list[ParamSpec]:
    """The up and down ``experts`` stacks of one MoE layer, replicated or (``stacked-tp``) TP-split."""
    assert cfg.moe is not None
    h = cfg.hidden_size
    e, f = cfg.moe.num_experts, cfg.moe.moe_intermediate_size
    up, down = ("linear_fc1.weight", "linear_fc2.weight") if layout == "megatron" else ("gate_up_proj", "down_proj")
    split = experts == "stacked-tp"  # column-parallel up (rows, dim 1), row-parallel down (columns, dim 2)
    return [
        ParamSpec(name=f"{prefix}.experts.{up}", shape=(e, 2 * f, h), kind="experts", tp_dim=1 if split else None, tp=tp),
        ParamSpec(name=f"{prefix}.experts.{down}", shape=(e, h, f), kind="experts", tp_dim=2 if split else None, tp=tp),
    ]


def _moe_specs(cfg: ModelConfig, prefix: str, router: str, expert_prefix: str, *, tp: int, layout: str,
               experts: str) -> list[ParamSpec]:
    """One MoE layer's MLP: the expert stacks then the router, or (``separate``) the router then one MLP per expert."""
    assert cfg.moe is not None
    h = cfg.hidden_size
    if experts != "separate":
        out = _expert_stack_specs(cfg, prefix, tp=tp, layout=layout, experts=experts)
        out.append(_spec(f"{prefix}.{router}", (cfg.moe.num_experts, h), None, tp))
        return out
    out = [_spec(f"{prefix}.{router}", (cfg.moe.num_experts, h), None, tp)]
    for e in range(cfg.moe.num_experts):
        out += _mlp_specs(f"{prefix}.{expert_prefix}.{e}", cfg.moe.moe_intermediate_size, h=h, tp=tp, layout=layout)
    return out


def _megatron_specs(cfg: ModelConfig, *, tp: int, experts: str) -> list[ParamSpec]:
    """Megatron-Core GPT naming and order (see :func:`specs_from_config`)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out: list[ParamSpec] = []

    def add(name: str, shape: tuple[int, ...], tp_dim: int | None) -> None:
        out.append(_spec(name, shape, tp_dim, tp))

    add("embedding.word_embeddings.weight", (cfg.vocab_size, h), 0)
    for i in range(cfg.num_hidden_layers):
        p = f"decoder.layers.{i}"
        add(f"{p}.input_layernorm.weight", (h,), None)
        add(f"{p}.self_attention.linear_qkv.weight", (q + 2 * kv, h), 0)
        add(f"{p}.self_attention.q_layernorm.weight", (hd,), None)
        add(f"{p}.self_attention.k_layernorm.weight", (hd,), None)
        add(f"{p}.self_attention.linear_proj.weight", (h, q), 1)
        add(f"{p}.pre_mlp_layernorm.weight", (h,), None)
        if cfg.moe is None:
            out += _mlp_specs(f"{p}.mlp", cfg.intermediate_size, h=h, tp=tp, layout="megatron")
        else:
            out += _moe_specs(cfg, f"{p}.mlp", "router.weight", "experts.local_experts", tp=tp, layout="megatron", experts=experts)
    add("decoder.final_layernorm.weight", (h,), None)
    if not cfg.tie_word_embeddings:
        add("output_layer.weight", (cfg.vocab_size, h), 0)
    return out


def _hf_specs(cfg: ModelConfig, *, tp: int, experts: str) -> list[ParamSpec]:
    """Hugging Face Qwen3 naming and order (see :func:`specs_from_config`)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out: list[ParamSpec] = []

    def add(name: str, shape: tuple[int, ...], tp_dim: int | None) -> None:
        out.append(_spec(name, shape, tp_dim, tp))

    add("model.embed_tokens.weight", (cfg.vocab_size, h), 0)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        add(f"{p}.self_attn.q_proj.weight", (q, h), 0)
        add(f"{p}.self_attn.k_proj.weight", (kv, h), 0)
        add(f"{p}.self_attn.v_proj.weight", (kv, h), 0)
        add(f"{p}.self_attn.o_proj.weight", (h, q), 1)
        add(f"{p}.self_attn.q_norm.weight", (hd,), None)
        add(f"{p}.self_attn.k_norm.weight", (hd,), None)
        if cfg.moe is None:
            out += _mlp_specs(f"{p}.mlp", cfg.intermediate_size, h=h, tp=tp, layout="hf")
        else:
            out += _moe_specs(cfg, f"{p}.mlp", "gate.weight", "experts", tp=tp, layout="hf", experts=experts)
        add(f"{p}.input_layernorm.weight", (h,), None)
        add(f"{p}.post_attention_layernorm.weight", (h,), None)
    add("model.norm.weight", (h,), None)
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", (cfg.vocab_size, h), 0)
    return out


def specs_from_module(
    module: torch.nn.Module,
    *,
    tp_dims: Mapping[str, int | None] | None = None,
    tp: int = 1,
    kinds: Mapping[str, Kind] | None = None,
    roles: Roles | None = None,
    exclude: Collection[str] = (),
) -> list[ParamSpec]:
    """Parameter specs of a live module (any device, including ``meta``), in registration order.

    DTensor parameters report their global shape; a ``Shard(d)`` placement gives the split dim and
    the mesh size gives ``tp``. Plain-tensor parameters hold a local shard when ``tp_dims`` declares
    a split dim for their name (Megatron style): the global shape is the local shape with that dim
    multiplied by ``tp``. Roles come from :func:`module_roles` (the default rule by module type and
shape, overridden by ``roles``); ``kinds`` overrides them for exactly named parameters.
    Tied parameters appear once (under their first name), as ``named_parameters`` yields them.
    ``exclude``: names left out, unread (the expert stacks an expert-parallel layout reads itself).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp_dims = dict(tp_dims or {})
    kinds = dict(kinds or {})
    names = {n for n, _ in module.named_parameters()}
    for n in list(tp_dims) + list(kinds):
        if n not in names:
            raise ValueError(f"{n!r} is not a parameter of the module")
    decided = module_roles(module, roles)
    out: list[ParamSpec] = []
    for name, p in module.named_parameters():
        if name in exclude:
            continue
        ptp, blocks = tp, 1
        kind, transposed = decided[name]
        if name in kinds:
            kind, transposed = kinds[name], transposed and kinds[name] == "matrix"
        if isinstance(p, DTensor):
            if name in tp_dims:
                raise ValueError(f"{name}: a DTensor carries its own placement; do not declare tp_dims for it")
            strided = [pl for pl in p.placements if type(pl) not in (Shard, Replicate)]
            if strided and len(p.placements) == 1:
                blocks = _packed_blocks(name, p, strided[0], kind)
            shard_axes = [(axis, pl.dim) for axis, pl in enumerate(p.placements) if isinstance(pl, Shard) or (pl in strided and len(p.placements) == 1)]
            if len(shard_axes) > 1:
                raise ValueError(f"{name}: sharded on more than one mesh dimension; only 1-D TP sharding is supported")
            shape = tuple(p.shape)
            tp_dim = shard_axes[0][1] if shard_axes else None
            if shard_axes:
                ptp = p.device_mesh.size(shard_axes[0][0])
        else:
            tp_dim = tp_dims.get(name)
            shape = tuple(p.shape)
            if tp_dim is not None:
                if not 0 <= tp_dim < len(shape):
                    raise ValueError(f"{name}: tp_dim {tp_dim} out of range for shape {shape}")
                s = list(shape)
                s[tp_dim] *= tp
                shape = tuple(s)
        try:
            out.append(ParamSpec(name=name, shape=shape, kind=kind, tp_dim=tp_dim, tp=ptp, transposed=transposed,
                                 tp_blocks=blocks if ptp > 1 else 1))
        except ValueError as exc:
            raise RoleError(str(exc)) from None
    return out


def _packed_blocks(name: str, p: torch.Tensor, placement: object, kind: str) -> int:
    """The packed blocks of a strided TP placement canzona un-packs exactly: the rows (dim 1) or
    columns (dim 2) of an expert stack, ``split_factor`` blocks (transformers' ``packed_colwise``
    ``[gate; up]`` rows, ``packed_rowwise`` ``[gate | up]`` columns of Llama 4's ``(E, H, 2F)``
    stacks), and any strided placement of an element-wise parameter; anything else is refused
    (:func:`_packed_refusal`)."""
    factor = getattr(placement, "split_factor", None)
    dim = getattr(placement, "dim", None)
    if isinstance(factor, int) and factor >= 1 and isinstance(dim, int):
        if kind == "experts" and p.dim() == 3 and dim in (1, 2):  # an expert's rows or columns
            return factor
        if kind == "elementwise":
            return factor  # element-wise updates do not depend on where an entry sits; checkpoints place each block
    raise ValueError(_packed_refusal(name, p, placement))


def _packed_refusal(name: str, p: torch.Tensor, placement: object) -> str:
    """The one line refusing a strided TP placement canzona does not un-pack (:func:`_packed_blocks`
    takes an expert stack's rows or columns and element-wise parameters): joining such shards end to
    end would put the rows of the packed matrix out of order, and neither Newton-Schulz nor Shampoo
    is bitwise invariant to row order, so it is refused rather than updated wrong."""
    head = (
        f"{name}: TP placement {placement!r} (transformers' packed_colwise / packed_rowwise: each rank holds its slice of "
        "every packed block, e.g. half of gate and half of up) is not a plain Shard(d), and joining its shards would "
        "reorder the matrix's rows; "
    )
    if p.dim() == 3:
        module = name.rpartition(".")[0]
        return head + (
            "canzona un-packs it as an expert stack packed on its rows or columns (role 'experts', the default) or as an "
            "element-wise parameter; otherwise keep the "
            f"experts replicated over TP by dropping the entries of {module} and its parameters from the TP plan "
            "(canzona.hf.apply_tp_plan(..., plan=...)), or shard the model with FSDP2"
        )
    return head + "drop its entry from the TP plan (canzona.hf.apply_tp_plan(..., plan=...)) so it stays whole, or shard the model with FSDP2"


def total_numel(specs: Iterable[ParamSpec]) -> int:
    """Global parameter count (tied parameters counted once)."""
    return sum(s.numel for s in specs)
