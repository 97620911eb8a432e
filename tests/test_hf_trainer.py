"""``canzona.hf.Trainer`` under torchrun (2 processes, gloo, CPU) against ``transformers.Trainer``
with DDP and ``torch.optim.Muon`` (matrices) + ``torch.optim.AdamW`` (the rest), on a tiny Llama and
the tiny Qwen3 built from small configs (nothing downloaded).

This file is both the pytest module and the torchrun script: one launch runs every case (see
:func:`main`) and writes one JSON file per rank; a module-scoped fixture launches it once and each test
reads its own case. Cases, per model: parameters bitwise equal without clipping (and the logged
``grad_norm`` equal), with clipping (``grad_norm`` equal bit for bit: the true norm, not 0), with
gradient accumulation; a run resumed from a ``save_steps`` checkpoint bitwise equal to the
uninterrupted one; and a plain ``transformers.Trainer`` handed canzona's optimizer under DDP fails
on every rank, naming ``canzona.hf.Trainer``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama", "qwen3")
MUON_KW = {"lr": 0.02, "weight_decay": 0.0}
ADAMW_KW = {"lr": 3e-3, "weight_decay": 0.1}
STEPS = 3


# ============================================================================ the torchrun script
def _model(arch: str):
    import torch
    import transformers

    from canzona.config import load_model_config
    from canzona.hf import hf_config

    if arch == "qwen3_moe":
        # transformers' own MoE: 3-D expert stacks (E, 2F, H) and (E, H, F), each expert a task
        # (sides multiple of 4: transformers' grouped_mm expert kernel needs 16-byte strides)
        cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                          max_position_embeddings=64, attn_implementation="eager")
        torch.manual_seed(0)
        return transformers.Qwen3MoeForCausalLM(cfg).float()
    cfg = hf_config(load_model_config("qwen3-tiny"), arch, attn_implementation="eager")
    torch.manual_seed(0)
    cls = transformers.Qwen3ForCausalLM if arch == "qwen3" else transformers.LlamaForCausalLM
    return cls(cfg).float()


class _Data:
    """Fixed-length token sequences (labels = inputs; the model shifts them)."""

    def __init__(self, vocab: int, n: int = 32, seq: int = 12) -> None:
        import torch

        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _routed(model):
    """The DDP baseline's optimizer: torch's Muon on the matrices, AdamW on the rest, routed by
    canzona's default role rule, the biases and norm weights without weight decay as
    transformers.Trainer groups them; one torch Optimizer so the Trainer's scheduler drives both."""
    import torch
    import transformers

    from canzona.specs import is_matrix_param

    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    mat = [p for n, p in model.named_parameters() if is_matrix_param(n, p.shape)]
    ew = [(n, p) for n, p in model.named_parameters() if not is_matrix_param(n, p.shape)]
    groups = [{"params": [p for n, p in ew if n in decay]}, {"params": [p for n, p in ew if n not in decay], "weight_decay": 0.0}]

    class Routed(torch.optim.Optimizer):
        def __init__(self) -> None:
            self.parts = [torch.optim.Muon(mat, **MUON_KW), torch.optim.AdamW([g for g in groups if g["params"]], **ADAMW_KW)]
            # torch's bookkeeping (hooks, state) only: the groups are the parts' own (see below)
            super().__init__([torch.zeros(1, requires_grad=True)], {})

        # the parts' current groups: a scheduler edits them, and a load_state_dict of a part (which
        # accelerate's prepare does) replaces them, so they are never copied
        @property
        def param_groups(self):
            return [g for o in self.parts for g in o.param_groups]

        @param_groups.setter
        def param_groups(self, _value) -> None:
            pass

        def step(self, closure=None):
            for o in self.parts:
                o.step()

        def zero_grad(self, set_to_none: bool = True) -> None:
            for o in self.parts:
                o.zero_grad(set_to_none)

        def state_dict(self):
            return {"parts": [o.state_dict() for o in self.parts]}

        def load_state_dict(self, sd):
            for o, s in zip(self.parts, sd["parts"]):
                o.load_state_dict(s)

    return Routed()


