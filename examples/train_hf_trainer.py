"""Train a tiny Hugging Face model with ``canzona.hf.Trainer`` under torchrun (nothing downloaded).

    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --out runs/hf_trainer
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --out runs/hf_trainer --resume runs/hf_trainer/checkpoint-2

``transformers.Trainer`` as usual (clipping at ``max_grad_norm``, a cosine schedule, gradient
accumulation, checkpoints every 2 steps) with canzona's Muon + AdamW under ZeRO-1 (``lb-asc``);
the model is not wrapped in DDP: canzona reduces the gradients. Needs ``transformers`` and
``accelerate`` (the dev extra). On CPU it runs on gloo.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import canzona.hf
from canzona.config import load_model_config
from canzona.hf import hf_config


class Tokens(torch.utils.data.Dataset):
    """Random fixed-length token sequences (labels = inputs; the model shifts them)."""

    def __init__(self, vocab: int, n: int = 64, seq: int = 32) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/hf_trainer")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--resume", default=None, help="a checkpoint-N folder of an earlier run")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(hf_config(load_model_config("qwen3-tiny")))
    training = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=1, save_strategy="steps", save_steps=2,
        logging_steps=1, report_to=[], use_cpu=not torch.cuda.is_available(), ddp_backend=None if torch.cuda.is_available() else "gloo",
    )
    trainer = canzona.hf.Trainer(
        model=model, args=training, train_dataset=Tokens(model.config.vocab_size),
        optimizer="muon", strategy="lb-asc", optimizer_kwargs={"lr": 0.02}, elementwise_kwargs={"lr": 3e-3},
    )
    trainer.train(resume_from_checkpoint=args.resume)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
