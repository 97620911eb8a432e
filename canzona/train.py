"""Train the tiny Qwen3 model under ZeRO-1 DP x TP with a Canzona strategy: the library entry point.

:func:`train` runs inside an initialized process group whose world is ``dp * tp`` ranks (or in a
plain single process for ``dp = tp = 1``, where it opens a one-rank gloo group itself). Every rank
builds the model from the same seed, tensor-parallelizes it over the ``tp`` mesh dimension with
DTensor (:func:`canzona.models.parallelize`) or, with ``tp_style="megatron"``, as plain local
shards with declared split dims (:func:`canzona.models.shard_megatron`), wraps it in :class:`canzona.DistributedOptimizer`
(the plan, the ZeRO-1 buffer and the TP micro-group engine of Sections 3 and 4), and trains on
the seeded synthetic Markov data (:mod:`canzona.models.data`) for ``steps`` steps. Rank 0 shows
progress (:class:`Progress`: a legend, then one line per step with the loss and per-phase wall
times; a tqdm bar only when stdout and stderr are both a terminal, so piped output and torchrun
logs stay plain lines) and, with ``log_dir``, writes the run's ``metrics.csv`` and TensorBoard
scalars (:class:`canzona.runs.MetricsLog`); every rank returns a
:class:`TrainResult` (losses, phase times, bytes per phase, a fingerprint of the final parameters).

The command line (``canzona train``, :mod:`canzona.commands.train`) builds a :class:`TrainConfig`
and calls :func:`train_worker` in spawned workers or :func:`train_from_env` under torchrun
(``torchrun --nproc-per-node 4 -m canzona train --dp 2 --tp 2``); this module never imports the
command line. Library callers (demo, profiling, validation) call :func:`train` from a worker.

Before anything is allocated a run that cannot fit is refused with one line saying how much it
needs: :func:`check_memory` (the launcher, before any worker starts) checks the host's available
memory against what the local ranks keep there, and with CUDA :func:`check_gpu_memory` (each
worker, before its mesh and model) checks each rank's GPU against its share
(:func:`memory_estimate`: arithmetic only).

Every strategy reduces the DP ranks' gradients to the same sum and the optimizer steps are
exact, so runs with the same dp x tp and different strategies (sc, layerwise, asc, lb-asc,
lb-asc-joint; any TP schedule; either TP style) end with bitwise equal parameters:
``TrainResult.params_fingerprint`` shows it (``tests/test_train_cli.py``). With dp <= 2 that holds
on any backend (a + b == b + a in IEEE arithmetic); with more DP ranks it holds on gloo, where
every strategy sums in rank order from zero (:mod:`canzona.runtime.comm`; ``canzona validate
--full --mesh dp4`` checks it), and not on NCCL, whose reductions keep their own order.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import canzona.runtime  # noqa: F401  before any process group forms (its docstring says why)
from canzona import phase_names as P
from canzona.optimizers import check_strategy_optimizer, get_optimizer, optimizer_names
from canzona.plan.strategies import strategy_names

if TYPE_CHECKING:
    from canzona.config import ModelConfig

__all__ = [
    "DEFAULT_LR",
    "DEFAULT_ELEMENTWISE_LR",
    "MAX_LR",
    "MemoryEstimate",
    "available_memory_bytes",
    "check_memory",
    "check_gpu_memory",
    "gpu_fit",
    "memory_estimate",
    "OPTIMIZERS",
    "TP_STYLES",
    "TrainConfig",
    "TrainResult",
    "check_model",
    "train",
    "train_worker",
    "params_fingerprint",
    "format_summary",
    "train_from_env",
    "step_legend",
    "Progress",
    "MetricsHook",
]

#: the registered optimizer names (:mod:`canzona.optimizers`)
OPTIMIZERS: tuple[str, ...] = optimizer_names()
#: Matrix-optimizer learning rates that train the tiny model well in a few dozen steps (each
#: registry entry's ``defaults["lr"]``).
DEFAULT_LR: dict[str, float] = {n: float(get_optimizer(n).defaults["lr"]) for n in OPTIMIZERS if "lr" in get_optimizer(n).defaults}
#: AdamW learning rate of the element-wise parameters (embedding, head, norms).
DEFAULT_ELEMENTWISE_LR = 1e-2
#: the largest learning rate a run accepts: far above any schedule's peak, low enough that a typo
#: (1e308) is refused at once instead of overflowing inside an optimizer mid-run
MAX_LR = 1e3
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS: tuple[str, ...] = ("gloo", "nccl")
#: ``dtensor``: PyTorch DTensor TP (placements tell the optimizer the split dims); ``megatron``:
#: plain local shards plus declared ``tp_dims`` (:func:`canzona.models.shard_megatron`).
TP_STYLES: tuple[str, ...] = ("dtensor", "megatron")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """One training run. ``batch_size`` is the *global* batch (split evenly over DP ranks);
    ``lr=None`` picks :data:`DEFAULT_LR` for the optimizer; ``backend=None`` picks NCCL when CUDA
    is available, gloo otherwise; ``bucket_numel=None`` the planner's default; ``tp_style`` picks
    DTensor or Megatron-style plain-tensor TP (both give bitwise identical runs)."""

    model: str = "qwen3-tiny"
    optimizer: str = "muon"
    strategy: str = "lb-asc"
    dp: int = 1
    tp: int = 1
    steps: int = 10
    batch_size: int = 8
    seq_len: int = 64
    lr: float | None = None
    elementwise_lr: float = DEFAULT_ELEMENTWISE_LR
    seed: int = 0
    bucket_numel: int | None = None
    tp_schedule: str | None = None
    cmax: float = 512.0
    dtype: str = "float32"
    backend: str | None = None
    tp_style: str = "dtensor"
    progress: bool = True
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in optimizer_names():
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(optimizer_names())}")
        if self.strategy not in strategy_names():
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(strategy_names())}")
        check_strategy_optimizer(self.strategy, self.optimizer)
        if self.lr is None and "lr" not in get_optimizer(self.optimizer).defaults:
            raise ValueError(f"optimizer {self.optimizer!r} has no default lr in the registry: pass lr")
        for name in ("dp", "tp", "steps", "batch_size", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.batch_size % self.dp:
            raise ValueError(f"the global batch size {self.batch_size} must be a multiple of dp={self.dp}")
        for name in ("lr", "elementwise_lr"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= MAX_LR):
                raise ValueError(f"{name} must be a number in (0, {MAX_LR:g}], got {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.tp_style not in TP_STYLES:
            raise ValueError(f"tp_style must be one of {', '.join(TP_STYLES)}, got {self.tp_style!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend nccl needs CUDA, which this machine does not have; use --backend gloo")
        if self.bucket_numel is not None and (not isinstance(self.bucket_numel, int) or self.bucket_numel < 1):
            raise ValueError(f"bucket_numel must be a positive integer, got {self.bucket_numel!r}")
        if isinstance(self.cmax, bool) or not (isinstance(self.cmax, (int, float)) and self.cmax > 0):
            raise ValueError(f"cmax must be positive (2^20 TP-local gradient elements per host), got {self.cmax!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def matrix_lr(self) -> float:
        return float(self.lr if self.lr is not None else get_optimizer(self.optimizer).defaults["lr"])

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if torch.cuda.is_available() else "gloo")


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What one rank saw. ``losses`` are global means over the batch (identical on every rank);
    ``phase_times`` is ``PhaseTimer.as_dict()`` (wall/cpu seconds and calls per phase, all steps),
    ``comm_bytes`` ``CommStats.as_dict()`` (bytes sent/received and calls per phase, this rank,
    all steps); ``params_fingerprint`` a sha256 over the full (unsharded) final parameters.
    ``state_bytes_per_rank`` / ``peak_exchange_bytes_per_rank`` (by world rank): optimizer-state
    bytes and the largest TP exchange buffer of one micro-group (0 without TP), Section 4.2's
    memory figures."""

    config: TrainConfig
    rank: int
    dp_rank: int
    tp_rank: int
    losses: tuple[float, ...]
    step_seconds: tuple[float, ...]
    phase_times: dict[str, dict[str, float]] = field(default_factory=dict)
    comm_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    state_bytes: int = 0
    state_bytes_per_rank: tuple[int, ...] = ()
    peak_exchange_bytes_per_rank: tuple[int, ...] = ()
    plan_fingerprint: str = ""
    params_fingerprint: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["config"] = asdict(self.config)
        return out


