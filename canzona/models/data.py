"""Seeded synthetic token data, generated in-process: a fixed random Markov chain over the vocabulary.

Each token has a handful of likely successors (``branching``) with random probabilities, so the
next-token entropy is far below ``log(vocab)`` and a model can actually learn it: the loss starts
near ``log(vocab)`` and falls toward the chain's entropy rate (:meth:`MarkovData.entropy`).

Batches are a pure function of (seed, step, sequence index): the global batch of a step is the same
for every DP degree, DP rank ``r`` takes rows ``[r*B/dp, (r+1)*B/dp)``, and all TP ranks of one DP
rank get identical tokens (no communication involved). So a dp=1 run and a dp=2 run see the same
global batch, which is what exactness comparisons across layouts need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["MarkovData", "batch"]

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio) to decorrelate per-sequence seeds


def _sequence_seed(seed: int, step: int, index: int) -> int:
    return (int(seed) * _MIX + int(step) * 0xBF58476D1CE4E5B9 + int(index) * 0x94D049BB133111EB) & (2**63 - 1)


@dataclass(frozen=True, slots=True)
class MarkovData:
    """A fixed random first-order Markov chain over ``vocab`` tokens, drawn from ``seed``."""

    vocab: int
    seed: int = 0
    branching: int = 8
    _cdf: torch.Tensor = field(init=False, repr=False, compare=False)
    _probs: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.vocab, int) or self.vocab < 2:
            raise ValueError(f"vocab must be an integer >= 2, got {self.vocab!r}")
        if not isinstance(self.branching, int) or not 1 <= self.branching <= self.vocab:
            raise ValueError(f"branching must be in [1, vocab={self.vocab}], got {self.branching!r}")
        gen = torch.Generator().manual_seed(int(self.seed))
        succ = torch.stack([torch.randperm(self.vocab, generator=gen)[: self.branching] for _ in range(self.vocab)])
        weights = torch.rand(self.vocab, self.branching, generator=gen, dtype=torch.float64) + 0.05
        probs = torch.zeros(self.vocab, self.vocab, dtype=torch.float64)
        probs.scatter_(1, succ, weights / weights.sum(dim=1, keepdim=True))
        object.__setattr__(self, "_probs", probs)
        cdf = probs.cumsum(dim=1)
        cdf[:, -1] = 1.0  # guard against rounding: every uniform draw lands on a token
        object.__setattr__(self, "_cdf", cdf)

    def entropy(self) -> float:
        """Entropy rate of the chain (nats/token) under its stationary distribution: the loss floor."""
        p = self._probs
        row_h = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(dim=1)
        pi = torch.full((self.vocab,), 1.0 / self.vocab, dtype=torch.float64)
        for _ in range(500):
            pi = pi @ p
        return float((pi * row_h).sum())

    def sequence(self, seed: int, step: int, index: int, length: int) -> torch.Tensor:
        """One sequence of ``length`` tokens (int64), determined by (seed, step, index)."""
        gen = torch.Generator().manual_seed(_sequence_seed(seed, step, index))
        first = int(torch.randint(self.vocab, (1,), generator=gen))
        u = torch.rand(length - 1, generator=gen, dtype=torch.float64)
        out = [first]
        cdf = self._cdf
        cur = first
        for t in range(length - 1):
            cur = int(torch.searchsorted(cdf[cur], u[t], right=True).clamp_(max=self.vocab - 1))
            out.append(cur)
        return torch.tensor(out, dtype=torch.int64)

    def batch(self, step: int, dp_rank: int, dp: int, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's share of step ``step``'s global batch: ``(input_ids, labels)``, each
        ``[batch_size // dp, seq_len]`` int64, labels shifted by one token."""
        _check_batch(step, dp_rank, dp, batch_size, seq_len)
        per = batch_size // dp
        rows = [self.sequence(seed, step, dp_rank * per + i, seq_len + 1) for i in range(per)]
        tokens = torch.stack(rows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _check_batch(step: int, dp_rank: int, dp: int, batch_size: int, seq_len: int) -> None:
    for name, v, lo in (("step", step, 0), ("dp", dp, 1), ("batch_size", batch_size, 1), ("seq_len", seq_len, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank must be in [0, {dp}), got {dp_rank!r}")
    if batch_size % dp:
        raise ValueError(f"batch_size={batch_size} (global) must be a multiple of dp={dp}")


_CHAINS: dict[tuple[int, int], MarkovData] = {}


def batch(
    step: int,
    dp_rank: int,
    dp: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    *,
    vocab: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (``batch_size`` sequences) sliced for ``dp_rank`` of ``dp``.

    The chain is drawn from ``seed`` and cached per (vocab, seed); see :class:`MarkovData`.
    """
    key = (int(vocab), int(seed))
    chain = _CHAINS.get(key)
    if chain is None:
        chain = _CHAINS[key] = MarkovData(vocab, seed)
    return chain.batch(step, dp_rank, dp, batch_size, seq_len, seed)
