"""Numbers the Canzona paper reports (arXiv 2602.06079), kept in one place as labelled references.

These are *reference constants*, never inputs: notebooks and figures draw them beside what
canzona's planner and simulator compute, always labelled "paper". Each value says which figure
or section it comes from and the configuration it was measured on, so a reader can tell whether
a comparison is like for like.

Where the paper only shows a trend in a plot without printing numbers (the DP 16..128 and TP 2..8
scaling curves of Figure 8, the model-size study of Figure 9, the alpha sweep of Figure 13), no
number is recorded: a value read off a plot by eye would be an invented number. Those figures
state *trends* instead, kept as :class:`PaperTrend` records (the claim in words, the figure, the
configuration) in :data:`PAPER_TRENDS`; ``canzona reproduce`` checks each one.

Configurations, as the paper states them: Figures 3 and 4 Qwen3-32B DP32 x TP8 (256 GPUs);
Figure 6 the Qwen3 family at several DP x TP splits (Qwen3-32B at DP16 x TP8 and DP32 x TP4);
Figure 7 the same runs with AdamW references; Figure 8a Qwen3-32B TP4, DP 16..128; Figure 8b
Qwen3-32B PP4 x DP4, TP 2..8; Figure 9 DP16 x TP4, Qwen3 1.7B..32B; Figures 10-12 Qwen3-14B
PP2 x DP32 x TP4 with Shampoo / SOAP; Figure 13 Qwen3-32B PP8 x DP16 (128 GPUs, so TP1);
Figures 14 and 16 Qwen3-32B DP16 x TP8 (128 GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PaperValue", "PaperTrend", "PAPER_VALUES", "PAPER_TRENDS", "paper_value", "paper_values", "paper_trend", "paper_trends", "figure_of"]


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
    #: pipeline-parallel stages of the run (1: none)
    pp: int = 1
    alpha: float = 1.0
    cost: str = "numel"
    #: "" for the main results; the ablation a value belongs to otherwise ("fusion", "cost-model"):
    #: ablation runs differ from the main runs in ways the other fields do not capture
    ablation: str = ""
    note: str = ""

    @property
    def config(self) -> str:
        """The configuration in words, e.g. ``Qwen3-32B, muon, DP32 x TP8 (256 GPUs)``."""
        pp = f"PP{self.pp} x " if self.pp > 1 else ""
        return f"{self.model}, {self.optimizer}, {pp}DP{self.dp} x TP{self.tp} ({self.pp * self.dp * self.tp} GPUs)"

    @property
    def figure(self) -> str:
        """The figure key (``fig3``, ``fig10a``, ...) this value belongs to."""
        return figure_of(self.source)

    @property
    def label(self) -> str:
        """Legend text: where the number comes from."""
        pp = f"PP{self.pp}x" if self.pp > 1 else ""
        return f"paper {self.source} ({self.model} {pp}DP{self.dp}xTP{self.tp})"

    def matches(
        self, *, model: str, dp: int, tp: int, optimizer: str, alpha: float | None = None, cost: str | None = None,
        pp: int | None = None,
    ) -> bool:
        """True when a canzona result for this configuration is like for like with this value
        (``alpha``, ``cost`` and ``pp``, when given, must be the value's: alpha = 1, cost numel)."""
        if (model.lower(), dp, tp, optimizer.lower()) != (self.model, self.dp, self.tp, self.optimizer):
            return False
        if pp is not None and pp != self.pp:
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
    # (Qwen3-32B, DP16 x TP8: Appendix D.5 states this configuration)
    PaperValue("optimizer_s_cost_numel", 0.0718, "s", "optimizer_s", "lb-asc", "Figure 16", dp=16, ablation="cost-model",
               note="planner cost = numel"),
    PaperValue("optimizer_s_cost_flops", 0.0717, "s", "optimizer_s", "lb-asc", "Figure 16", dp=16, cost="flops",
               ablation="cost-model", note="planner cost = FLOPs"),
    # Appendix C.2 / Figure 6: DP16 x TP8 end-to-end comparison
    PaperValue("optimizer_speedup_dp16_tp8", 8.3, "x", "optimizer_speedup", "lb-asc", "Figure 6", dp=16,
               note="optimizer step, NV-layerwise / Canzona (approximate, 'approximately 8.3x'; Appendix C.2)"),
    # Section 5.3 / Figure 3a: the lowest maximum step time, in the figure's own unit
    PaperValue("step_time_tflops_equiv_lb-asc", 1.05, "TFLOPS-equivalent", "max_step_tflops_equiv", "lb-asc", "Figure 3a",
               note="'lowest maximum step time (1.05 TFLOPS equivalent)'; the paper does not define the unit"),
    # Appendix C.4 / Figure 10a: Shampoo, Qwen3-14B, PP2 x DP32 x TP4 (256 GPUs)
    PaperValue("optimizer_s_sc_shampoo", 3.313, "s", "optimizer_s", "sc", "Figure 10a", model="qwen3-14b", dp=32, tp=4,
               pp=2, optimizer="shampoo", ablation="optimizers", note="synchronous compute baseline"),
    PaperValue("optimizer_s_lb-asc_shampoo", 0.110, "s", "optimizer_s", "lb-asc", "Figure 10a", model="qwen3-14b", dp=32,
               tp=4, pp=2, optimizer="shampoo", ablation="optimizers"),
    PaperValue("optimizer_speedup_sc_shampoo", 30.0, "x", "optimizer_speedup_vs_sc", "lb-asc", "Figure 10a",
               model="qwen3-14b", dp=32, tp=4, pp=2, optimizer="shampoo", ablation="optimizers",
               note="'a ~30x speedup' (3.313 / 0.110 = 30.1)"),
    # Appendix C.4 / Figure 12: load balance under Shampoo and SOAP. The summary gives the C.4
    # configuration for the whole appendix (Qwen3-14B, PP2 x DP32 x TP4), not separately for Fig. 12.
    PaperValue("dp_flops_ratio_asc_shampoo", 2.0, "x", "dp_flops_ratio", "asc", "Figure 12", model="qwen3-14b", dp=32,
               tp=4, pp=2, optimizer="shampoo", ablation="optimizers",
               note="a lower bound: the paper says '> 2.0' for the naive partition"),
    PaperValue("dp_flops_ratio_lb-asc_shampoo", 1.05, "x", "dp_flops_ratio", "lb-asc", "Figure 12", model="qwen3-14b",
               dp=32, tp=4, pp=2, optimizer="shampoo", ablation="optimizers", note="approximate ('~1.05')"),
    PaperValue("dp_flops_ratio_asc_soap", 2.0, "x", "dp_flops_ratio", "asc", "Figure 12", model="qwen3-14b", dp=32,
               tp=4, pp=2, optimizer="soap", ablation="optimizers",
               note="a lower bound: the paper says '> 2.0' for the naive partition"),
    PaperValue("dp_flops_ratio_lb-asc_soap", 1.05, "x", "dp_flops_ratio", "lb-asc", "Figure 12", model="qwen3-14b",
               dp=32, tp=4, pp=2, optimizer="soap", ablation="optimizers", note="approximate ('~1.05')"),
)



