"""Numbers the Canzona paper reports (arXiv 2602.06079), kept in one place as labelled references.

These are *reference constants*, never inputs: notebooks and figures draw them beside what
canzona's planner and simulator compute, always labelled "paper". Each value says which figure
or section it comes from and the configuration it was measured on, so a reader can tell whether
a comparison is like for like.

Where the paper only shows a trend in a plot without printing numbers (the DP 16..128 and TP 2..8
scaling curves of Figure 8, the model-size study of Figure 9, the alpha sweep of Figure 13), no
constant is recorded here: a value read off a plot by eye would be an invented number.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PaperValue", "PAPER_VALUES", "paper_value", "paper_values"]


@dataclass(frozen=True, slots=True)
class PaperValue:
    """One number reported in the paper and the configuration it was measured on.

    ``key`` is a stable identifier; ``strategy`` uses canzona's strategy names (``layerwise`` is
    the paper's NV-layerwise, ``lb-asc`` full Canzona, ``asc`` static partitioning without
    balancing); ``metric`` names the quantity as canzona's tables do (``dp_flops_ratio``,
    ``optimizer_s``, ...). ``model`` uses canzona's model names (``qwen3-32b``).
    """

    key: str
    value: float
    unit: str
    metric: str
    strategy: str
    source: str
    model: str = "qwen3-32b"
    dp: int = 32
    tp: int = 8
    optimizer: str = "muon"
    alpha: float = 1.0
    cost: str = "numel"
    #: "" for the main results; the ablation a value belongs to otherwise ("fusion", "cost-model"):
    #: ablation runs differ from the main runs in ways the other fields do not capture
    ablation: str = ""
    note: str = ""

    @property
    def config(self) -> str:
        """The configuration in words, e.g. ``Qwen3-32B, muon, DP32 x TP8 (256 GPUs)``."""
        return f"{self.model}, {self.optimizer}, DP{self.dp} x TP{self.tp} ({self.dp * self.tp} GPUs)"

    @property
    def label(self) -> str:
        """Legend text: where the number comes from."""
        return f"paper {self.source} ({self.model} DP{self.dp}xTP{self.tp})"

    def matches(
        self, *, model: str, dp: int, tp: int, optimizer: str, alpha: float | None = None, cost: str | None = None
    ) -> bool:
        """True when a canzona result for this configuration is like for like with this value
        (``alpha`` and ``cost``, when given, must be the paper's defaults: alpha = 1, cost numel)."""
        if (model.lower(), dp, tp, optimizer.lower()) != (self.model, self.dp, self.tp, self.optimizer):
            return False
        if alpha is not None and alpha != self.alpha:
            return False
        return cost is None or cost == self.cost


PAPER_VALUES: tuple[PaperValue, ...] = (
    # Section 5.3 / Figure 3c: DP load balance (R_LB = max / mean over DP ranks)
    PaperValue("dp_flops_ratio_asc", 3.24, "x", "dp_flops_ratio", "asc", "Figure 3c",
               note="static partitioning without balancing"),
    PaperValue("dp_memory_ratio_asc", 2.46, "x", "dp_memory_ratio", "asc", "Figure 3c",
               note="static partitioning without balancing"),
    PaperValue("dp_flops_ratio_lb-asc", 1.43, "x", "dp_flops_ratio", "lb-asc", "Figure 3c",
               note="alpha-balanced static partitioning, alpha = 1"),
    PaperValue("dp_memory_ratio_lb-asc", 1.11, "x", "dp_memory_ratio", "lb-asc", "Figure 3c",
               note="alpha-balanced static partitioning, alpha = 1"),
    # Section 5.3 / Figure 3b: TP load balance across the 8 TP ranks of one DP rank
    PaperValue("tp_flops_ratio_asc", 3.24, "x", "tp_flops_ratio", "asc", "Figure 3b",
               note="round-robin hosts, no micro-group scheduling"),
    PaperValue("tp_flops_ratio_lb-asc", 2.46, "x", "tp_flops_ratio", "lb-asc", "Figure 3b",
               note="micro-group scheduling (Algorithm 2)"),
    PaperValue("tp_memory_ratio_lb-asc", 1.16, "x", "tp_memory_ratio", "lb-asc", "Figure 3b",
               note="micro-group scheduling (Algorithm 2)"),
    # Section 5.2 / Figure 4: time breakdown
    PaperValue("optimizer_s_layerwise", 0.383, "s", "optimizer_s", "layerwise", "Figure 4"),
    PaperValue("optimizer_s_lb-asc", 0.066, "s", "optimizer_s", "lb-asc", "Figure 4"),
    PaperValue("fwd_bwd_s_layerwise", 0.998, "s", "fwd_bwd_s", "layerwise", "Figure 4"),
    PaperValue("fwd_bwd_s_lb-asc", 0.811, "s", "fwd_bwd_s", "lb-asc", "Figure 4"),
    PaperValue("iteration_s_layerwise", 1.381, "s", "iteration_s", "layerwise", "Figure 4"),
    PaperValue("iteration_s_lb-asc", 0.877, "s", "iteration_s", "lb-asc", "Figure 4"),
    # Section 5.2 / Figure 4: the speedups the text states (NV-layerwise / Canzona), rounded there;
    # 0.383 / 0.066 is 5.80, 0.998 / 0.811 is 1.23, 1.381 / 0.877 is 1.57
    PaperValue("optimizer_speedup_dp32_tp8", 5.8, "x", "optimizer_speedup", "lb-asc", "Figure 4",
               note="optimizer step, NV-layerwise / Canzona"),
    PaperValue("fwd_bwd_speedup_dp32_tp8", 1.23, "x", "fwd_bwd_speedup", "lb-asc", "Figure 4",
               note="forward-backward, NV-layerwise / Canzona"),
    PaperValue("iteration_speedup_dp32_tp8", 1.57, "x", "iteration_speedup", "lb-asc", "Figure 4",
               note="end-to-end iteration, NV-layerwise / Canzona"),
    # Appendix C.6 / Figure 14: fusion capacity ablation
    PaperValue("optimizer_s_no_fuse", 0.11, "s", "optimizer_s", "lb-asc", "Figure 14", dp=16, ablation="fusion",
               note="no fusion: one all-to-all per tensor (approximate, '~0.11 s')"),
    PaperValue("optimizer_s_fused", 0.073, "s", "optimizer_s", "lb-asc", "Figure 14", dp=16, ablation="fusion",
               note="fused micro-groups (approximate, '~0.073 s')"),
    PaperValue("cmax_plateau_mb", 512.0, "MB", "cmax_mb", "lb-asc", "Figure 14", dp=16, ablation="fusion",
               note="optimizer time stops improving around this C_max"),
    # Appendix D.5 / Figure 16: cost model ablation
    PaperValue("optimizer_s_cost_numel", 0.0718, "s", "optimizer_s", "lb-asc", "Figure 16", ablation="cost-model",
               note="planner cost = numel"),
    PaperValue("optimizer_s_cost_flops", 0.0717, "s", "optimizer_s", "lb-asc", "Figure 16", cost="flops", ablation="cost-model",
               note="planner cost = FLOPs"),
    # Appendix C.2: DP16 x TP8 end-to-end comparison
    PaperValue("optimizer_speedup_dp16_tp8", 8.3, "x", "optimizer_speedup", "lb-asc", "Appendix C.2", dp=16,
               note="optimizer step, NV-layerwise / Canzona (approximate)"),
)

_BY_KEY = {v.key: v for v in PAPER_VALUES}
if len(_BY_KEY) != len(PAPER_VALUES):  # pragma: no cover - guards edits to the table above
    raise RuntimeError("duplicate key in PAPER_VALUES")


def paper_value(key: str) -> PaperValue:
    """The reference value called ``key``; a KeyError lists the known keys."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"no paper value {key!r}; known: {', '.join(sorted(_BY_KEY))}") from None


def paper_values(
    *, metric: str | None = None, strategy: str | None = None, ablation: str | None = None
) -> tuple[PaperValue, ...]:
    """Reference values filtered by ``metric``, ``strategy`` and ``ablation`` ("" = main results
    only); None leaves a field unfiltered."""
    return tuple(
        v for v in PAPER_VALUES
        if (metric is None or v.metric == metric)
        and (strategy is None or v.strategy == strategy)
        and (ablation is None or v.ablation == ablation)
    )
