"""The validation matrix: which cells exist, which ``--quick`` and ``--full`` run, and input checks.

A *cell* is one (check, model, optimizer, strategy, mesh, dtype) combination run for a fixed
number of steps:

- ``check``: ``injected`` (gradients that reduce exactly in any order; parameters, fp32 masters
  and optimizer states must equal the single-device optimizer's bit for bit) or ``training``
  (real forward/backward on the tiny Qwen3, judged per tensor against a single-process oracle,
  every replica on every rank bitwise, and each strategy against ``sc``).
- ``model``: ``awkward`` (:mod:`validation.models`: odd sizes, a 1 x n matrix, tall and wide
  matrices, a matrix larger than a whole rank's share, a 3-D element-wise tensor, tied
  embeddings), ``qwen3`` (``canzona/data/models/qwen3-tiny.json``), ``qwen3-moe``
  (``canzona/data/models/qwen3-moe-tiny.json``: stacked experts, each expert's update and state
  checked on its own; DP meshes only, injected check only, fp32) or ``fsdp-toy``
  (:class:`validation.fsdp_harness.FSDPToy`: odd shapes FSDP2 pads, uneven TP chunks, a 1 x n
  matrix, a tied embedding; the one model of the FSDP2 meshes, injected check only) or
  ``fsdp-moe`` (:class:`validation.fsdp_harness.FSDPMoEToy`: non-square expert stacks kept whole
  per rank by ``Shard(0)``, uneven counts; ``fsdp2`` and ``fsdp4``, fp32, ``sc`` and ``lb-asc``).
- ``optimizer``: ``muon``, ``shampoo``, ``soap`` (matrix parameters; AdamW on element-wise ones),
  ``adamw`` (AdamW on everything), or the user's optimizer as an import path ``pkg.mod:Name``
  (:mod:`validation.targets`); the user's model likewise (ZeRO-1 meshes only).
- ``strategy``: the DP strategies ``sc``, ``layerwise``, ``asc``, ``lb-asc`` with their default TP
  schedules (``sync``, ``sync``, ``round-robin``, ``lpt``), ``no-fuse`` (``lb-asc`` with the
  ``no-fuse`` TP schedule, Section 4's fusion ablation; only on meshes with TP, since without TP
  it *is* ``lb-asc``), ``zero1`` (equal chunks: AdamW only, the paper's ZeRO-1 reference) and
  ``lb-asc-joint`` (canzona's planner beyond the paper, FLOPs and memory balanced together).
  ``zero1`` and ``lb-asc-joint`` run in ``--full`` or when asked for by name. FSDP2 meshes run
  the FSDP2 planner's ``sc``, ``asc``, ``lb-asc`` and ``no-fuse`` (one micro-group per matrix).
- ``mesh``: ZeRO-1 meshes ``dp<N>``, ``tp<M>`` or ``dp<N>xtp<M>`` (standard: ``dp2``, ``tp2``,
  ``dp2xtp2``, ``dp4``) and the FSDP2 (``fully_shard``) meshes ``fsdp2`` (dp_shard 2),
  ``fsdp4`` (dp_shard 4), ``fsdp2xtp2`` (dp_shard 2 x tp 2) and ``hsdp2x2`` (dp_replicate 2 x
  dp_shard 2), exactly these four (:data:`validation.fsdp_harness.FSDP_MESHES`).
- ``dtype``: ``float32``, ``bfloat16`` (bf16 model parameters, fp32 masters) or ``bf16-mixed``
  (FSDP2 meshes only: fp32 sharded parameters, FSDP2's ``MixedPrecisionPolicy`` computing in bf16
  and reducing gradients in fp32).

This module is pure: no torch.distributed, no processes. Bad names raise :class:`ValueError`
with one readable line (the CLI turns it into exit code 2).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from canzona.optimizers import get_optimizer, optimizer_names
from canzona.plan.strategies import FSDP_STRATEGIES
from canzona.plan.strategies import get_strategy

__all__ = [
    "CHECKS",
    "MODELS",
    "OPTIMIZERS",
    "STRATEGIES",
    "DTYPES",
    "STANDARD_MESHES",
    "FSDP_MESH_NAMES",
    "DEFAULT_MESHES",
    "MAX_TP",
    "MeshSpec",
    "Cell",
    "Selection",
    "parse_mesh",
    "strategy_args",
    "parse_names",
    "build_matrix",
    "group_by_mesh",
    "process_groups",
    "default_max_procs",
]

CHECKS: tuple[str, ...] = ("injected", "training")
MODELS: tuple[str, ...] = ("awkward", "qwen3", "qwen3-moe", "fsdp-toy", "fsdp-moe")
OPTIMIZERS: tuple[str, ...] = optimizer_names()
STRATEGIES: tuple[str, ...] = ("sc", "layerwise", "asc", "lb-asc", "no-fuse", "zero1", "lb-asc-joint")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "bf16-mixed")
STANDARD_MESHES: tuple[str, ...] = ("dp2", "tp2", "dp2xtp2", "dp4")
#: FSDP2 mesh name -> (key of :data:`validation.fsdp_harness.FSDP_MESHES`, DP size, TP size); the DP
#: size counts every data-parallel rank (dp_replicate x dp_shard)
_FSDP_LAYOUTS: dict[str, tuple[str, int, int]] = {
    "fsdp2": ("dp_shard2", 2, 1),
    "fsdp4": ("dp_shard4", 4, 1),
    "fsdp2xtp2": ("dp_shard2_tp2", 2, 2),
    "hsdp2x2": ("dp_replicate2_dp_shard2", 4, 1),
}
FSDP_MESH_NAMES: tuple[str, ...] = tuple(_FSDP_LAYOUTS)
#: the meshes a selection without ``--mesh`` runs
DEFAULT_MESHES: tuple[str, ...] = STANDARD_MESHES + FSDP_MESH_NAMES
#: the model the FSDP2 meshes run (and that runs only there)
FSDP_MODEL = "fsdp-toy"
#: the FSDP2 meshes' mixture-of-experts model (``--full``): fp32, on the 1-D FSDP2 meshes, the
#: baseline and Canzona
FSDP_MOE_MODEL = "fsdp-moe"
_FSDP_MOE_MESHES: tuple[str, ...] = ("fsdp2", "fsdp4")
#: the mixture-of-experts model of the ZeRO-1 meshes: DP only, injected check only, fp32, and
#: the strategies that place experts differently (sc: every rank; asc / lb-asc: stacks cut
#: between experts; zero1: AdamW over element ranges)
MOE_MODEL = "qwen3-moe"
_MOE_STRATEGIES: tuple[str, ...] = ("sc", "asc", "lb-asc", "zero1")
#: dtypes that exist only on FSDP2 meshes
_FSDP_ONLY_DTYPES: tuple[str, ...] = ("bf16-mixed",)
#: The tiny Qwen3 has 2 key/value heads and the awkward model's TP dims are even, so TP is at most 2.
MAX_TP = 2

_MESH_RE = re.compile(r"^(?:dp(\d+))?(?:x?tp(\d+))?$")


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """A DP x TP process mesh; ``world = dp * tp`` processes, ranks laid out row-major (dp, tp).
    ``fsdp``: for an FSDP2 mesh, its key in :data:`validation.fsdp_harness.FSDP_MESHES` (None: a
    ZeRO-1 mesh of canzona's own)."""

    name: str
    dp: int
    tp: int
    fsdp: str | None = None

    @property
    def world(self) -> int:
        return self.dp * self.tp


def parse_mesh(name: str) -> MeshSpec:
    """``dp2`` -> (2, 1), ``tp2`` -> (1, 2), ``dp2xtp2`` -> (2, 2). DP sizes must be powers of two
    (the injected check divides exact integer sums by the DP size, exact only for powers of two).
    FSDP2 meshes are exactly :data:`FSDP_MESH_NAMES` (case-insensitive)."""
    text = str(name).strip().lower()
    if text.startswith(("fsdp", "hsdp")):
        if text not in _FSDP_LAYOUTS:
            raise ValueError(f"unknown FSDP2 mesh {name!r}; the FSDP2 meshes are {', '.join(FSDP_MESH_NAMES)}")
        key, dp, tp = _FSDP_LAYOUTS[text]
        return MeshSpec(text, dp, tp, key)
    m = _MESH_RE.match(text)
    if not text or m is None or (m.group(1) is None and m.group(2) is None):
        raise ValueError(
            f"unknown mesh {name!r}; use dp<N>, tp<M> or dp<N>xtp<M> (standard: {', '.join(STANDARD_MESHES)}) "
            f"or an FSDP2 mesh ({', '.join(FSDP_MESH_NAMES)})"
        )
    dp = int(m.group(1)) if m.group(1) else 1
    tp = int(m.group(2)) if m.group(2) else 1
    if dp < 1 or dp & (dp - 1):
        raise ValueError(f"mesh {name!r}: the DP size must be a power of two (the mean of exact gradients is exact only then), got {dp}")
    if not 1 <= tp <= MAX_TP:
        raise ValueError(f"mesh {name!r}: TP size must be 1..{MAX_TP} (the tiny Qwen3 has 2 key/value heads), got {tp}")
    if dp * tp < 2:
        raise ValueError(f"mesh {name!r} has one process; the suite validates distributed runs (at least 2 processes)")
    canonical = "x".join(p for p in (f"dp{dp}" if dp > 1 else "", f"tp{tp}" if tp > 1 else "") if p)
    return MeshSpec(canonical, dp, tp)


def strategy_args(strategy: str) -> tuple[str, str | None]:
    """(DP strategy for ``DistributedOptimizer``, TP schedule or None for the strategy's default)."""
    if strategy == "no-fuse":
        return "lb-asc", "no-fuse"
    return strategy, None


@dataclass(frozen=True, slots=True)
class Cell:
    """One validation cell; ``name`` is the row key of the report (``check/model/optimizer/strategy/mesh/dtype``)."""

    check: str
    model: str
    optimizer: str
    strategy: str
    mesh: str
    dtype: str
    steps: int

    @property
    def name(self) -> str:
        return f"{self.check}/{self.model}/{self.optimizer}/{self.strategy}/{self.mesh}/{self.dtype}"

    @property
    def mesh_spec(self) -> MeshSpec:
        return parse_mesh(self.mesh)


def _is_path(name: str) -> bool:
    mod, sep, attr = name.partition(":")
    return bool(sep and mod.strip() and attr.strip())


def parse_names(values: Sequence[str] | str | None, allowed: Sequence[str], what: str, *, paths: bool = False) -> tuple[str, ...] | None:
    """Comma-separated and/or repeated names -> a tuple in the order given, or None when not given.
    Raises ValueError naming the first unknown one and the choices. With ``paths``, an import path
    ``package.module:Name`` is accepted too (kept as written; the user's optimizer or model)."""
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for v in values:
        for part in str(v).split(","):
            name = part.strip().lower()
            if not name:
                continue
            if paths and _is_path(part.strip()):
                name = part.strip()
            elif name not in allowed:
                extra = " or an import path package.module:Name" if paths else ""
                raise ValueError(f"unknown {what} {part.strip()!r}; choose from {', '.join(allowed)}{extra}")
            if name not in out:
                out.append(name)
    if not out:
        raise ValueError(f"empty {what} list; choose from {', '.join(allowed)}")
    return tuple(out)


def default_max_procs() -> int:
    """Processes the suite may start at once: the CPU count, but at least 4 (a dp2 x tp2 mesh on two
    cores is oversubscribed but works; gloo ranks mostly wait on each other)."""
    return max(4, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class Selection:
    """What to run: a level (``quick`` or ``full``) and optional filters (None: the level's choice)."""

    level: str = "quick"
    optimizers: tuple[str, ...] | None = None
    strategies: tuple[str, ...] | None = None
    meshes: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    checks: tuple[str, ...] | None = None
    models: tuple[str, ...] | None = None
    steps: int | None = None
    max_procs: int = field(default_factory=default_max_procs)
    #: keyword arguments for the optimizer (built-in: updates its suite settings) and for the
    #: user's model factory; plain JSON values
    optimizer_kwargs: dict | None = None
    model_kwargs: dict | None = None

    def __post_init__(self) -> None:
        if self.level not in ("quick", "full"):
            raise ValueError(f"level must be 'quick' or 'full', got {self.level!r}")
        if self.steps is not None and (not isinstance(self.steps, int) or isinstance(self.steps, bool) or not 1 <= self.steps <= 100):
            raise ValueError(f"steps must be an integer in 1..100, got {self.steps!r}")
        if not isinstance(self.max_procs, int) or self.max_procs < 1:
            raise ValueError(f"max_procs must be a positive integer, got {self.max_procs!r}")
        for what, allowed, vals in (
            ("optimizer", OPTIMIZERS, self.optimizers),
            ("strategy", STRATEGIES, self.strategies),
            ("dtype", DTYPES, self.dtypes),
            ("check", CHECKS, self.checks),
            ("model", MODELS, self.models),
        ):
            for v in vals or ():
                if what in ("optimizer", "model") and _is_path(v):
                    continue
                if v not in allowed:
                    raise ValueError(f"unknown {what} {v!r}; choose from {', '.join(allowed)}")
        for m in self.meshes or ():
            spec = parse_mesh(m)
            if spec.world > self.max_procs:
                raise ValueError(
                    f"mesh {spec.name} needs {spec.world} processes but at most {self.max_procs} are available "
                    "(--max-procs; default: the CPU count, at least 4)"
                )


# Steps per check: enough for momentum, preconditioner refreshes (SOAP and Shampoo are configured
# to refresh every 2 steps) and Adam's bias correction to matter, few enough for CI.
_STEPS = {("quick", "injected"): 3, ("full", "injected"): 4, ("quick", "training"): 3, ("full", "training"): 5}


def _applies(check: str, model: str, optimizer: str, strategy: str, mesh: MeshSpec, dtype: str) -> bool:
    if mesh.fsdp is not None:
        # validation.fsdp_harness: the FSDP2 toy with injected gradients, the FSDP2 planner's strategies
        if model == FSDP_MOE_MODEL:
            return check == "injected" and mesh.name in _FSDP_MOE_MESHES and dtype == "float32" and strategy in ("sc", "lb-asc")
        return check == "injected" and model == FSDP_MODEL and strategy in FSDP_STRATEGIES
    if model in (FSDP_MODEL, FSDP_MOE_MODEL) or dtype in _FSDP_ONLY_DTYPES:
        return False
    if model == MOE_MODEL and (mesh.tp > 1 or check != "injected" or dtype != "float32" or strategy not in _MOE_STRATEGIES):
        return False
    if strategy == "no-fuse" and mesh.tp == 1:
        return False  # no TP: no micro-groups to fuse or not; identical to lb-asc
    if get_strategy(strategy_args(strategy)[0]).elementwise_only and (_is_path(optimizer) or get_optimizer(optimizer).matrix):
        return False  # the strategy cuts matrices: element-wise optimizers only (a user's optimizer counts as a matrix one)
    if check == "training" and model != "qwen3":
        return False  # only the Qwen3 model has a language-model forward and data
    return True


#: the quick (CI) subset, as data: strategies it leaves out unless named (the full matrix covers
#: them), and the pair it runs with bf16 masters and the Qwen3 model (the baseline and Canzona)
_QUICK_SKIPS: tuple[str, ...] = ("zero1", "lb-asc-joint")
_QUICK_PAIR: tuple[str, ...] = ("sc", "lb-asc")
#: the quick FSDP2 subset (a few seconds: these cells share the ZeRO-1 meshes' process groups):
#: on fsdp2 every optimizer with lb-asc and Muon with every strategy in fp32, Muon lb-asc with bf16
#: parameters and with bf16 mixed precision; on each four-process FSDP2 mesh Muon lb-asc in fp32
_QUICK_FSDP_WIDE = "fsdp2"


def _quick_keep(check: str, model: str, optimizer: str, strategy: str, mesh: MeshSpec, dtype: str) -> bool:
    """The CI subset: every optimizer x strategy x mesh once on the awkward model in fp32 (the bulk
    of the exactness promise), bf16 masters and the Qwen3 model on the two-process meshes, and the
    training check for Muon on every mesh. The user's optimizer (an import path) is kept where
    Muon is, the user's model where the awkward model is."""
    if _is_path(optimizer):
        optimizer = "muon"
    if _is_path(model):
        model = "awkward"
    if strategy in _QUICK_SKIPS:
        return False
    if mesh.fsdp is not None:
        if model == FSDP_MOE_MODEL:
            return False  # --full (the ZeRO-1 MoE cell stands for experts in --quick)
        if mesh.name != _QUICK_FSDP_WIDE:
            return optimizer == "muon" and strategy == "lb-asc" and dtype == "float32"
        if dtype == "float32":
            return optimizer == "muon" or strategy == "lb-asc"
        return optimizer == "muon" and strategy == "lb-asc"
    if check == "training":
        return optimizer == "muon" and dtype == "float32"
    if model == MOE_MODEL:
        # one cell: every expert's update and state against the single-device optimizer
        return mesh.name == "dp2" and optimizer == "muon" and strategy == "lb-asc"
    if model == "awkward":
        if dtype == "float32":
            return True
        return mesh.name in ("dp2", "tp2") and strategy in _QUICK_PAIR
    # qwen3 injected
    return dtype == "float32" and mesh.name in ("dp2xtp2",) and optimizer in ("muon", "soap") and strategy in _QUICK_PAIR


def build_matrix(sel: Selection) -> list[Cell]:
    """The cells ``sel`` selects, grouped by mesh (one process group per mesh) in a stable order.

    Filters intersect with the level's matrix; an explicit filter on a dimension that ``--quick``
    thins out (for example ``--quick --dtype bfloat16``) keeps every cell of that value that the
    full matrix has for the other quick dimensions, so a filter never silently selects nothing.
    """
    meshes = [parse_mesh(m) for m in (sel.meshes or DEFAULT_MESHES)]
    fit = [m for m in meshes if m.world <= sel.max_procs]
    if not fit:
        raise ValueError(f"no selected mesh fits in {sel.max_procs} processes")
    optimizers = sel.optimizers or OPTIMIZERS
    strategies = sel.strategies or STRATEGIES
    dtypes = sel.dtypes or DTYPES
    checks = sel.checks or CHECKS
    models = sel.models or MODELS
    custom = any(_is_path(v) for v in (*optimizers, *models))
    if custom:
        # the user's optimizer or model: --quick keeps its CI subset on the meshes asked for (a
        # project's CI job names meshes and must stay fast); other filters narrow it
        explicit = any(v is not None for v in (sel.strategies, sel.dtypes, sel.checks)) or any(
            not _is_path(v) for v in (*(sel.optimizers or ()), *(sel.models or ()))
        )
    else:
        explicit = any(v is not None for v in (sel.optimizers, sel.strategies, sel.dtypes, sel.checks, sel.models, sel.meshes))
    cells: list[Cell] = []
    for mesh in fit:
        for check in checks:
            for model in models:
                for optimizer in optimizers:
                    for strategy in strategies:
                        for dtype in dtypes:
                            if not _applies(check, model, optimizer, strategy, mesh, dtype):
                                continue
                            if sel.level == "quick" and not explicit and not _quick_keep(check, model, optimizer, strategy, mesh, dtype):
                                continue
                            if sel.level == "quick" and explicit and strategy in _QUICK_SKIPS and sel.strategies is None:
                                continue
                            steps = sel.steps or _STEPS[(sel.level, check)]
                            cells.append(Cell(check, model, optimizer, strategy, mesh.name, dtype, steps))
    if not cells:
        raise ValueError(
            "the filters select no cell (for example no-fuse needs a mesh with TP, zero1 needs --optimizer adamw, "
            "FSDP2 meshes run only the fsdp-toy and fsdp-moe models with the injected check, qwen3-moe runs on DP meshes in float32 "
            f"with {', '.join(_MOE_STRATEGIES)})"
        )
    return cells


def group_by_mesh(cells: Iterable[Cell]) -> dict[str, list[Cell]]:
    """Cells per mesh name, keeping order."""
    out: dict[str, list[Cell]] = {}
    for c in cells:
        out.setdefault(c.mesh, []).append(c)
    return out


def process_groups(meshes: Iterable[str]) -> list[list[str]]:
    """Which meshes share one spawned process group, in run order: every ZeRO-1 mesh gets its own;
    an FSDP2 mesh joins the first group with the same number of processes (after that group's
    meshes: spawning the processes and importing FSDP2 cost far more than its cells), else opens
    a group of its own."""
    specs = [parse_mesh(m) for m in meshes]
    groups: list[list[MeshSpec]] = [[s] for s in specs if s.fsdp is None]
    for s in specs:
        if s.fsdp is None:
            continue
        host = next((g for g in groups if g[0].world == s.world), None)
        if host is None:
            groups.append([s])
        else:
            host.append(s)
    return [[s.name for s in g] for g in groups]
