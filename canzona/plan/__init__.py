"""The offline planner: ZeRO-1 buffer geometry, DP partitions (Section 3) and TP micro-groups
(Section 4) as one frozen, validated, serialisable :class:`Plan`.

``make_plan(specs, inputs)`` plans any list of :class:`canzona.specs.ParamSpec`;
``plan_model("qwen3-32b", dp=32, tp=8)`` plans a shipped model config;
``plan_fsdp_model("qwen3-32b", dp_shard=32, tp=8)`` plans it for FSDP2 (the same :class:`Plan`,
``inputs.layout_kind == "fsdp2"``, :mod:`canzona.plan.shard`). Strategies are records in
a registry (:mod:`canzona.plan.strategies`); ``register_strategy`` adds one. Pure Python + numpy: no
torch.distributed, no devices, milliseconds for a 32B model.
"""

from __future__ import annotations

from canzona.plan.build import (
    CMAX_UNIT,
    DEFAULT_CMAX,
    cmax_from_bytes,
    cmax_to_bytes,
    default_bucket_numel,
    default_tp_schedule,
    make_plan,
    plan_fsdp_model,
    plan_model,
    resolve_model,
)
from canzona.plan.shard import piece_numels, plan_shard, shard_inputs, shard_specs
from canzona.plan.errors import PlanError
from canzona.plan.strategies import (
    FSDP_STRATEGIES,
    ROLES,
    PartitionInput,
    Strategy,
    get_strategy,
    paper_strategy_names,
    register_strategy,
    strategy_names,
    unregister_strategy,
)
from canzona.plan.plan import (
    COSTS,
    FLOPS_SHAPES,
    LAYOUT_KINDS,
    PAPER_STRATEGIES,
    STRATEGIES,
    TP_SCHEDULES,
    Bucket,
    Metrics,
    MicroGroup,
    ParamPlan,
    Plan,
    PlanInputs,
)

__all__ = [
    "Plan",
    "PlanInputs",
    "ParamPlan",
    "Bucket",
    "MicroGroup",
    "Metrics",
    "PlanError",
    "STRATEGIES",
    "PAPER_STRATEGIES",
    "TP_SCHEDULES",
    "COSTS",
    "FLOPS_SHAPES",
    "CMAX_UNIT",
    "DEFAULT_CMAX",
    "cmax_from_bytes",
    "cmax_to_bytes",
    "make_plan",
    "plan_model",
    "plan_fsdp_model",
    "plan_shard",
    "shard_inputs",
    "shard_specs",
    "piece_numels",
    "FSDP_STRATEGIES",
    "LAYOUT_KINDS",
    "default_bucket_numel",
    "default_tp_schedule",
    "resolve_model",
    "Strategy",
    "PartitionInput",
    "ROLES",
    "register_strategy",
    "unregister_strategy",
    "get_strategy",
    "strategy_names",
    "paper_strategy_names",
]
