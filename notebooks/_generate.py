"""Write the notebooks in this directory from the cell lists below (no outputs, stable cell ids).

    .venv/bin/python notebooks/_generate.py          # rewrite the .ipynb files
    .venv/bin/python notebooks/_generate.py --check  # exit 1 if a committed notebook differs

Notebooks only choose inputs and display what canzona.viz returns; every piece of logic lives in
the library (tested in tests/test_viz.py). tests/test_notebooks.py runs each notebook headless and
checks that the committed files equal what this script writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def md(text: str) -> tuple[str, str]:
    return ("markdown", text.strip("\n"))


def code(text: str, *, parameters: bool = False) -> tuple[str, str, bool]:
    return ("code", text.strip("\n"), parameters)


PARTITION = [
    md("""
# 1. Partition maps: who updates which parameter (DP, Section 3)

ZeRO-1 cuts every gradient bucket into equal chunks, one per DP rank, blind to tensor boundaries.
A matrix optimizer needs whole tensors, so canzona moves each bucket's cut points onto parameter
boundaries (static partitioning, `asc`) and chooses them to balance the load across ranks
(alpha-balanced partitioning, Algorithm 1, `lb-asc`). This notebook draws the result.

* **Partition map**: each bucket is a bar over its elements; segments are coloured by the DP rank
  that updates them. Hover a segment for the parameter's name, shape and element range.
* **Per-rank loads**: optimizer FLOPs and memory per DP rank, the mean dashed, and the load-balance
  ratio R_LB = max / mean in the titles (Figure 3c of the paper).

Change the controls to plan another configuration; plans take milliseconds. All logic lives in
`canzona.viz` (tested); this notebook only picks inputs.
"""),
    code("""
# Parameters (edit, or inject with papermill-style tools)
from canzona.plan.plan import DEFAULT_FLOPS_SHAPE

MODEL = "qwen3-32b"
DP, TP = 32, 8
OPTIMIZER = "muon"
FLOPS_SHAPE = DEFAULT_FLOPS_SHAPE  # "full" (the work a host does); "local" is the paper's accounting
""", parameters=True),
    code("""
import warnings

import pandas as pd
from IPython.display import display

from canzona import viz
from canzona.plan import plan_model
from canzona.viz import widgets as vw

viz.use_notebook_renderer()  # figures also as HTML: they survive nbconvert, nbviewer
pd.set_option("display.precision", 3)
"""),
    md("""
## One plan, every input a control

`strategy`: `zero1` (equal chunks, cuts tensors: the AdamW reference), `sc` (every rank updates
everything), `layerwise` (NV-layerwise: whole parameters by LPT, ownership interleaves inside
buckets), `asc` (cuts on boundaries, no balancing), `lb-asc` (Algorithm 1) and `lb-asc-joint`
(canzona's planner beyond the paper: FLOPs and memory balanced together, element-wise tensors
divisible). `memory view`: optimizer-state bytes, or buffer elements (what the paper calls memory).
"""),
    code("""
vw.partition_explorer(model=MODEL, dp=DP, tp=TP, optimizer=OPTIMIZER, flops_shape=FLOPS_SHAPE, strategy="lb-asc")
"""),
    md("""
## zero1 vs asc vs lb-asc vs layerwise, side by side

Same model and mesh, four strategies, with the same defaults as the explorer above. The diamonds
in the second figure are the paper's Figure 3 values (Qwen3-32B DP32 x TP8); the paper counts
FLOPs on TP-local shard shapes and memory as buffer elements, so its FLOPs diamonds appear only
when `flops shape` is `local` (set `FLOPS_SHAPE = "local"` above, or change the control).
"""),
    code("""
vw.strategy_explorer(model=MODEL, dp=DP, tp=TP, optimizer=OPTIMIZER, flops_shape=FLOPS_SHAPE, strategies=("zero1", "asc", "lb-asc", "layerwise"))
"""),
    md("""