def params_fingerprint(
    model: torch.nn.Module, *, tp_dims: Mapping[str, int] | None = None, tp_group: Any = None
) -> str:
    """sha256 (16 hex) over every parameter's name, shape, dtype and full bytes, in registration
    order. DTensor parameters are gathered first, and so are plain shards named in ``tp_dims``
    (over ``tp_group``): a collective, call it on every rank."""
    h = hashlib.sha256()
    tp_dims = dict(tp_dims or {})
    for name, p in model.named_parameters():
        t = p.detach()
        full = getattr(t, "full_tensor", None)
        if callable(full):
            t = full()
        elif name in tp_dims:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, dim=tp_dims[name])
        t = t.to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _check_world(cfg: TrainConfig) -> None:
    world = dist.get_world_size()
    if world != cfg.world_size:
        raise ValueError(f"dp*tp = {cfg.dp}*{cfg.tp} = {cfg.world_size} must equal the world size ({world})")


def check_model(config: TrainConfig) -> ModelConfig:
    """The model ``config`` trains (:class:`~canzona.config.ModelConfig`), after checking that
    training can run it: a dense Qwen3 (not a mixture of experts) that splits ``config.tp`` ways
    (whole attention heads per rank). Raises ValueError naming the problem; no collective."""
    from canzona.models import check_tp
    from canzona.plan import resolve_model

    cfg = resolve_model(config.model)
    if cfg.moe is not None:
        raise ValueError(f"{cfg.name} is a mixture-of-experts config; canzona train runs dense Qwen3 models")
    check_tp(cfg, config.tp)
    return cfg


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """A lower bound on the memory a run needs, in bytes, per rank and over its local ranks.

    ``params`` and ``activations`` are what each rank keeps on its device: the model parameters
    and their gradients (TP-local), and the activations of one step (hidden states kept for the
    backward, the logits and their gradient, one layer's attention scores, the token ids).
    ``host_data`` is what each rank keeps on the host whatever its device: the synthetic data's
    Markov chain (two float64 ``vocab x vocab`` tables, :class:`canzona.models.data.MarkovData`)
    and, when the model lives on a GPU, the host copy of the token ids and the fp32 CPU draw of the
    largest weight at initialization. ``gpu`` says whether the ranks' device is a GPU (one per
    rank, :func:`_device`); then :attr:`per_rank` is each GPU's share and the host holds only
    ``host_data`` per rank. Real use is higher (optimizer state, masters, temporaries, the CUDA
    context), so a run refused on this bound could never fit."""

    params: int
    activations: int
    ranks: int
    host_data: int = 0
    gpu: bool = False

    @property
    def per_rank(self) -> int:
        """Bytes each rank keeps on its device (its GPU, or the host without CUDA)."""
        return self.params + self.activations

    @property
    def host_per_rank(self) -> int:
        """Bytes each rank keeps on the host."""
        return self.host_data + (0 if self.gpu else self.per_rank)

    @property
    def total(self) -> int:
        """Host bytes over all local ranks."""
        return self.ranks * self.host_per_rank


