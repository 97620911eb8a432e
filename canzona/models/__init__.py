"""The tiny Qwen3 model, its tensor parallelization and synthetic data (tests, demo, ``canzona train``)."""

from __future__ import annotations

from .data import MarkovData, batch
from .qwen3 import Qwen3, lm_loss
from .tp import check_tp, hf_tp_dims, local_shard, parallelize, shard_megatron

__all__ = [
    "MarkovData",
    "Qwen3",
    "batch",
    "check_tp",
    "hf_tp_dims",
    "lm_loss",
    "local_shard",
    "parallelize",
    "shard_megatron",
]