The same numbers as a table, with canzona's joint planner added and the paper's values where it
reports them (`paper_*` columns; NaN where it does not):
"""),
    code("""
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # oversized micro-group tasks: see notebook 2
    plans = {s: plan_model(MODEL, dp=DP, tp=TP, optimizer=OPTIMIZER, strategy=s, flops_shape=FLOPS_SHAPE)
             for s in ("zero1", "asc", "lb-asc", "lb-asc-joint", "layerwise")}
viz.strategy_summary(list(plans.values()))
"""),
    md("""
## A closer look at a few buckets

ZeRO-1's equal chunks split tensors (hover the two-coloured parameters); `lb-asc` keeps every
matrix whole and moves the cuts instead. Shown: the first six buckets of the buffer (the last
layers, since the buffer is filled in reverse registration order).
"""),
    code("""
for s in ("zero1", "lb-asc"):
    display(viz.fig_partition_map(plans[s], buckets=range(6)))
"""),
    md("""
At DP32 the legend lists every rank: click a rank to hide it, double-click to show it alone. To
follow a few ranks through the whole buffer, colour only those (the others turn grey):
"""),
    code("""
viz.fig_partition_map(plans["lb-asc"], ranks=[0, 1, DP - 1])
"""),
    code("""
pieces = viz.ownership_pieces(plans["zero1"])
print(f"zero1 cuts {int((~pieces['whole']).groupby(pieces['param']).any().sum())} of {pieces['param'].nunique()} parameters; "
      f"lb-asc cuts {int((~viz.ownership_pieces(plans['lb-asc'])['whole']).sum())}")
"""),
    md("""
## Mixture of experts: experts grouped per stack

An `(E, M, N)` expert stack is E independent matrix tasks; `lb-asc` may cut a stack between
experts, never inside one. With 128 experts per layer a map per expert would be unreadable, so
experts stay grouped: one partition-map segment per (stack, owner) whose hover names its experts
(`experts 0-16 of 128`), one table row per stack, and one heatmap row per stack (experts per DP
rank; hover a cell for the indices). Qwen3-30B-A3B: 48 layers, two stacks of 128 experts each.
"""),
    code("""
MOE_MODEL = "qwen3-30b-a3b"
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    moe = plan_model(MOE_MODEL, dp=DP, tp=1, optimizer=OPTIMIZER, strategy="lb-asc")
display(viz.expert_groups(moe).head(4))
viz.fig_expert_groups(moe)
"""),
]

MICROGROUPS = [
    md("""
# 2. Micro-group makespans (TP, Section 4, Algorithm 2)

Under tensor parallelism each TP-split matrix is a *task*: one host TP rank gathers the full
gradient (one fused all-to-all per micro-group), runs the optimizer on the whole tensor and sends
the updated shards back. Algorithm 2 packs tasks into micro-groups whose per-host gradient volume
stays under C_max, assigning hosts by LPT inside each group.

* **Gantt chart**: one row per host TP rank, one bar per task, coloured by micro-group, for one DP
  rank (by default the one whose schedule shows the plan's character: the busiest GPU's DP rank
  among those with more than one micro-group). A group with a single task says why on the figure
  (its gathered gradient alone exceeds C_max). `sync` timeline: groups run one after the other,
  each as long as its busiest host; `free`: hosts run through their tasks without waiting.
* **TP host loads**: each TP rank's whole optimizer load (including the element-wise and replicated
  work every TP rank does) with R_LB in the title.
* **Load over all GPUs**: every GPU of the mesh (DP x TP) in mesh order, with the mean and the
  atomic lower bound (largest task / mean): no schedule can go below it while matrices stay whole.

Bar lengths are optimizer work in GFLOP (multiply-adds) on the shape the host processes;
communication is the simulator's business (last section).
"""),
    code("""
# Parameters
MODEL = "qwen3-32b"
DP, TP = 32, 8
OPTIMIZER = "muon"
""", parameters=True),
    code("""
import warnings

import pandas as pd
from IPython.display import display

from canzona import viz
from canzona.plan import plan_model
from canzona.viz import widgets as vw

viz.use_notebook_renderer()  # figures also as HTML: they survive nbconvert, nbviewer
pd.set_option("display.precision", 3)
"""),
    code("""