@dataclass(frozen=True, slots=True)
class PaperTrend:
    """A claim a figure makes without printing numbers, and the configuration it was made on.

    ``claim`` is the paper's statement in words; ``x`` the swept quantity and ``points`` its
    values (empty when nothing is swept); the other fields as in :class:`PaperValue`.
    """

    key: str
    figure: str
    claim: str
    model: str = "qwen3-32b"
    dp: int = 32
    tp: int = 8
    pp: int = 1
    optimizer: str = "muon"
    x: str = ""
    points: tuple[float | str, ...] = ()

    @property
    def config(self) -> str:
        pp = f"PP{self.pp} x " if self.pp > 1 else ""
        sweep = f", {self.x} in {list(self.points)}" if self.x else ""
        return f"{self.model}, {self.optimizer}, {pp}DP{self.dp} x TP{self.tp}{sweep}"


_FAMILY = ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
PAPER_TRENDS: tuple[PaperTrend, ...] = (
    PaperTrend("fig6_lb_beats_layerwise", "fig6", "Canzona's iteration is shorter than NV-layerwise's in every tested configuration",
               dp=16, tp=8, x="model", points=_FAMILY),
    PaperTrend("fig6_gap_grows_with_size", "fig6", "the optimizer-step gap to NV-layerwise widens with model size",
               dp=16, tp=8, x="model", points=_FAMILY),
    PaperTrend("fig6_robust_to_split", "fig6", "the advantage holds at both DP16 x TP8 and DP32 x TP4 for Qwen3-32B",
               dp=16, tp=8, x="split", points=("DP16xTP8", "DP32xTP4")),
    PaperTrend("fig7_layerwise_tracks_allreduce", "fig7", "NV-layerwise's fwd-bwd tracks AdamW with all-reduce (DDP)"),
    PaperTrend("fig7_canzona_tracks_reduce_scatter", "fig7",
               "Canzona's fwd-bwd tracks AdamW with reduce-scatter (ZeRO-1), marginally above it"),
    PaperTrend("fig8a_asc_degrades", "fig8a", "ASC's DP load-balance ratios (memory and FLOPs) grow with DP size",
               tp=4, x="dp", points=(16, 32, 64, 128)),
    PaperTrend("fig8a_lb_flat", "fig8a", "LB-ASC's DP load-balance ratio stays close to 1.0 up to DP128",
               tp=4, x="dp", points=(16, 32, 64, 128)),
    PaperTrend("fig8a_opt_time", "fig8a", "optimizer time stays stable under LB-ASC and increases under ASC",
               tp=4, x="dp", points=(16, 32, 64, 128)),
    PaperTrend("fig8b_baseline_grows", "fig8b", "the baseline's TP FLOPs imbalance increases sharply with TP size",
               dp=4, pp=4, x="tp", points=(2, 4, 8)),
    PaperTrend("fig8b_lb_lower", "fig8b", "micro-group scheduling keeps the TP FLOPs ratio well below the baseline's",
               dp=4, pp=4, x="tp", points=(2, 4, 8)),
    PaperTrend("fig9_asc_grows", "fig9", "ASC's DP load-balance ratio increases with model size", dp=16, tp=4, x="model",
               points=_FAMILY),
    PaperTrend("fig9_lb_flat", "fig9", "LB-ASC's DP load-balance ratio stays flat across model sizes", dp=16, tp=4,
               x="model", points=_FAMILY),
    PaperTrend("fig9_tp_near_optimal", "fig9", "the TP baseline fluctuates with architecture; greedy scheduling stays near "
               "the optimum at every size", dp=16, tp=4, x="model", points=_FAMILY),
    PaperTrend("fig11a_soap_reduction", "fig11a", "SOAP: LB-ASC cuts the SC optimizer step drastically, as for Shampoo",
               model="qwen3-14b", dp=32, tp=4, pp=2, optimizer="soap"),
    PaperTrend("fig13_opt_decreases", "fig13", "the optimizer time decreases monotonically as alpha goes from 0 to 1",
               dp=16, tp=1, pp=8, x="alpha", points=(0.0, 0.25, 0.5, 0.75, 1.0)),
    PaperTrend("fig13_fwd_bwd_stable", "fig13", "fwd-bwd stays relatively stable across alpha", dp=16, tp=1, pp=8,
               x="alpha", points=(0.0, 0.25, 0.5, 0.75, 1.0)),
    PaperTrend("fig13_alpha1_best", "fig13", "alpha = 1 gives the best end-to-end iteration", dp=16, tp=1, pp=8,
               x="alpha", points=(0.0, 0.25, 0.5, 0.75, 1.0)),
    PaperTrend("fig14_fusion_helps", "fig14", "fusing micro-groups beats no-fuse at every C_max", dp=16, tp=8, x="cmax_mb",
               points=(64, 128, 256, 512, 1024, 2048)),
    PaperTrend("fig14_plateau", "fig14", "the fused optimizer time plateaus around C_max = 512 MB", dp=16, tp=8,
               x="cmax_mb", points=(64, 128, 256, 512, 1024, 2048)),
    PaperTrend("fig16_numel_proxy", "fig16", "numel and FLOPs costs give the same optimizer time to ~1e-4 s", dp=16, tp=8),
)


