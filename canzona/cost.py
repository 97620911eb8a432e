"""Cost models: what one parameter's optimizer update costs, in elements, bytes or FLOPs.

Both planners of the paper take a load function W(p) (Section 3.2 for DP, Section 4.2 for TP).
The paper uses ``W(p) = numel(p)`` everywhere (Appendix D.5); canzona also offers the optimizer-
state footprint (``memory``) and the arithmetic of one step (``flops``). Every function here is a
small pure function of a shape; the FLOP and byte formulas are written out beside the code.

Conventions
-----------
* A "flop" is one multiply-add of a matrix product, so Muon counts ``2`` products
  of ``max * min^2`` per Newton-Schulz step; element-wise work counts one per arithmetic op.
* A matrix parameter of shape ``(m, n)`` is costed by the matrix optimizer; an element-wise
  parameter (norms, biases, embedding, output head, router) by AdamW, whatever the optimizer.
* ``flops_shape`` chooses which shape a TP-split matrix is costed on: ``local`` (the TP shard,
  what the paper's implementation measures) or ``full`` (the shape its host really processes
  after the micro-group gather, Section 4.1; the default). Element-wise work is always local: it
  never leaves the TP rank that holds the shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from canzona.specs import ParamSpec

__all__ = [
    "OPTIMIZERS",
    "COST_MODELS",
    "STATE_BYTES",
    "NS_STEPS",
    "SHAMPOO_PRECONDITION_FREQUENCY",
    "SOAP_PRECONDITION_FREQUENCY",
    "EIGH_FLOPS_PER_CUBE",
    "ADAMW_FLOPS_PER_ELEMENT",
    "muon_flops",
    "shampoo_flops",
    "soap_flops",
    "adamw_flops",
    "matrix_flops",
    "state_bytes",
    "param_flops",
    "param_memory",
    "param_cost",
    "cost_arrays",
]

OPTIMIZERS: tuple[str, ...] = ("muon", "shampoo", "soap", "adamw")
COST_MODELS: tuple[str, ...] = ("numel", "memory", "flops")

#: optimizer states are kept in fp32
STATE_BYTES = 4
#: Muon's quintic Newton-Schulz iteration count (Jordan et al.; the reference Muon uses 5)
NS_STEPS = 5
#: Shampoo recomputes its inverse 4th roots every this many steps (distributed-shampoo default 100)
SHAMPOO_PRECONDITION_FREQUENCY = 100
#: SOAP refreshes its eigenbases every this many steps (the SOAP paper's default 10)
SOAP_PRECONDITION_FREQUENCY = 10
#: a symmetric eigendecomposition of a d x d matrix costs about c * d^3 (Householder
#: tridiagonalisation 4/3 d^3 plus QR iterations with vectors ~ 6-9 d^3; we take 10)
EIGH_FLOPS_PER_CUBE = 10
#: AdamW per element: two EMAs (3 + 3), bias corrections (2), sqrt + eps + divide (3),
#: decoupled weight decay and the update (2)
ADAMW_FLOPS_PER_ELEMENT = 13


def _mn(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"a matrix cost needs a 2-D shape, got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def muon_flops(shape: Sequence[int]) -> int:
    """One Muon step on an ``(m, n)`` matrix.

    With a = max(m, n), b = min(m, n), each Newton-Schulz step forms A = X X^T (b*b*a multiply-
    adds) and A X-type products (b*b*a): 2 products of a*b^2. The b x b product A @ A (b^3) and
    the element-wise momentum are lower order for a >= b and left out:

        flops = NS_STEPS * 2 * a * b^2 = 10 * a * b^2
    """
    m, n = _mn(shape)
    a, b = max(m, n), min(m, n)
    return NS_STEPS * 2 * a * b * b


def shampoo_flops(shape: Sequence[int], *, precondition_frequency: int = SHAMPOO_PRECONDITION_FREQUENCY) -> int:
    """One Shampoo step on an ``(m, n)`` matrix, eigendecompositions amortized.

        statistics   L += G G^T, R += G^T G              m^2 n + m n^2
        precondition L^{-1/4} G R^{-1/4}                 m^2 n + m n^2
        inverse roots eigh(L), eigh(R) every f steps    c (m^3 + n^3) / f
        grafting + momentum (element-wise)              ~ADAMW_FLOPS_PER_ELEMENT * m n
    """
    m, n = _mn(shape)
    per_step = 2 * (m * m * n + m * n * n) + ADAMW_FLOPS_PER_ELEMENT * m * n
    roots = EIGH_FLOPS_PER_CUBE * (m**3 + n**3) // precondition_frequency
    return per_step + roots


def soap_flops(shape: Sequence[int], *, precondition_frequency: int = SOAP_PRECONDITION_FREQUENCY) -> int:
    """One SOAP step on an ``(m, n)`` matrix, eigenbasis refreshes amortized.

        statistics    L += G G^T, R += G^T G               m^2 n + m n^2
        rotate in     Q_L^T G Q_R                          m^2 n + m n^2
        rotate out    Q_L U Q_R^T                          m^2 n + m n^2
        Adam in the eigenbasis (element-wise)            ADAMW_FLOPS_PER_ELEMENT * m n
        eigenbasis    eigh / QR power step every f steps   c (m^3 + n^3) / f
    """
    m, n = _mn(shape)
    per_step = 3 * (m * m * n + m * n * n) + ADAMW_FLOPS_PER_ELEMENT * m * n
    basis = EIGH_FLOPS_PER_CUBE * (m**3 + n**3) // precondition_frequency
    return per_step + basis


def adamw_flops(numel: int) -> int:
    """AdamW on ``numel`` elements: ADAMW_FLOPS_PER_ELEMENT * numel."""
    return ADAMW_FLOPS_PER_ELEMENT * int(numel)


def matrix_flops(optimizer: str, shape: Sequence[int]) -> int:
    """FLOPs of one step of ``optimizer`` on a matrix of ``shape``."""
    if optimizer == "muon":
        return muon_flops(shape)
    if optimizer == "shampoo":
        return shampoo_flops(shape)
    if optimizer == "soap":
        return soap_flops(shape)
    if optimizer == "adamw":
        return adamw_flops(math.prod(shape))
    raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")


def state_bytes(optimizer: str, shape: Sequence[int]) -> int:
    """Optimizer-state bytes (fp32) that ``optimizer`` keeps for a tensor of ``shape``.

        muon     momentum                                      m n
        shampoo  L, R, L^{-1/4}, R^{-1/4}, momentum, graft     2 (m^2 + n^2) + 2 m n
        soap     L, R, Q_L, Q_R, exp_avg, exp_avg_sq           2 (m^2 + n^2) + 2 m n
        adamw    exp_avg, exp_avg_sq                           2 numel
    """
    if optimizer == "adamw":
        return 2 * math.prod(shape) * STATE_BYTES
    m, n = _mn(shape)
    if optimizer == "muon":
        return m * n * STATE_BYTES
    if optimizer in ("shampoo", "soap"):
        return (2 * (m * m + n * n) + 2 * m * n) * STATE_BYTES
    raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")


def _check(optimizer: str, flops_shape: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if flops_shape not in ("full", "local"):
        raise ValueError(f"flops_shape must be 'full' or 'local', got {flops_shape!r}")


def param_flops(spec: ParamSpec, optimizer: str, flops_shape: str = "full") -> float:
    """FLOPs one TP rank spends, on average, on this parameter's update in one step.

    * element-wise parameter: AdamW on the local shard (it is updated where it lives);
    * matrix, ``local``: the matrix optimizer on the TP-local shard shape (the paper's accounting);
    * matrix, ``full``: the matrix optimizer on the full shape, divided by ``tp`` when the
      parameter is TP-split (one host in the TP group does the whole update, so per TP rank the
      group spends 1/tp of it on average) and not divided when replicated (every TP rank updates
      its replica, Section 4.1).
    """
    _check(optimizer, flops_shape)
    if spec.kind == "elementwise":
        return float(adamw_flops(spec.local_numel))
    if not spec.tp_split:  # E tasks of the logical (M, N) shape (one for a matrix)
        return float(spec.n_tasks * matrix_flops(optimizer, spec.task_shape))
    # TP-split: one task (a matrix) or E (an expert stack split on its rows or columns)
    if flops_shape == "local":
        return float(spec.n_tasks * matrix_flops(optimizer, spec.local_task_shape))
    return spec.n_tasks * matrix_flops(optimizer, spec.task_shape) / spec.tp


def param_memory(spec: ParamSpec, optimizer: str, flops_shape: str = "full") -> float:
    """Optimizer-state bytes one TP rank holds, on average, for this parameter.

    Same averaging as :func:`param_flops`: a TP-split matrix's full-shape state lives on its host
    (``full``: state(shape) / tp per rank on average) or is accounted per shard (``local``);
    element-wise and replicated parameters keep their state on every TP rank.
    """
    _check(optimizer, flops_shape)
    if spec.kind == "elementwise":
        return float(state_bytes("adamw", spec.local_shape))
    if not spec.tp_split:
        return float(spec.n_tasks * state_bytes(optimizer, spec.task_shape))
    if flops_shape == "local":
        return float(spec.n_tasks * state_bytes(optimizer, spec.local_task_shape))
    return spec.n_tasks * state_bytes(optimizer, spec.task_shape) / spec.tp


def param_cost(spec: ParamSpec, cost: str, optimizer: str = "muon", flops_shape: str = "full") -> float:
    """The planner's load W(p) under cost model ``cost`` (Section 3.2; the paper uses numel).

    ``numel`` counts the elements the parameter occupies in a TP rank's ZeRO-1 buffer.
    """
    if cost == "numel":
        return float(spec.local_numel)
    if cost == "memory":
        return param_memory(spec, optimizer, flops_shape)
    if cost == "flops":
        return param_flops(spec, optimizer, flops_shape)
    raise ValueError(f"unknown cost model {cost!r}; choose one of {', '.join(COST_MODELS)}")


def _matrix_flops_np(optimizer: str, m: np.ndarray, n: np.ndarray) -> np.ndarray:
    """:func:`matrix_flops` over arrays of shapes (float64; same formulas)."""
    if optimizer == "muon":
        a, b = np.maximum(m, n), np.minimum(m, n)
        return NS_STEPS * 2 * a * b * b
    if optimizer in ("shampoo", "soap"):
        k = 2 if optimizer == "shampoo" else 3
        f = SHAMPOO_PRECONDITION_FREQUENCY if optimizer == "shampoo" else SOAP_PRECONDITION_FREQUENCY
        return k * (m * m * n + m * n * n) + ADAMW_FLOPS_PER_ELEMENT * m * n + np.floor(EIGH_FLOPS_PER_CUBE * (m**3 + n**3) / f)
    return ADAMW_FLOPS_PER_ELEMENT * m * n


def _state_bytes_np(optimizer: str, m: np.ndarray, n: np.ndarray) -> np.ndarray:
    if optimizer == "muon":
        return m * n * STATE_BYTES
    if optimizer in ("shampoo", "soap"):
        return (2 * (m * m + n * n) + 2 * m * n) * STATE_BYTES
    return 2 * m * n * STATE_BYTES


def cost_arrays(specs: Sequence[ParamSpec], optimizer: str, flops_shape: str = "full") -> tuple[np.ndarray, np.ndarray]:
    """(:func:`param_flops`, :func:`param_memory`) of every spec as float64 arrays, vectorised for
    models with tens of thousands of parameters (a 1T-parameter MoE)."""
    _check(optimizer, flops_shape)
    rows = []
    for s in specs:  # tens of thousands of specs: read each attribute once
        shape, split, kind = s.shape, s.tp_dim is not None and s.tp > 1, s.kind  # = s.tp_split
        if kind == "elementwise":
            rows.append((False, shape[0], shape[-1] if len(shape) == 2 else 1, s.tp if split else 1,
                         s.tp_dim if split else -1, math.prod(shape), 1))
        else:  # experts and reshaped/transposed matrices: n_tasks x the logical (M, N) task
            m, n = s.task_shape
            # a TP-split expert stack (rows or columns of every expert): the task's own split dim
            rows.append((True, m, n, s.tp if split else 1, s.task_tp_dim if split else -1, math.prod(shape), s.n_tasks))
    if not rows:
        return np.zeros(0), np.zeros(0)
    t = np.array(rows, dtype=np.float64)
    matrix, m, n, tp, dim, numel, tasks = (t[:, j] for j in range(7))
    matrix = matrix.astype(bool)
    local_numel = numel / tp
    lm = np.where(dim == 0, m / tp, m)
    ln = np.where(dim == 1, n / tp, n)
    ew_flops = ADAMW_FLOPS_PER_ELEMENT * local_numel
    ew_mem = 2 * local_numel * STATE_BYTES
    if flops_shape == "local":
        mf = tasks * _matrix_flops_np(optimizer, lm, ln)
        mm = tasks * _state_bytes_np(optimizer, lm, ln)
    else:
        mf = tasks * _matrix_flops_np(optimizer, m, n) / tp
        mm = tasks * _state_bytes_np(optimizer, m, n) / tp
    return np.where(matrix, mf, ew_flops), np.where(matrix, mm, ew_mem)