vw.microgroup_explorer(model=MODEL, dp=DP, tp=TP, optimizer=OPTIMIZER, strategy="lb-asc", tp_schedule="lpt-carry", cmax=512)
"""),
    md("""
## Makespans and TP ratios of every DP rank

`makespan_*` in FLOPs (multiply-adds) of TP-split matrix tasks; `tp_*_ratio` over the rank's whole
optimizer load. Compare the paper's Algorithm 2 (`lpt`, every group's heap starts from zero) with
canzona's `lpt-carry` (ties broken by the load carried from earlier groups) and the ASC baseline
(`round-robin`).
"""),
    code("""
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    schedules = {s: plan_model(MODEL, dp=DP, tp=TP, optimizer=OPTIMIZER, strategy="lb-asc", tp_schedule=s)
                 for s in ("lpt", "lpt-carry", "round-robin", "no-fuse")}
pd.DataFrame({s: viz.microgroup_summary(p).max() for s, p in schedules.items()}).T.rename_axis("TP schedule (max over DP ranks)")
"""),
    md("""
## Sweep over C_max, including no-fuse (Appendix C.6, Figure 14)

The paper's fusion ablation ran Qwen3-32B on DP16 x TP8. A larger C_max means fewer, larger
micro-groups (fewer all-to-alls); `no-fuse` sends every task on its own. The vertical line marks
where the paper's measured optimizer time plateaus (~512; the paper's "MB" are canzona's C_max unit,
2^20 TP-local gradient elements per host). Below ~32 a Qwen3-32B fc1 no longer fits a group.
"""),
    code("""
cmax = viz.cmax_sweep(MODEL, dp=16, tp=TP, optimizer=OPTIMIZER, cmax=(4, 8, 16, 32, 64, 128, 512, 2048))
display(cmax)
viz.fig_cmax_sweep(cmax)
"""),
    md("""
## Sweep over TP size (Appendix C.3, Figure 8b)

The DP partition stays `lb-asc`; only the TP schedule changes.
"""),
    code("""
tps = viz.tp_sweep(MODEL, dp=DP, tps=(2, 4, 8), optimizer=OPTIMIZER, schedules=("round-robin", "lpt", "lpt-carry", "no-fuse"))
display(tps)
viz.fig_tp_sweep(tps)
"""),
    md("""
## Predicted optimizer time against C_max (simulator)

The simulator (`canzona.sim`) turns the same plans into seconds on a hardware profile
(H800-class by default; every assumption is a named constant in `canzona.sim`). The paper's
measured values are drawn beside the prediction: no-fuse ~0.11 s, fused ~0.073 s.
"""),
    code("""
from canzona.viz import simulation as vsim

cmax_time = vsim.simulate_cmax((4, 8, 16, 32, 64, 128, 512, 2048), model=MODEL, dp=16, tp=TP, optimizer=OPTIMIZER)
display(cmax_time[["cmax", "tp_schedule", "optimizer_s", "opt_matrix_compute_s", "opt_tp_comm_s", "n_micro_groups"]])
vsim.fig_cmax_time(cmax_time)
"""),
]

TIMELINES = [
    md("""
# 3. Profiler timelines

Reads a *trace summary*: a phase table (`phases.csv` or `phases.parquet`: rank, step, phase, part,
start_us, dur_us, depth) and `meta.json`, written by the profiling scripts from NVTX /
`record_function` ranges (phase names are those of `canzona.phase_names`). By default it opens
your newest run under `runs/` (written by `canzona profile --tensorboard runs/<name>`; a raw trace
directory is summarised on the fly) and falls back to the sample shipped inside the package
(`canzona/data/profiles/sample/`), saying so. Runs are looked for the way every canzona view looks
for them: `runs/` of the working directory and of its parent, or `$CANZONA_RUNS_DIR` when set.
Set `PROFILE_DIR` to open another run.

* **Timeline**: one row per rank, one bar per phase; nested phases are thinner bars inside their
  parents. Pick the step and the nesting depth with the controls.
* **Critical path**: the optimizer step ends when its slowest rank does; that rank's child phases
  (and the gaps between them) are the path to shorten.