def figure_of(source: str) -> str:
    """``Figure 3c`` -> ``fig3``; ``Figure 10a`` -> ``fig10a``; ``Figure 8b`` -> ``fig8b``.

    Sub-panels are kept where the paper's figures split by experiment (8a/8b, 10a, 11a) and dropped
    where they are panels of one experiment (Figure 3a/3b/3c are all Figure 3)."""
    text = source.lower().removeprefix("figure").strip()
    num = "".join(ch for ch in text if ch.isdigit())
    if not num:
        return source
    suffix = text[len(num):].strip()
    return f"fig{num}" if num in ("3", "4", "6", "7", "9", "12", "13", "14", "16") else f"fig{num}{suffix}"


_TRENDS = {t.key: t for t in PAPER_TRENDS}
_BY_KEY = {v.key: v for v in PAPER_VALUES}
if len(_BY_KEY) != len(PAPER_VALUES) or len(_TRENDS) != len(PAPER_TRENDS):  # pragma: no cover - guards edits
    raise RuntimeError("duplicate key in PAPER_VALUES or PAPER_TRENDS")


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


def paper_trend(key: str) -> PaperTrend:
    """The trend called ``key``; a KeyError lists the known keys."""
    try:
        return _TRENDS[key]
    except KeyError:
        raise KeyError(f"no paper trend {key!r}; known: {', '.join(sorted(_TRENDS))}") from None


def paper_trends(figure: str | None = None) -> tuple[PaperTrend, ...]:
    """Trends of one figure key (``fig8a``), or all of them."""
    return tuple(t for t in PAPER_TRENDS if figure is None or t.figure == figure)