def memory_estimate(config: TrainConfig, cfg: ModelConfig) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of ``config`` training ``cfg`` (arithmetic only: nothing is
    allocated). The device is a GPU when the run's backend is NCCL (:attr:`TrainConfig.resolved_backend`)."""
    h, hd, inter, vocab = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    # attention (q, k, v, o), MLP (gate, up, down) and norms per layer; embedding, head, final norm
    per_layer = h * hd * (2 * heads + 2 * kv) + 3 * h * inter + 2 * h + 2 * hd
    n_params = cfg.num_hidden_layers * per_layer + vocab * h * (1 if cfg.tie_word_embeddings else 2) + h
    elem = torch.tensor([], dtype=DTYPES[config.dtype]).element_size()
    params = 2 * n_params * elem // config.tp  # parameters and gradients
    local_batch = config.batch_size // config.dp
    tokens = local_batch * config.seq_len
    ids = 2 * tokens * 8  # int64 ids and labels
    acts = (
        cfg.num_hidden_layers * tokens * h * 4 * elem  # residual stream, two norms, attention output
        + 2 * tokens * (vocab // config.tp) * 4  # fp32 logits and their gradient
        + local_batch * (heads // config.tp) * config.seq_len**2 * 4  # one layer's attention scores
        + ids
    )
    gpu = config.resolved_backend == "nccl"
    host_data = 2 * vocab * vocab * 8  # the data's float64 transition probabilities and their CDF
    if gpu:
        # the ids are drawn on the host, and every weight is drawn full-size in fp32 on the CPU
        # before it is copied to the GPU (one at a time: the largest one counts)
        host_data += ids + 4 * max(vocab * h, h * inter, h * hd * heads)
    return MemoryEstimate(params=params, activations=acts, ranks=config.world_size, host_data=host_data, gpu=gpu)


def available_memory_bytes() -> int | None:
    """Memory this machine can give a new run now (Linux ``MemAvailable``; the physical memory
    elsewhere; None when neither is known)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


_ADVICE = "use a smaller model, --batch-size or --seq-len"


def check_memory(config: TrainConfig, cfg: ModelConfig, available: int | None = None) -> MemoryEstimate:
    """Raise ValueError, saying how much is needed, when ``config`` cannot fit in this machine's
    host memory (``available`` bytes; by default :func:`available_memory_bytes`), before anything
    is allocated or any worker starts. Without CUDA the host holds everything; with CUDA it holds
    the ranks' :attr:`MemoryEstimate.host_data`, and each GPU's share is checked by
    :func:`check_gpu_memory` in the workers (CUDA is not touched here: a CUDA context in the
    launcher would hold memory on every GPU for the whole run, and would keep the workers off a
    GPU in exclusive-process mode)."""
    est = memory_estimate(config, cfg)
    free = available_memory_bytes() if available is None else available
    if free is not None and est.total > free:
        if est.gpu:
            what = (f"{_gib(est.host_data)} of synthetic data and initialization draws per rank, {est.ranks} rank(s); "
                    "the model itself lives on the GPUs")
        else:
            what = (f"{_gib(est.params)} of parameters and gradients, {_gib(est.activations)} of activations and "
                    f"{_gib(est.host_data)} of synthetic data per rank, {est.ranks} rank(s)")
        raise ValueError(
            f"{cfg.name} with batch {config.batch_size} x {config.seq_len} tokens needs at least {_gib(est.total)} of "
            f"{'host ' if est.gpu else ''}memory ({what}); this machine has {_gib(free)} available: {_ADVICE}"
        )
    return est


def gpu_fit(est: MemoryEstimate, cfg: ModelConfig, config: TrainConfig, free_by_rank: Sequence[tuple[int, int, int]]) -> None:
    """Raise ValueError (one line) when some rank's GPU cannot hold its ranks' share of ``est``.

    ``free_by_rank[r]`` is ``(gpu index, free bytes, ranks on that GPU)`` as rank ``r`` read it
    before allocating anything; the line names the first rank whose GPU falls short, what it
    needs and what is free. Pure: every rank calls it with the same figures and raises the same
    line."""
    for rank, (index, free, sharing) in enumerate(free_by_rank):
        need = sharing * est.per_rank
        if need > free:
            shared = f", {sharing} ranks on it" if sharing > 1 else ""
            raise ValueError(
                f"{cfg.name} with batch {config.batch_size} x {config.seq_len} tokens needs at least {_gib(need)} of "
                f"memory on GPU cuda:{index} of rank {rank} ({_gib(est.params)} of parameters and gradients and "
                f"{_gib(est.activations)} of activations per rank{shared}); it has {_gib(free)} free: {_ADVICE}"
            )


def check_gpu_memory(config: TrainConfig, cfg: ModelConfig, device: torch.device) -> MemoryEstimate:
    """Refuse, on every rank and before the mesh or the model is allocated, a run whose per-GPU
    share does not fit in some rank's GPU: each rank reads its GPU's free memory
    (``torch.cuda.mem_get_info``, on the context it creates anyway), one all-gather shares the
    figures, and :func:`gpu_fit` decides the same way everywhere. Collective: every rank calls it
    (:func:`train` does, after :func:`_device`). Ranks that share a GPU (more local ranks than
    GPUs: rank ``r`` uses GPU ``r % count``) share its free memory."""
    est = memory_estimate(config, cfg)
    index = device.index if device.index is not None else torch.cuda.current_device()
    free = int(torch.cuda.mem_get_info(index)[0])
    count = max(1, torch.cuda.device_count())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    sharing = max(1, sum(1 for r in range(local_world) if r % count == index % count))
    # NCCL gathers device tensors; on gloo (tests) the figures travel on the host
    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([index, free, sharing], dtype=torch.int64, device=where)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    gpu_fit(est, cfg, config, [tuple(int(v) for v in t.tolist()) for t in every])  # type: ignore[misc]
    return est


def _gib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:,.1f} GiB"


def train(config: TrainConfig, *, on_step: Callable[[int, float, dict[str, float]], None] | None = None) -> TrainResult:
    """Train for ``config.steps`` steps on this rank (collective: every rank of the world calls it).

    ``on_step(step, loss, phase_seconds)`` is called on every rank after each step (phase wall
    seconds of that step, base phase names). Raises ValueError (on every rank, before any
    collective) when the world size is not ``dp * tp`` or the model cannot be split ``tp`` ways;
    on CUDA, also (on every rank, after one all-gather and before the mesh or the model is
    allocated) when some rank's GPU has less free memory than its share (:func:`check_gpu_memory`).
    """
    owns_group = False
    if not dist.is_initialized():
        if config.world_size != 1:
            raise ValueError(
                f"dp*tp = {config.world_size} needs {config.world_size} processes: use `canzona train --nproc "
                f"{config.world_size}` or torchrun"
            )
        # one rank: an in-process store, so there is no port to pick (and lose to another process)
        dist.init_process_group(
            backend=config.resolved_backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60)
        )
        owns_group = True
    try:
        _check_world(config)
        return _train(config, check_model(config), on_step)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _train(config: TrainConfig, cfg: Any, on_step: Callable[[int, float, dict[str, float]], None] | None) -> TrainResult:
    from canzona.models import batch
    from canzona.runtime.phases import phase, timing

    device = _device(config.resolved_backend)
    if device.type == "cuda":
        check_gpu_memory(config, cfg, device)  # before the mesh and the model take any of it
    mesh, model, opt, tp_dims, (dp_rank, tp_rank) = _setup(config, cfg, device)
    dp_group = mesh.get_group("dp") if config.tp > 1 else mesh.get_group()
    losses: list[float] = []
    step_seconds: list[float] = []
    for step in range(config.steps):
        ids, labels = batch(step, dp_rank, config.dp, config.batch_size, config.seq_len, config.seed, vocab=cfg.vocab_size)
        ids, labels = ids.to(device), labels.to(device)
        before = {k: v["wall_s"] for k, v in opt.phase_times.as_dict().items()}
        t0 = time.perf_counter()
        with timing(opt.phase_times):
            with phase("canzona/forward"):
                loss = model.loss(ids, labels)
            with phase("canzona/backward"):
                loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_seconds.append(time.perf_counter() - t0)
        # Global mean loss for reporting (equal batch shares per DP rank). Outside the optimizer's
        # Comm, so it is not counted in the per-phase bytes.
        report = loss.detach().float().reshape(1).clone()
        if config.dp > 1:
            dist.all_reduce(report, group=dp_group)
            report /= config.dp
        value = float(report.item())
        losses.append(value)
        if on_step is not None:
            after = opt.phase_times.as_dict()
            on_step(step, value, {k: v["wall_s"] - before.get(k, 0.0) for k, v in after.items()})
    return _result(config, mesh, model, opt, tp_dims, dp_rank, tp_rank, losses, step_seconds, device)


def _setup(config: TrainConfig, cfg: Any, device: torch.device) -> tuple[Any, Any, Any, dict[str, int] | None, tuple[int, int]]:
    """The ``("dp",)`` or ``("dp", "tp")`` mesh, canzona's Qwen3 (TP-sharded the configured way) and
    its :class:`~canzona.distributed.DistributedOptimizer`; also the TP dims of a Megatron-sharded
    model and this rank's (DP, TP) coordinates."""
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.distributed import DistributedOptimizer
    from canzona.models import Qwen3, parallelize, shard_megatron

    if config.tp > 1:
        mesh = init_device_mesh(device.type, (config.dp, config.tp), mesh_dim_names=("dp", "tp"))
        dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    else:
        mesh = init_device_mesh(device.type, (config.dp,), mesh_dim_names=("dp",))
        dp_rank, tp_rank = mesh.get_local_rank(), 0
    model = Qwen3(cfg, seed=config.seed, device=device, dtype=DTYPES[config.dtype])
    tp_dims: dict[str, int] | None = None
    if config.tp > 1 and config.tp_style == "dtensor":
        parallelize(model, mesh["tp"])
    elif config.tp > 1:
        tp_dims = shard_megatron(model, tp_rank, config.tp, group=mesh.get_group("tp"))
    opt = DistributedOptimizer(
        model,
        config.optimizer,
        strategy=config.strategy,
        mesh=mesh,
        optimizer_kwargs={"lr": config.matrix_lr},
        elementwise_kwargs={"lr": config.elementwise_lr},
        tp_schedule=config.tp_schedule,
        tp_dims=tp_dims,
        bucket_numel=config.bucket_numel,
        cmax=config.cmax,
    )
    return mesh, model, opt, tp_dims, (dp_rank, tp_rank)


def _result(config: TrainConfig, mesh: Any, model: Any, opt: Any, tp_dims: dict[str, int] | None, dp_rank: int, tp_rank: int,
            losses: list[float], step_seconds: list[float], device: torch.device) -> TrainResult:
    """This rank's :class:`TrainResult`: its losses and timings, the parameters' fingerprint, and
    every rank's state and peak exchange bytes (one all-gather)."""
    fp = params_fingerprint(model, tp_dims=tp_dims, tp_group=mesh.get_group("tp") if tp_dims else None)
    engine = opt.runtime.tp_engine
    state_bytes = int(opt.state_bytes())
    mine = torch.tensor([state_bytes, int(engine.peak_exchange_bytes) if engine is not None else 0], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return TrainResult(
        config=config,
        rank=dist.get_rank(),
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        losses=tuple(losses),
        step_seconds=tuple(step_seconds),
        phase_times={k: dict(v) for k, v in opt.phase_times.as_dict().items()},
        comm_bytes={k: dict(v) for k, v in opt.comm_stats.as_dict().items()},
        state_bytes=state_bytes,
        state_bytes_per_rank=tuple(int(t[0]) for t in every),
        peak_exchange_bytes_per_rank=tuple(int(t[1]) for t in every),
        plan_fingerprint=opt.plan.fingerprint,
        params_fingerprint=fp,
    )


# ----------------------------------------------------------------------------- reporting

#: short column names of the per-step line, with what each one means (printed once as a legend)
_SHORT: dict[str, tuple[str, str]] = {
    P.FORWARD: ("fwd", "forward"),
    P.BACKWARD: ("bwd", "backward (launches the DP gradient collectives)"),
    P.OPTIMIZER_STEP: ("opt", "optimizer step (the phases below, and the rest)"),
    P.DP_REDUCE_SCATTER: ("rs", "DP gradient reduce-scatter (launch + wait)"),
    P.DP_ALL_REDUCE: ("ar", "DP gradient all-reduce (launch + wait)"),
    P.DP_LOCAL_UPDATE: ("upd", "DP owner's update of the parameters it owns"),
    P.TP_GATHER: ("tp-g", "TP micro-group gather to the hosts"),
    P.TP_COMPUTE: ("tp-c", "TP host update of full matrices"),
    P.TP_SCATTER: ("tp-s", "TP scatter of updated shards"),
    P.TP_APPLY: ("tp-a", "TP apply of the received shards"),
    P.SHARD_GATHER: ("sh-g", "FSDP2 shard-group gather to the hosts"),
    P.SHARD_COMPUTE: ("sh-c", "FSDP2 host update of full matrices"),
    P.SHARD_SCATTER: ("sh-s", "FSDP2 scatter of updated pieces"),
    P.SHARD_APPLY: ("sh-a", "FSDP2 apply of the received pieces"),
    P.DP_ALL_GATHER: ("ag", "DP parameter all-gather"),
    P.LAYERWISE_BROADCAST: ("bcast", "layerwise parameter broadcast"),
    P.STATUS: ("stat", "status exchanges (errors, flags; absorbs rank skew)"),
}


def _short(name: str) -> str:
    return _SHORT[name][0] if name in _SHORT else name


#: the per-step line's columns: (name, meaning, phases summed into it). Communication phases are
#: summed over their launch and wait parts (``<phase>/launch``, ``<phase>/wait``) and over DP and
#: TP: ``comm`` is time spent inside the collectives, part of ``bwd`` (bucket reduce-scatters)
#: and ``opt`` (everything else), so the columns do not add up to the step.
_COLUMNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("fwd", "forward", (P.FORWARD,)),
    ("bwd", "backward", (P.BACKWARD,)),
    ("opt", "optimizer", (P.OPTIMIZER_STEP,)),
    # every communication phase but the status exchanges, which have a column of their own
    ("comm", "collectives", tuple(p for p in P.PHASES if p in P.COMM_PHASES and p != P.STATUS)),
    ("stat", "status", (P.STATUS,)),
)


def _phase_ms(phases: dict[str, float], base: str) -> float:
    """Milliseconds of ``base``: its own entry, or else the sum of its sub-phases."""
    if base in phases:
        return phases[base] * 1e3
    return sum(v for k, v in phases.items() if k.startswith(base + "/")) * 1e3


def _column_ms(phases: dict[str, float]) -> dict[str, float]:
    return {name: sum(_phase_ms(phases, b) for b in bases) for name, _, bases in _COLUMNS}


def step_legend(phases: Sequence[str]) -> str:
    """The legend of the per-step line (one line under 100 characters): the columns the line
    shows for these phases (base or ``/launch``, ``/wait`` names)."""
    shown = _column_ms(dict.fromkeys(phases, 1.0))
    cols = [f"{name} {meaning}" for name, meaning, _ in _COLUMNS if shown[name] > 0]
    return "per step (rank 0, ms): " + ", ".join(cols)


def _step_line(step: int, steps: int, loss: float, phases: dict[str, float]) -> str:
    width = len(str(steps))
    ms = _column_ms(phases)
    # one decimal below a second, whole milliseconds above: a column stays 6 characters wide
    parts = [f"{name} {ms[name]:6.1f}" if ms[name] < 1000 else f"{name} {ms[name]:6.0f}" for name, _, _ in _COLUMNS if ms[name] > 0]
    return f"step {step + 1:>{width}}/{steps}  loss {loss:.4f}  " + "  ".join(parts)


class Progress:
    """Rank 0's progress display: a legend before the first step, then one plain line per step
    on ``out``. A tqdm bar (on stderr) is added only when ``bar`` is True or, with ``bar=None``,
    when stdout and stderr are both terminals; then step lines go through the bar so the two never
    interleave. Under a pipe or torchrun (no terminal) the output is plain lines only."""

    def __init__(self, config: TrainConfig, *, out: Any = None, bar: bool | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.steps = config.steps
        if bar is None:
            bar = _isatty(sys.stdout) and _isatty(sys.stderr)
        self.bar: Any = None
        if bar:
            import threading

            from tqdm import tqdm

            # A thread lock, not tqdm's default multiprocessing lock: a worker stopped by the launcher
            # (SIGTERM) cannot release a named semaphore, and the leak would be reported at exit.
            tqdm.set_lock(threading.RLock())
            self.bar = tqdm(total=config.steps, desc=f"{config.strategy} dp{config.dp}xtp{config.tp}", unit="step", file=sys.stderr)
        self._legend = False

    def _write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.out)
        else:
            print(line, file=self.out, flush=True)

    def __call__(self, step: int, loss: float, phases: dict[str, float]) -> None:
        if not self._legend:
            self._write(step_legend([k for k, v in phases.items() if v > 0]))
            self._legend = True
        self._write(_step_line(step, self.steps, loss, phases))
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}")
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def format_summary(result: TrainResult) -> str:
    """Human-readable summary of a run (rank 0's view): losses, phase times, bytes per phase."""
    c = result.config
    lines = [
        f"canzona train: {c.model} {c.optimizer} strategy={c.strategy} dp={c.dp} tp={c.tp} "
        f"steps={c.steps} batch={c.batch_size}x{c.seq_len} dtype={c.dtype}",
        f"loss: first {result.losses[0]:.4f}  last {result.losses[-1]:.4f}  "
        f"(mean step {sum(result.step_seconds) / len(result.step_seconds) * 1e3:.1f} ms)",
        f"plan {result.plan_fingerprint}  final params {result.params_fingerprint}",
        "optimizer state per rank: " + "  ".join(_bytes(b) for b in result.state_bytes_per_rank)
        + (f"  (max/mean {max(result.state_bytes_per_rank) / (sum(result.state_bytes_per_rank) / len(result.state_bytes_per_rank)):.2f})"
           if sum(result.state_bytes_per_rank) else ""),
    ]
    if any(result.peak_exchange_bytes_per_rank):
        lines.append(
            "peak TP exchange buffer per rank: " + "  ".join(_bytes(b) for b in result.peak_exchange_bytes_per_rank)
            + f"  (C_max {c.cmax:g} x 2^20 TP-local elements per host)"
        )
    lines += [
        "",
        f"{'phase (rank %d)' % result.rank:<30}{'wall s':>10}{'ms/step':>10}{'calls':>8}{'sent':>12}{'recv':>12}",
    ]
    names = list(dict.fromkeys([*result.phase_times, *result.comm_bytes]))
    for name in names:
        t = result.phase_times.get(name, {})
        b = result.comm_bytes.get(name, {})
        wall = float(t.get("wall_s", 0.0))
        lines.append(
            f"{name:<30}{wall:>10.4f}{wall / c.steps * 1e3:>10.2f}{int(t.get('calls', 0)):>8}"
            f"{_bytes(b.get('sent', 0)):>12}{_bytes(b.get('recv', 0)):>12}"
        )
    return "\n".join(lines)


def train_worker(rank: int, world_size: int, config: TrainConfig) -> TrainResult:
    """Worker body for :func:`canzona.runtime.launch.run_workers`: train; rank 0 shows progress
    (:class:`Progress`, unless ``config.progress`` is off), writes the metrics log when
    ``config.log_dir`` is set and prints the summary."""
    del world_size
    if rank != 0:
        return train(config)
    hooks: list[Callable[[int, float, dict[str, float]], None]] = []
    progress = Progress(config) if config.progress else None
    log = MetricsHook(config) if config.log_dir else None
    if progress is not None:
        hooks.append(progress)
    if log is not None:
        hooks.append(log)
    try:
        result = train(config, on_step=_chain(hooks) if hooks else None)
    finally:
        if progress is not None:
            progress.close()
        if log is not None:
            log.close()
    print(format_summary(result), flush=True)
    if log is not None:
        print(f"metrics: {log.log.path}" + (" (+ TensorBoard scalars)" if log.log.writer is not None else ""), flush=True)
    return result


class MetricsHook:
    """A per-step hook writing a :class:`canzona.runs.MetricsLog` into ``config.log_dir`` (with
    the configuration in its ``run.json``); a step's wall time is measured from the previous
    step's hook (none for the first step, which includes the set-up)."""

    def __init__(self, config: TrainConfig, directory: str | None = None) -> None:
        from dataclasses import asdict

        from canzona.runs import MetricsLog

        run = {k: v for k, v in asdict(config).items() if k not in ("progress", "log_dir")}
        self.log = MetricsLog(directory or str(config.log_dir), run=run)
        self._t: float | None = None

    def __call__(self, step: int, loss: float, phases: dict[str, float]) -> None:
        now = time.perf_counter()
        self.log.log(step, loss, math.nan if self._t is None else now - self._t, phases)
        self._t = time.perf_counter()

    def close(self) -> None:
        self.log.close()


def _chain(hooks: Sequence[Callable[[int, float, dict[str, float]], None]]) -> Callable[[int, float, dict[str, float]], None]:
    def call(step: int, loss: float, phases: dict[str, float]) -> None:
        for h in hooks:
            h(step, loss, phases)

    return call


def train_from_env(config: TrainConfig) -> TrainResult:
    """Train as one rank of a job described by torchrun's environment (``WORLD_SIZE``, ``RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``): joins the ``env://`` group, runs :func:`train_worker`, leaves
    the group. Without those variables it is a single process (``dp = tp = 1``). Raises ValueError
    before any collective when ``dp * tp`` is not ``WORLD_SIZE``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != config.world_size:
        raise ValueError(f"dp*tp = {config.dp}*{config.tp} = {config.world_size} must equal WORLD_SIZE ({world})")
    rank = int(os.environ.get("RANK", "0"))
    owns_group = not dist.is_initialized() and (world > 1 or "MASTER_ADDR" in os.environ)
    if owns_group:
        dist.init_process_group(backend=config.resolved_backend, init_method="env://")
    try:
        result = train_worker(rank, world, config)
        if owns_group and world > 1:
            # Every rank's last collectives done before the group goes (so no rank tears down a
            # connection a peer still uses). The group itself is freed at destroy_process_group,
            # its gloo threads joined: canzona.runtime keeps torch.distributed.nn.functional from
            # pinning it to interpreter exit, where those threads abort a finished run.
            dist.barrier()
        return result
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