* **Breakdown per strategy**: phase times of every run found under `PROFILE_ROOT`, each labelled
  by the strategy its run recorded.
"""),
    code("""
# Parameters: a trace summary or raw trace directory (None: the newest run under runs/, else the
# shipped sample), and where to look for runs to compare (None: beside the chosen one)
PROFILE_DIR = None
PROFILE_ROOT = None
""", parameters=True),
    code("""
import pandas as pd
from IPython.display import display

from canzona import viz
from canzona.viz import timeline as vt
from canzona.viz import widgets as vw

viz.use_notebook_renderer()  # figures also as HTML: they survive nbconvert, nbviewer
pd.set_option("display.precision", 3)
PROFILE_DIR, note = vt.resolve_profile(PROFILE_DIR)
print(note)  # which profile this notebook shows, and why (your newest run, or the shipped sample)
PROFILE_ROOT = PROFILE_DIR.parent if PROFILE_ROOT is None else PROFILE_ROOT
profile = vt.load_profile(PROFILE_DIR)
print(profile.label, "|", len(profile.phases), "phase records,", profile.phases["rank"].nunique(), "ranks,",
      profile.phases["step"].nunique(), "steps")
display(profile.meta)
profile.phases.head(10)
"""),
    code("""
vw.timeline_explorer(profile)
"""),
    md("""
## Where the time goes

Per step the slowest rank counts (the step waits for it); the mean over steps is shown. Outermost
phases first, then one level down (the parts of the optimizer step and of the communication).
"""),
    code("""
display(vt.phase_breakdown(profile.phases, depth=0))
vt.phase_breakdown(profile.phases, depth=1)
"""),
    code("""
cp = vt.optimizer_critical_path(profile.phases)
print(f"critical rank {cp.attrs['critical_rank']} in step {cp.attrs['step']}: {cp.attrs['total_us'] / 1e3:.3f} ms; "
      f"{(cp['kind'] == 'gap').sum()} gaps between child phases ({cp.loc[cp['kind'] == 'gap', 'dur_us'].sum() / 1e3:.3f} ms)")
cp[["segment", "kind", "start_us", "dur_us"]]
"""),
    md("""
The profiling package's own per-step summaries of the same table (`canzona.profiling.traces`):
iteration, fwd-bwd and optimizer-step makespans and exposed communication per step; the critical
rank's optimizer time split by child phase and stage (`launch` issues an asynchronous collective,
`wait` blocks until it lands; `kind`: compute, comm or other) with its share; and per
communication phase the time ranks were blocked on it (`exposed_us`) and the time it ran while
they worked (`hidden_us`).
"""),
    code("""
from canzona.profiling import comm_exposure, critical_path, step_makespans

display(step_makespans(profile.phases))
display(critical_path(profile.phases).style.format({"share": "{:.1%}"}))
comm_exposure(profile.phases)
"""),
    md("""
## Phase breakdown per strategy

Every profile found under `PROFILE_ROOT`, labelled by the strategy its run recorded (`meta.json`
or `run.json`); folders that recorded none are not strategies and are left out, and a run's raw
traces beside its own summary count once.
"""),
    code("""
runs = vt.discover_profiles(PROFILE_ROOT)
if not runs:  # PROFILE_DIR may live outside PROFILE_ROOT
    runs = {profile.meta.get("strategy", "run"): PROFILE_DIR}
print({k: str(v) for k, v in runs.items()})
breakdown = vt.breakdown_by_strategy({k: vt.load_profile(v) for k, v in runs.items()})
viz.fig_phase_breakdown(breakdown)
"""),
    md("""
## Loss of several runs

`canzona train` logs every run's loss and phase times under `runs/` (`metrics.csv`, plus
TensorBoard scalars when tensorboard is installed); `canzona profile` logs beside its traces.
Every run found there is drawn on one chart (exact strategies coincide, drawn dashed over each
other). Try `canzona train --steps 20 --strategy sc` and `... --strategy lb-asc`, then rerun.
"""),
    code("""
loss_runs = viz.discover_runs()
if loss_runs:
    display(viz.fig_loss_curves(loss_runs))
