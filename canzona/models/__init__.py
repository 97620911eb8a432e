"""The tiny Qwen3 and Qwen3-MoE models, the dense one's tensor parallelization and synthetic data (tests, demo, ``canzona train``)."""

from __future__ import annotations

from .data import MarkovData, batch
from .qwen3 import Qwen3, lm_loss
from .qwen3_moe import Qwen3MoE
from .tp import check_tp, hf_tp_dims, local_shard, parallelize, shard_megatron

__all__ = [
    "MarkovData",
    "Qwen3",
    "Qwen3MoE",
    "batch",
    "check_tp",
    "hf_tp_dims",
    "lm_loss",
    "local_shard",
    "parallelize",
    "shard_megatron",
]