def _args(out: str, **kw):
    import transformers

    base = dict(output_dir=out, per_device_train_batch_size=2, max_steps=STEPS, use_cpu=True, ddp_backend="gloo",
                report_to=[], logging_steps=1, save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True,
                lr_scheduler_type="cosine", warmup_steps=1, learning_rate=1.0, max_grad_norm=0.0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _norms(trainer) -> list:
    return [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]


def _run(kind: str, arch: str, out: str, resume: str | None = None, roles: dict | None = None, **kw) -> tuple[dict, list]:
    import transformers

    import canzona.hf

    model = _model(arch)
    data = _Data(model.config.vocab_size)
    if kind == "canzona":
        import torch

        trainer = canzona.hf.Trainer(model=model, args=_args(out, **kw), train_dataset=data, optimizer=torch.optim.Muon,
                                     strategy="lb-asc", optimizer_kwargs=MUON_KW, elementwise_kwargs=ADAMW_KW)
    else:
        trainer = transformers.Trainer(model=model, args=_args(out, **kw), train_dataset=data, optimizers=(_routed(model), None))
    trainer.train(resume_from_checkpoint=resume)
    if roles is not None:  # the role of every parameter, as the optimizer's plan routed it
        from canzona.plan.describe import role_rows

        roles.update({row.name: row.role for row in role_rows(trainer.canzona_optimizer.plan)})
    return _params(model), _norms(trainer)


def _diff(a: dict, b: dict) -> list[str]:
    import torch

    return [n for n in a if not torch.equal(a[n], b[n])]


def _case_compare(arch: str, out: str, **kw) -> dict:
    got, norms = _run("canzona", arch, os.path.join(out, "c"), **kw)
    want, ddp_norms = _run("ddp", arch, os.path.join(out, "d"), **kw)
    return {"mismatch": _diff(got, want), "grad_norms": norms, "ddp_grad_norms": ddp_norms}


def _case_resume(arch: str, out: str) -> dict:
    roles: dict = {}
    full, full_norms = _run("canzona", arch, os.path.join(out, "full"), max_steps=4, max_grad_norm=0.5, roles=roles)
    ck = os.path.join(out, "ck")
    _run("canzona", arch, ck, max_steps=4, max_grad_norm=0.5, save_strategy="steps", save_steps=2)
    resumed, norms = _run("canzona", arch, ck, resume=os.path.join(ck, "checkpoint-2"), max_steps=4, max_grad_norm=0.5)
    return {"mismatch": _diff(resumed, full), "files": sorted(os.listdir(os.path.join(ck, "checkpoint-2"))), "norms": norms,
            "full_norms": full_norms, "experts": sorted(n for n, r in roles.items() if r == "experts"),
            "moved": _diff(full, _params(_model(arch)))}


def _case_plain_trainer(arch: str, out: str) -> dict:
    """A plain transformers.Trainer handed canzona's optimizer under torchrun (DDP)."""
    import torch
    import transformers

    import canzona

    model = _model(arch)
    opt = canzona.DistributedOptimizer(model, torch.optim.Muon, strategy="lb-asc", optimizer_kwargs=MUON_KW,
                                       elementwise_kwargs=ADAMW_KW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    trainer = transformers.Trainer(model=model, args=_args(os.path.join(out, "p")), train_dataset=_Data(model.config.vocab_size),
                                   optimizers=(opt, sched))
    try:
        trainer.train()
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(exc).__name__}: {exc}"}


def _case_ddp_message(arch: str) -> dict:
    """canzona's optimizer over a DDP-wrapped model: the first step names canzona.hf.Trainer."""
    import torch

    import canzona

    model = _model(arch)
    opt = canzona.DistributedOptimizer(model, torch.optim.Muon, strategy="lb-asc", optimizer_kwargs=MUON_KW,
                                       elementwise_kwargs=ADAMW_KW)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ids = _Data(model.config.vocab_size).ids[:2]
    ddp(input_ids=ids, labels=ids).loss.backward()
    try:
        opt.step()
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(out: str) -> None:
    import traceback

    import torch.distributed as dist

    cases = {}
    only = os.environ.get("CANZONA_HF_TRAINER_CASES")  # a comma list, to run a few while debugging
    for arch in MODELS:
        plans = {
            "noclip": lambda a=arch: _case_compare(a, os.path.join(out, a, "noclip")),
            "clip": lambda a=arch: _case_compare(a, os.path.join(out, a, "clip"), max_grad_norm=0.5),
            "accumulate": lambda a=arch: _case_compare(a, os.path.join(out, a, "acc"), max_grad_norm=0.5, gradient_accumulation_steps=2),
            "resume": lambda a=arch: _case_resume(a, os.path.join(out, a, "resume")),
            "ddp_message": lambda a=arch: _case_ddp_message(a),
        }
        if arch == "llama":
            plans["plain_trainer"] = lambda a=arch: _case_plain_trainer(a, os.path.join(out, a, "plain"))
        for name, fn in plans.items():
            if only and f"{arch}/{name}" not in only.split(","):
                continue
            try:
                cases[f"{arch}/{name}"] = {"result": fn()}
            except Exception as exc:  # noqa: BLE001 - recorded; the test of this case fails on its own
                cases[f"{arch}/{name}"] = {"crash": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
            dist.barrier()
    # transformers' Qwen3-MoE (3-D expert stacks) through the Trainer's save_steps / resume loop
    if not only or "qwen3_moe/resume" in only.split(","):
        try:
            cases["qwen3_moe/resume"] = {"result": _case_resume("qwen3_moe", os.path.join(out, "qwen3_moe", "resume"))}
        except Exception as exc:  # noqa: BLE001 - recorded; the test of this case fails on its own
            cases["qwen3_moe/resume"] = {"crash": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
        dist.barrier()
    # one file per rank (the ranks' stdout lines interleave)
    with open(os.path.join(out, f"cases-rank{dist.get_rank()}.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f)
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        main(sys.argv[1])
    finally:
        dist.destroy_process_group()


# ============================================================================ the tests
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("hf_trainer")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__, str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    per_rank = {}
    for rank in (0, 1):
        path = out / f"cases-rank{rank}.json"
        if path.exists():
            per_rank[rank] = json.loads(path.read_text(encoding="utf-8"))
    assert sorted(per_rank) == [0, 1], f"torchrun exited {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    per_rank["stderr"] = res.stderr
    return per_rank


def test_parameters_stay_bound_to_the_optimizer(run) -> None:
    """Nothing in the Trainer's preparation replaces a parameter's storage after the optimizer
    bound it to its parameter buffer (canzona would rebind it, with this warning)."""
    assert "no longer uses the optimizer's parameter buffer" not in run["stderr"]


def _case(run: dict, name: str) -> list[dict]:
    out = []
    for rank in (0, 1):
        outcome = run[rank][name]
        assert "crash" not in outcome, f"{name} crashed on rank {rank}: {outcome['crash']}"
        out.append(outcome["result"])
    return out


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("case", ["noclip", "clip", "accumulate"])
def test_equal_to_ddp_with_torch_optimizers(run, arch: str, case: str) -> None:
    for rank, res in enumerate(_case(run, f"{arch}/{case}")):
        assert not res["mismatch"], f"{arch}/{case} rank {rank}: parameters differ from DDP + torch Muon/AdamW: {res['mismatch']}"
        assert len(res["grad_norms"]) == STEPS and res["grad_norms"] == res["ddp_grad_norms"], res
        assert all(n > 0 for n in res["grad_norms"]), res  # the true norm, not the 0 torch's clip finds
        if case != "noclip":
            assert all(n > 0.5 for n in res["grad_norms"]), f"the clip was not active: {res['grad_norms']}"


@pytest.mark.parametrize("arch", [*MODELS, "qwen3_moe"])
def test_resume_is_bitwise_uninterrupted(run, arch: str) -> None:
    for rank, res in enumerate(_case(run, f"{arch}/resume")):
        assert not res["mismatch"], f"{arch} rank {rank}: resumed run differs on {res['mismatch']}"
        assert "canzona_optimizer.pt" in res["files"] and "scheduler.pt" in res["files"], res["files"]
        # the resumed history: steps 1-2 from the checkpoint's trainer state, 3-4 run again, as uninterrupted
        assert len(res["norms"]) == 4 and res["norms"] == res["full_norms"], res
        if arch == "qwen3_moe":
            # both layers' stacks went to the matrix optimizer as experts, and training moved them
            assert len(res["experts"]) == 4 and all(".mlp.experts." in n for n in res["experts"]), res["experts"]
            assert set(res["experts"]) <= set(res["moved"]), f"experts the run left unchanged: {set(res['experts']) - set(res['moved'])}"


@pytest.mark.parametrize("arch", MODELS)
def test_ddp_wrapper_error_names_the_trainer(run, arch: str) -> None:
    for res in _case(run, f"{arch}/ddp_message"):
        assert res["error"] and "canzona.hf.Trainer" in res["error"], res


def _defaults_worker(rank: int, world: int) -> dict:
    """canzona.hf.Trainer at world 1: what reaches its optimizers from TrainingArguments, and the
    ``optim`` choices it refuses at construction."""
    import tempfile

    import torch

    import canzona.hf

    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        model = _model("llama")
        trainer = canzona.hf.Trainer(model=model, args=_args(d, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, learning_rate=2e-3,
                                                              weight_decay=0.0), train_dataset=_Data(model.config.vocab_size))
        opt = trainer.create_optimizer()
        rt = opt.runtime
        ew, mx = rt.elementwise_opt.param_groups[0], rt.matrix_opt.param_groups[0]
        out["elementwise"] = {k: ew[k] for k in ("lr", "weight_decay", "betas", "eps")}
        out["matrix"] = {k: mx[k] for k in ("lr", "weight_decay", "eps")}
        out["muon_eps_default"] = type(rt.matrix_opt)([torch.zeros(2, 2)]).param_groups[0]["eps"]
        # weight decay with element-wise arguments given: the matrices get the arguments' decay
        given = canzona.hf.Trainer(model=_model("llama"), args=_args(d, weight_decay=0.05), train_dataset=_Data(model.config.vocab_size),
                                   elementwise_kwargs={"lr": 1e-3})
        given_opt = given.create_optimizer()
        out["given_matrix_wd"] = given_opt.runtime.matrix_opt.param_groups[0]["weight_decay"]
        # transformers' exemption: the biases and norm weights in a second element-wise group without decay
        out["ew_groups"] = [(len(g["params"]), g["weight_decay"]) for g in given_opt.runtime.elementwise_opt.param_groups]
        out["exempt"] = sorted(given_opt.settings.no_weight_decay)
        out["decay_names"] = sorted(given.get_decay_parameter_names(given.model))
        # a 2-D bias (gpt-oss's expert biases are (E, N)): element-wise by default and exempt as transformers exempts it;
        # given the matrix role, the matrix optimizer updates it with its decay (the list leaves it out rather than refuse)
        for case, roles in (("bias_default", None), ("bias_matrix", {"*.stacked_bias": "matrix"})):
            m = _model("llama")
            m.model.layers[0].mlp.register_parameter("stacked_bias", torch.nn.Parameter(torch.zeros(4, 8)))
            t = canzona.hf.Trainer(model=m, args=_args(d, weight_decay=0.05), train_dataset=_Data(model.config.vocab_size),
                                  canzona_kwargs={"roles": roles})
            o = t.create_optimizer()
            out[case] = ("model.layers.0.mlp.stacked_bias" in o.settings.no_weight_decay, o.layout.role("model.layers.0.mlp.stacked_bias"))
        for case, kw in (("sgd", {"optim": "sgd"}), ("optim_args", {"optim": "adamw_torch", "optim_args": "foo=1"})):
            try:
                canzona.hf.Trainer(model=_model("llama"), args=_args(d, **kw), train_dataset=_Data(model.config.vocab_size))
                out[case] = "accepted"
            except TypeError as exc:
                out[case] = str(exc)
        canzona.hf.Trainer(model=_model("llama"), args=_args(d, optim="adamw_torch"), train_dataset=_Data(model.config.vocab_size))
    return out


def test_training_arguments_reach_adamw_and_other_optims_are_refused() -> None:
    """Without optimizer_kwargs / elementwise_kwargs, AdamW gets the arguments' learning_rate,
    weight_decay, adam_beta1/2 and adam_epsilon (as transformers.Trainer's AdamW does; betas were
    silently AdamW's defaults before), Muon only lr and weight_decay (its eps is its own);
    biases and norm weights are exempt from weight decay as transformers.Trainer exempts them;
    TrainingArguments.optim other than torch's AdamW and optim_args are refused in one line."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from canzona.runtime.launch import run_workers

    (res,) = run_workers(_defaults_worker, 1, timeout_s=120)
    assert res["elementwise"] == {"lr": 2e-3, "weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6}, res
    assert res["matrix"] == {"lr": 2e-3, "weight_decay": 0.0, "eps": res["muon_eps_default"]}, res
    assert res["given_matrix_wd"] == 0.05
    # transformers.Trainer exempts norms and biases from weight decay: so does canzona.hf.Trainer
    assert res["exempt"] and all("norm" in n or "bias" in n for n in res["exempt"]), res["exempt"]
    assert not set(res["exempt"]) & set(res["decay_names"])
    # (elementwise_kwargs={"lr": 1e-3} given: AdamW's own default weight decay, 0.01, for the rest)
    assert len(res["ew_groups"]) == 2 and res["ew_groups"][1] == (len(res["exempt"]), 0.0) and res["ew_groups"][0][1] == 0.01, res["ew_groups"]
    assert res["bias_default"] == (True, "elementwise") and res["bias_matrix"] == (False, "matrix"), (res["bias_default"], res["bias_matrix"])
    for case in ("sgd", "optim_args"):
        assert "is not what canzona.hf.Trainer runs" in res[case] and "\n" not in res[case], res[case]
    assert res["sgd"].startswith("TrainingArguments(optim='sgd')"), res["sgd"]
    assert "optim_args='foo=1'" in res["optim_args"], res["optim_args"]


def test_plain_trainer_with_canzona_optimizer_fails_on_every_rank(run) -> None:
    """It must never train: accelerate's prepare-time state round trip works on every rank
    (``state_dict()`` is per rank), DDP wraps the model and the first step raises the
    GradSyncError naming canzona.hf.Trainer, on every rank."""
    for rank, res in enumerate(_case(run, "llama/plain_trainer")):
        err = res["error"]
        assert err is not None, "a plain Trainer ran canzona's optimizer under DDP without an error"
        assert "canzona.hf.Trainer" in err, f"rank {rank}: {err}"
