"""A user model for ``canzona validate --model examples.tiny_mlp:tiny_mlp``: any callable that
returns an ``nn.Module`` works. ``canzona_tp_dims`` (optional) declares which parameters are
split over the tensor-parallel dimension, Megatron-style (column-parallel ``up``, row-parallel
``down``); the suite shards them over ``tp`` and checks the distributed update of every shard."""

from __future__ import annotations

from torch import nn

__all__ = ["TinyMLP", "tiny_mlp"]


class TinyMLP(nn.Module):
    def __init__(self, vocab: int = 24, hidden: int = 10, ffn: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        # column-parallel up (rows of its weight and its bias), row-parallel down (columns)
        self.canzona_tp_dims = {"up.weight": 0, "up.bias": 0, "down.weight": 1}

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.down(nn.functional.gelu(self.up(x)))
        return self.head(self.norm(x))


def tiny_mlp(hidden: int = 10, ffn: int = 16) -> TinyMLP:
    """Factory: ``--model examples.tiny_mlp:tiny_mlp --model-kwargs '{"hidden": 12}'``."""
    return TinyMLP(hidden=hidden, ffn=ffn)