else:
    print("no metrics logs under runs/ yet: run `canzona train` (it logs there by default)")
"""),
]

SCALING = [
    md("""
# 4. Scaling studies with the planner (Appendix C.3, C.5, D.5)

The paper's scaling studies redone with canzona's planner at the paper's own configurations: DP 16
to 128 at TP4 (Figure 8a), TP 2 to 8 at DP4 (Figure 8b, whose PP4 stages `canzona reproduce fig8b`
plans one by one), Qwen3 1.7B to 32B at DP16 x TP4 (Figure 9), alpha 0 to 1 at DP16 (Figure 13,
PP8 x TP1) and numel vs FLOPs at DP16 x TP8 (Figure 16). Open black diamonds are the paper's
reported values, drawn only where a row is the configuration the paper measured. Where the paper
only states a trend, the table under each study (`canzona.reproduce`, the same rows as
`canzona reproduce FIG`) puts the paper's claim beside ours with a verdict.

FLOPs are counted on full shapes by default (`FLOPS_SHAPE = "full"`, the work a host really does
after the micro-group gather, as everywhere in canzona); set `FLOPS_SHAPE = "local"` for the
paper's accounting on TP-local shards.
"""),
    code("""
# Parameters
from canzona.plan.plan import DEFAULT_FLOPS_SHAPE

MODEL = "qwen3-32b"
DP, TP = 32, 8
OPTIMIZER = "muon"
FLOPS_SHAPE = DEFAULT_FLOPS_SHAPE
STRATEGIES = ("asc", "lb-asc", "lb-asc-joint", "layerwise")
""", parameters=True),
    code("""
import pandas as pd
from IPython.display import display

from canzona import viz
from canzona.reproduce import reproduce
from canzona.viz import scaling as vs
from canzona.viz import simulation as vsim

viz.use_notebook_renderer()  # figures also as HTML: they survive nbconvert, nbviewer
pd.set_option("display.precision", 3)
vs.paper_table()[["key", "value", "unit", "source", "config", "ablation", "note"]]
"""),
    md("## DP 16 to 128 (Figure 8a)"),
    code("""
# Figure 8a: Qwen3-32B, TP4, DP 16..128
dp_scaling = viz.plan_sweep(models=(MODEL,), dps=(16, 32, 64, 128), tps=(4,), strategies=STRATEGIES,
                            optimizer=OPTIMIZER, flops_shape=FLOPS_SHAPE)
display(dp_scaling[["dp", "strategy", "dp_flops_ratio", "dp_numel_ratio", "dp_memory_ratio", "comm_balance", "plan_ms"]])
display(reproduce("fig8a").frame())
viz.fig_sweep(dp_scaling, x="dp", log_x=True, metrics=("dp_flops_ratio", "dp_numel_ratio", "dp_memory_ratio"),
              title=f"DP scaling of load balance: {MODEL}, {OPTIMIZER}, TP4")
"""),
    md("## TP 2 to 8 (Figure 8b)"),
    code("""
# Figure 8b: Qwen3-32B, DP4, TP 2..8 (the paper adds PP4: see reproduce("fig8b") for the per-stage plans)
tp_scaling = viz.plan_sweep(models=(MODEL,), dps=(4,), tps=(2, 4, 8), strategies=("asc", "lb-asc"),
                            optimizer=OPTIMIZER, flops_shape=FLOPS_SHAPE)
display(reproduce("fig8b").frame())
viz.fig_sweep(tp_scaling, x="tp", log_x=True, metrics=("tp_flops_ratio", "tp_memory_ratio"),
              title=f"TP scaling of load balance: {MODEL}, {OPTIMIZER}, DP4 (asc: round-robin hosts; lb-asc: Algorithm 2)")
"""),
    md("## Qwen3 1.7B to 32B (Figure 9)"),
    code("""
# Figure 9: DP16 x TP4
model_scaling = viz.plan_sweep(models=viz.SCALING_MODELS, dps=(16,), tps=(4,), strategies=STRATEGIES,
                               optimizer=OPTIMIZER, flops_shape=FLOPS_SHAPE)
