"""Pipeline-parallel stages for the planner: one plan per stage.

Megatron-Core splits a GPT model's ``num_layers`` transformer layers evenly over ``pp`` pipeline
stages (``get_num_layers_to_build``: ``num_layers // pp`` consecutive layers each; the layer count
must divide by ``pp`` unless uneven splits are configured, which canzona does not model). The
embedding lives on the first stage, the final norm and the output layer on the last. Each stage is
its own data-parallel world: it has its own ZeRO-1 buffer and buckets, its own DP partition and
its own TP micro-groups, so :func:`plan_stages` simply plans every stage's parameters on their
own and reports per-stage metrics and the worst stage (the one that sets the optimizer step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from canzona.config import ModelConfig
from canzona.plan.plan import Plan, PlanError
from canzona.specs import ParamSpec

__all__ = ["stage_layers", "split_stages", "StagedPlan", "plan_stages"]


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The transformer layers of each stage, as Megatron-Core assigns them (even, consecutive)."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise PlanError(f"pp must be an integer >= 1, got {pp!r}")
    if num_layers % pp:
        raise PlanError(f"{num_layers} layers do not split evenly into pp={pp} pipeline stages (Megatron needs num_layers % pp == 0)")
    per = num_layers // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


def split_stages(specs: Sequence[ParamSpec], pp: int, num_layers: int | None = None) -> list[list[ParamSpec]]:
    """Parameters of each pipeline stage, in registration order.

    Layer parameters go to the stage that builds their layer; parameters outside the layers go to
    the first stage when they are registered before the first layer (the embedding) and to the last
    stage otherwise (final norm, output layer). ``num_layers`` defaults to the highest layer index
    in the names plus one.
    """
    layers = [s.layer for s in specs]
    known = [x for x in layers if x is not None]
    if num_layers is None:
        num_layers = max(known) + 1 if known else 0
    if pp == 1:
        return [list(specs)]
    if not known:
        raise PlanError("pipeline stages need transformer layers (parameter names with 'layers.<i>.')")
    ranges = stage_layers(num_layers, pp)
    per = num_layers // pp
    out: list[list[ParamSpec]] = [[] for _ in range(pp)]
    seen_layer = False
    for s, layer in zip(specs, layers):
        if layer is None:
            out[pp - 1 if seen_layer else 0].append(s)
        else:
            seen_layer = True
            out[min(layer // per, pp - 1)].append(s)
    assert all(r.stop - r.start == per for r in ranges)
    return out


@dataclass(frozen=True, slots=True)
class StagedPlan:
    """One :class:`Plan` per pipeline stage and the metrics that follow from them."""

    stages: tuple[Plan, ...]

    @property
    def pp(self) -> int:
        return len(self.stages)

    def per_stage(self, metric: str) -> list[float]:
        """``metric`` (a :class:`~canzona.plan.plan.Metrics` field) of every stage."""
        return [float(getattr(p.metrics, metric)) for p in self.stages]

    def worst(self, metric: str) -> tuple[int, float]:
        """(stage, value) of the largest ``metric`` (ties: the earlier stage)."""
        vals = self.per_stage(metric)
        k = max(range(len(vals)), key=lambda i: (vals[i], -i))
        return k, vals[k]

    def summary(self) -> dict[str, Any]:
        """Per-stage ratios and the worst stage of each, JSON-serializable."""
        keys = ("dp_flops_ratio", "dp_memory_ratio", "tp_flops_ratio", "tp_memory_ratio")
        out: dict[str, Any] = {"pp": self.pp, "stages": []}
        for i, p in enumerate(self.stages):
            m = p.metrics
            out["stages"].append({"stage": i, "params": len(p.params), "buckets": len(p.buckets),
                                  **{k: getattr(m, k) for k in keys}})
        out["worst"] = {k: {"stage": self.worst(k)[0], "value": self.worst(k)[1]} for k in keys}
        return out


def plan_stages(model: str | Path | ModelConfig, *, pp: int, dp: int, tp: int = 1, layout: str = "megatron",
                **kwargs: Any) -> StagedPlan:
    """Plan every pipeline stage of a shipped model / config on its own (same inputs otherwise;
    ``experts`` as :func:`canzona.plan.plan_model` takes it)."""
    from canzona.plan.build import default_bucket_numel, default_tp_schedule, make_plan, resolve_model
    from canzona.plan.plan import PlanInputs
    from canzona.specs import specs_from_config

    cfg = resolve_model(model)
    specs = specs_from_config(cfg, tp=tp, layout=layout, experts=kwargs.pop("experts", "stacked"))
    strategy = kwargs.pop("strategy", "lb-asc")
    tp_schedule = kwargs.pop("tp_schedule", None)
    bucket_numel = kwargs.pop("bucket_numel", None)
    inputs = PlanInputs(
        model=cfg.name, layout=layout, dp=dp, tp=tp, strategy=strategy,
        tp_schedule=tp_schedule if tp_schedule is not None else default_tp_schedule(strategy),
        bucket_numel=bucket_numel if bucket_numel is not None else default_bucket_numel(dp),
        optimizer=kwargs.pop("optimizer", "muon"),
        **kwargs,
    )
    stages = split_stages(specs, pp, cfg.num_hidden_layers)
    return StagedPlan(tuple(make_plan(st, inputs) for st in stages))
