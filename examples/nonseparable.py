"""Optimizers that cannot be exact under distribution, one per reason, and what the gate says.

Each is a small variant of :class:`examples.sign_momentum.SignMomentum`-style momentum SGD that
breaks one property Canzona relies on (every rank steps only the parameters it owns, several
times per training step, and must compute the same bits as one device):

=====================  ========================================  ==================================
class                  what it does                              how the gate tells
=====================  ========================================  ==================================
GlobalNormClipped      clips by the global gradient norm in step  refused before the run: reads
                                                                  other parameters
SharedCounter          keeps a step counter in param_groups       refused: param_groups entry changes
OutsideState           keeps momenta in self.momenta, not state   refused: state outside self.state
UnseededNoise          adds noise from the global RNG             refused: not deterministic
PerProcessNoise        noise from a generator seeded by the PID   passes the probes (one process
                                                                  cannot see it); the run fails,
                                                                  naming the parameter and entry
=====================  ========================================  ==================================

Run ``PYTHONPATH=. canzona validate --optimizer examples.nonseparable:GlobalNormClipped --mesh dp2``
to see the refusal (exit 1, before any process starts).
"""

from __future__ import annotations

import os

import torch

__all__ = ["GlobalNormClipped", "SharedCounter", "OutsideState", "UnseededNoise", "PerProcessNoise"]


class _Momentum(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    def _direction(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        st = self.state[p]
        if "m" not in st:
            st["m"] = torch.zeros_like(p)
        st["m"].mul_(self.param_groups[0]["beta"]).add_(g)
        return st["m"]

    def _params(self):
        return [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure=None):
        for p, group in self._params():
            p.add_(self._direction(p, p.grad), alpha=-group["lr"])


class GlobalNormClipped(_Momentum):
    """Gradients scaled to a global 2-norm of at most ``max_norm`` inside ``step()``."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.9, max_norm: float = 0.5) -> None:
        super().__init__(params, lr, beta)
        self.max_norm = max_norm

    @torch.no_grad()
    def step(self, closure=None):
        items = self._params()
        if not items:
            return
        total = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p, _ in items])))
        factor = min(1.0, self.max_norm / (total + 1e-12))
        for p, group in items:
            p.add_(self._direction(p, p.grad * factor), alpha=-group["lr"])


class SharedCounter(_Momentum):
    """Bias-corrected momentum with the step count kept in ``param_groups`` (one per group)."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, lr, beta)
        for group in self.param_groups:
            group["t"] = 0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["t"] += 1
            for p in group["params"]:
                if p.grad is not None:
                    m = self._direction(p, p.grad)
                    p.add_(m / (1 - group["beta"] ** group["t"]), alpha=-group["lr"])


class OutsideState(_Momentum):
    """Momentum buffers in a list attribute, by position among the parameters with gradients."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, lr, beta)
        self.momenta: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        for i, (p, group) in enumerate(self._params()):
            if i >= len(self.momenta):
                self.momenta.append(torch.zeros_like(p))
            self.momenta[i].mul_(group["beta"]).add_(p.grad)
            p.add_(self.momenta[i], alpha=-group["lr"])


class UnseededNoise(_Momentum):
    """Momentum plus a little Gaussian noise from the global random generator."""

    @torch.no_grad()
    def step(self, closure=None):
        for p, group in self._params():
            m = self._direction(p, p.grad)
            p.add_(m + 1e-3 * torch.randn_like(p), alpha=-group["lr"])


class PerProcessNoise(_Momentum):
    """Noise from a generator seeded by the *process* ID (and a per-parameter step count in
    ``self.state``): deterministic inside one process, so in-process probes pass, but every rank
    draws different numbers."""

    @torch.no_grad()
    def step(self, closure=None):
        for p, group in self._params():
            m = self._direction(p, p.grad)
            st = self.state[p]
            st["t"] = int(st.get("t", 0)) + 1
            g = torch.Generator().manual_seed(os.getpid() * 7919 + st["t"])
            p.add_(m + 1e-3 * torch.randn(p.shape, generator=g), alpha=-group["lr"])