display(reproduce("fig9").frame())
viz.fig_sweep(model_scaling, x="params_b", log_x=True, metrics=("dp_flops_ratio", "dp_numel_ratio", "tp_flops_ratio"),
              title=f"Model-size scaling of load balance: Qwen3 1.7B..32B, {OPTIMIZER}, DP16 x TP4")
"""),
    md("""
## alpha from 0 to 1 (Appendix C.5, Figure 13)

alpha = 0 asks Algorithm 1 for equal shards (communication balance), alpha = 1 for balanced
compute. The right panel shows what alpha trades away: the largest shard of the worst bucket
relative to the mean shard (the reduce-scatter / all-gather straggler).
"""),
    code("""
# Figure 13: DP16 (the paper adds PP8 with TP1: reproduce("fig13") simulates the stages under 1F1B)
alpha = viz.plan_sweep(models=(MODEL,), dps=(16,), tps=(1,), strategies=("lb-asc",), alphas=[i / 10 for i in range(11)],
                       optimizer=OPTIMIZER, flops_shape=FLOPS_SHAPE)
display(reproduce("fig13").frame())
viz.fig_alpha_tradeoff(alpha)
"""),
    md("""
What the trade-off costs in time, predicted by the simulator: the optimizer step and iteration
per alpha, and the DP communication left exposed beside what ZeRO-1's equal chunks expose.
"""),
    code("""
vsim.fig_alpha_time(vsim.simulate_alpha(model=MODEL, dp=DP, tp=TP, optimizer=OPTIMIZER))
"""),
    md("""
## numel vs FLOPs as the planner's cost (Appendix D.5, Figure 16)

The paper plans with W(p) = numel and reports that planning with exact FLOPs changes the
optimizer step by ~0.1 ms (0.0718 s vs 0.0717 s). Balance reached with each cost model:
"""),
    code("""
# Figure 16: DP16 x TP8
costs = viz.plan_sweep(models=(MODEL,), dps=(16,), tps=(8,), strategies=("lb-asc", "layerwise"), costs=("numel", "flops", "memory"),
                       optimizer=OPTIMIZER, flops_shape=FLOPS_SHAPE)
display(reproduce("fig16").frame())
viz.fig_cost_models(costs)
"""),
    md("""
## Shampoo and SOAP (Appendix C.4, Figures 10a, 11a, 12)

Qwen3-14B at PP2 x DP32 x TP4, the paper's configuration: each pipeline stage planned on its own,
the optimizer step simulated per stage (the slowest stage sets it), the load balance under the
paper convention. `canzona reproduce fig10a` prints the same rows.
"""),
    code("""
for key in ("fig10a", "fig11a", "fig12"):
    fig = reproduce(key)
    print(f"{fig.title} [{fig.config}]")
    display(fig.frame())
"""),
    md("""
## Predicted times (simulator)

`canzona.sim` predicts forward+backward, optimizer step and iteration time per strategy from the
plans, the model shapes and a hardware profile (H800-class by default, the likely class of the
paper's cluster; every assumption is a named constant in `canzona.sim`). The paper's measured
Figure 4 times sit beside the prediction for its configuration.
"""),
    code("""
breakdown = vsim.simulate_breakdown(MODEL, dp=DP, tp=TP, optimizer=OPTIMIZER)
display(breakdown[["strategy", "fwd_bwd_s", "optimizer_s", "iteration_s", "opt_critical_rank", "opt_rank_imbalance"]])
display(vsim.fig_time_breakdown(breakdown))
vsim.fig_time_components(vsim.simulate_components(MODEL, dp=DP, tp=TP, optimizer=OPTIMIZER))
"""),
    md("""
The simulator's own comparison with Figure 4 (always at the paper's configuration): predicted and
measured seconds, the layerwise / lb-asc ratios, and the single assumption that moves each ratio
most when changed (every hardware constant -20 %, every named setup alternative).
"""),
    code("""
vsim.paper_comparison_table()
"""),
    code("""
dp_time = vsim.simulate_sweep("dp", (16, 32, 64, 128), model=MODEL, tp=4, optimizer=OPTIMIZER)  # Figure 8a: TP4
vsim.fig_time_sweep(dp_time)
"""),
    code("""
