"""Train a Hugging Face transformers model with canzona under torchrun (no download: tiny config).

    torchrun --nproc-per-node 2 examples/train_hf.py --dp 2 --tp 1          # ZeRO-1 DP
    torchrun --nproc-per-node 2 examples/train_hf.py --dp 1 --tp 2          # transformers' TP plan
    torchrun --nproc-per-node 4 examples/train_hf.py --dp 2 --tp 2 --arch llama

Order that matters: shard the model (transformers' own TP plan), build the optimizer, then train.
transformers registers its q/k-norm gradient all-reduce at the first forward, after canzona's
hooks; canzona takes each gradient only after every other hook on that parameter has run.
Rank 0 prints the DP-mean loss once per step. Needs ``pip install transformers``.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import canzona
from canzona.config import load_model_config
from canzona.hf import apply_tp_plan, hf_config
from canzona.models.data import batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=("qwen3", "llama"), default="qwen3")
    ap.add_argument("--model", default="qwen3-tiny", help="canzona model config giving the sizes (default: qwen3-tiny)")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: WORLD_SIZE / tp)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--strategy", default="lb-asc")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8, help="global batch in sequences")
    ap.add_argument("--seq-len", type=int, default=32)
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = "cuda" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    try:
        dp = args.dp or world // args.tp
        if dp * args.tp != world:
            raise SystemExit(f"dp*tp = {dp}*{args.tp} must equal the number of processes ({world})")
        mesh = init_device_mesh(device, (dp, args.tp), mesh_dim_names=("dp", "tp"))
        cfg = load_model_config(args.model)
        torch.manual_seed(0)  # every rank builds the same weights; TP sharding keeps each rank's slice
        import transformers

        cls = transformers.Qwen3ForCausalLM if args.arch == "qwen3" else transformers.LlamaForCausalLM
        model = cls(hf_config(cfg, args.arch)).to(device)
        if args.tp > 1:
            apply_tp_plan(model, mesh["tp"])
        opt = canzona.DistributedOptimizer(
            model, "muon", strategy=args.strategy, mesh=mesh, optimizer_kwargs={"lr": 0.02}, elementwise_kwargs={"lr": 3e-3}
        )
        dp_rank = mesh["dp"].get_local_rank()
        for step in range(args.steps):
            input_ids, labels = batch(step, dp_rank, dp, args.batch_size, args.seq_len, 0, vocab=cfg.vocab_size)
            out = model(input_ids=input_ids.to(device))
            loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), labels.to(device).flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            shown = loss.detach().clone()
            dist.all_reduce(shown, group=mesh["dp"].get_group())
            if dist.get_rank() == 0:
                print(f"step {step + 1}/{args.steps} loss {float(shown) / dp:.4f}", flush=True)
        # Let every rank's gloo worker threads finish with the last collectives before the group
        # goes: a worker that still holds a finished collective's tensors when the interpreter
        # shuts down aborts the process (torch's gloo backend frees them on its own thread).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