# Figure 6: the family at DP16 x TP8
model_time = vsim.simulate_sweep("model", ("qwen3-1.7b", "qwen3-8b", "qwen3-14b", "qwen3-32b"), dp=16, tp=8, optimizer=OPTIMIZER)
model_time.attrs["model"] = "Qwen3 family"
vsim.fig_time_sweep(model_time)
"""),
    code("""
vsim.fig_cost_time(vsim.simulate_costs(("numel", "flops", "memory"), model=MODEL, dp=16, tp=8, optimizer=OPTIMIZER))  # Figure 16
"""),
]

EXACTNESS = [
    md("""
# 5. Exactness

`canzona validate` runs every (optimizer, strategy, mesh, dtype) cell of the exactness suite and
compares the distributed update with the single-device optimizer bit for bit (`torch.equal`); the
report also records the training loss per step of each strategy. This notebook reads your newest
report (`canzona validate` writes `runs/validation/<time>/report.json`; runs are looked for in
`runs/` of the working directory and of its parent, or `$CANZONA_RUNS_DIR`), else the sample
shipped inside the package (`canzona/data/validation-sample/report.json`) with a note saying
so; set `REPORT` to read another, or `RUN_VALIDATION = True`
to run the suite from here with `validation.run` (the Python API behind `canzona validate`; it
takes your own optimizer as a class or an import path, and spawns worker processes).
"""),
    code("""
# Parameters: a report.json (None: your newest run's, else the shipped sample)
REPORT = None
RUN_VALIDATION = False
""", parameters=True),
    code("""
import pandas as pd
from IPython.display import display

from canzona import viz
from canzona.viz import exactness as ve

viz.use_notebook_renderer()  # figures also as HTML: they survive nbconvert, nbviewer
pd.set_option("display.precision", 3)
if RUN_VALIDATION:
    import validation

    print("validation report: the run just made here (validation.run)")
    report = validation.run("muon", meshes=["dp2"], strategies=["sc", "lb-asc"]).report
else:
    REPORT, note = ve.resolve_report(REPORT)
    print(note)  # which report this notebook shows, and why (your newest run, or the shipped sample)
    report = ve.load_validation_report(REPORT)
print(report["summary"])
viz.fig_validation_matrix(report)
"""),
    md("All cells, failures first (`max_abs_diff` is 0 for a passing cell):"),
    code("""
ve.validation_table(report)
"""),
    md("""
## Loss trajectories per strategy

Exact strategies produce the same loss as the reference (`sc`) at every step; the lower panel
shows the difference, which sits on zero when they agree bit for bit. One figure per
(optimizer, mesh, dtype) of the training cells; `single process` is the one-process run the `sc`
cell is compared with (not bitwise: the reason is in the table above).
"""),
    code("""
views = ve.loss_views(report)
if not views:
    print("this report carries no loss trajectories (no training cells were run)")
for label, deviation, fig in views:
    print(label)
    display(deviation, fig)
"""),
]

NOTEBOOKS: dict[str, list] = {
    "01_partition_maps.ipynb": PARTITION,
    "02_micro_groups.ipynb": MICROGROUPS,
    "03_profiler_timelines.ipynb": TIMELINES,
    "04_scaling.ipynb": SCALING,
    "05_exactness.ipynb": EXACTNESS,
}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook ``name`` as this script defines it."""
    stem = name.removesuffix(".ipynb")
    cells = []
    for i, spec in enumerate(NOTEBOOKS[name]):
        if spec[0] == "markdown":
            cell = new_markdown_cell(spec[1])
        else:
            cell = new_code_cell(spec[1])
            if spec[2]:
                cell.metadata["tags"] = ["parameters"]
        cell["id"] = f"{stem[:2]}-{i:02d}"
        cells.append(cell)
    nb = new_notebook(cells=cells, metadata={"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}})
    nb.nbformat, nb.nbformat_minor = 4, 5
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name)) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name in NOTEBOOKS:
        path = HERE / name
        text = render(name)
        if check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print("out of date (run notebooks/_generate.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
