"""The expert-parallel runtime: two ZeRO-1 runtimes behind one step that never partially updates.

Under expert parallelism (:mod:`canzona.layouts.ep`) the dense parameters are replicated over
every rank and the expert stacks are sharded over the ``ep`` mesh dimension, so the optimizer's
work is two :class:`~canzona.runtime.dp.DPRuntime` instances on each rank:

- *dense*: the dense parameters over all ``dp x ep`` ranks (the paper's ZeRO-1 path, Section 3);
- *experts*: this rank's local expert stacks ``(E/ep, M, N)`` over the expert-DP group (the ranks
  holding the same experts). Its gradients arrive already summed over the EP ranks' tokens (the
  dispatch all-to-all's backward did that), so the runtime sums them over the expert-DP group and
  divides by ``dp x ep``: the gradient of the mean loss over the whole batch, as for the dense
  parameters (Megatron's and torchtitan's scaling of expert gradients). With ``dp = 1`` the group
  is this rank alone: every rank updates its whole experts with no optimizer communication.
  Beside TP (mesh ``("dp", "ep", "tp")``) the group is the ``dp x tp`` ranks of this EP
  coordinate, whose TP ranks hold equal copies of each gradient (they saw the same tokens): only
  TP rank 0's copy enters the sum (:attr:`DPRuntime.grad_contributes`). Under expert tensor
  parallelism (``etp``) the group is the ``dp`` ranks of this ``(ep, tp)`` coordinate, each TP
  rank's gradient its own shard's, and the part's TP engine assembles every expert on its host.

:meth:`EPRuntime.step` runs the DP runtime's stages on both (:meth:`DPRuntime.prepare`, ...,
:meth:`DPRuntime.finish`) with **one** status agreement before any update: errors, gradients
received, non-finite gradients (named per expert: ``layers.0.mlp.experts.down_proj (expert 5)``)
and the hyperparameter digest of both parts are settled together, so a refusal changes nothing
on any rank in either part. A second agreement after both parts' updates carries their errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from canzona.runtime.agree import agree, check_step_flags, nonfinite
from canzona.runtime.comm import Comm
from canzona.runtime.dp import DPRuntime, StepState
from canzona.runtime.hooks import RemovableHandle, UpdateHook
from canzona.runtime.phases import PhaseTimer, phase

__all__ = ["EPRuntime"]


class EPRuntime:
    """One rank's step over a dense and an expert :class:`DPRuntime` (see the module docstring).

    ``ep_rank`` is this rank's EP coordinate: its local expert ``k`` of a stack of ``E`` experts is
    global expert ``ep_rank * E/ep + k``, the number error messages name."""

    def __init__(self, dense: DPRuntime, experts: DPRuntime, *, ep: int, ep_rank: int, status_comm: Comm, timeout_s: float,
                 tp_rank: int = 0, etp: bool = False) -> None:
        self.dense = dense
        self.experts = experts
        self.parts = (dense, experts)
        self.ep = ep
        self.ep_rank = ep_rank
        #: this rank's TP coordinate: the dense part's norm slots of a TP-split parameter are per TP rank
        self.tp_rank = tp_rank
        #: expert tensor parallelism: the expert part's norm slots are per TP rank too
        self.etp = bool(etp)
        self.status_comm = status_comm
        self.status_timeout_s = float(timeout_s)
        # every (stack, global expert) has a flag slot in an order every rank shares; this rank
        # fills the slots of its own experts (global expert ep_rank * E/ep + k for local k)
        self._labels: list[tuple[str, int]] = []
        self._first: dict[str, int] = {}
        self._local: dict[str, int] = {}
        for name in experts.step_names:
            e_local = int(experts.specs[name].shape[0])
            self._local[name] = e_local
            self._first[name] = len(self._labels) + ep_rank * e_local
            self._labels += [(name, k) for k in range(e_local * ep)]
        self.steps = 0

    # ------------------------------------------------------------------ what the front end reads
    @property
    def timer(self) -> PhaseTimer | None:
        return self.dense.timer

    @timer.setter
    def timer(self, value: PhaseTimer | None) -> None:
        for rt in self.parts:
            rt.timer = value

    @property
    def replicas(self) -> _Replicas:
        """Both parts' replica guards as one (a checkpoint refuses when either diverged)."""
        return _Replicas([rt.replicas for rt in self.parts])

    def attach(self) -> None:
        for rt in self.parts:
            rt.attach()

    def detach(self) -> None:
        for rt in self.parts:
            rt.detach()

    def discard_grads(self) -> None:
        for rt in self.parts:
            rt.discard_grads()

    def finish_param_sync(self) -> None:
        for rt in self.parts:
            rt.finish_param_sync()

    def register_update_hook(self, hook: UpdateHook) -> RemovableHandle:
        """One hook on both parts (experts are reported with their local stacks' pieces)."""
        handles = [rt.register_update_hook(hook) for rt in self.parts]
        return _Handles(handles)

    def set_hyperparams(self, role: str, values: Mapping[str, Any]) -> None:
        for rt in self.parts:
            rt.set_hyperparams(role, values)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for rt in self.parts for o in rt.optimizers()]

    def state_bytes(self) -> int:
        return sum(rt.state_bytes() for rt in self.parts)

    def master_bytes(self) -> int:
        return sum(rt.master_bytes() for rt in self.parts)

    # ------------------------------------------------------------------ clipping
    def clip_grad_norm(self, names: list[str], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                       foreach: bool | None = None) -> torch.Tensor:
        """``clip_grad_norm_`` over both parts (:func:`canzona.runtime.clip.clip_pieces`, one exchange):
        each part's norm slots (:func:`~canzona.runtime.clip.slots_zero1`) in the model's parameter
        order ``names``, an expert stack's slots repeated per EP coordinate (each rank fills its
        own), every reduced region of both parts scaled. A stack split over EP ranks is a split
        parameter: its norm is within the module docstring's bound of torch's, not bitwise."""
        from canzona.runtime.clip import NormSlots, check_args, clip_pieces, slots_zero1

        check_args(max_norm, norm_type)
        if not all(rt.buffer._syncing for rt in self.parts):  # inside no_sync()
            raise RuntimeError("clip_grad_norm_ inside no_sync(): the gradients are not reduced yet; call it after the last "
                               "micro-batch's backward, outside no_sync(), before step()")
        for rt in self.parts:
            rt.finish_grad_syncs()
        parts = []
        for rt, copies, at, tp_rank in ((self.dense, 1, 0, self.tp_rank), (self.experts, self.ep, self.ep_rank, self.tp_rank if self.etp else 0)):
            sl = slots_zero1(rt, tp_rank)
            parts.append((sl, {n: j for j, n in enumerate(sl.names)}, {(pc.name, pc.start): g for pc, g in rt.reduced_grads()}, copies, at))
        starts, mine, local = [0], [], []
        for name in names:
            sl, index, grads, copies, at = next(p for p in parts if name in p[1])
            lo, hi = sl.starts[index[name]], sl.starts[index[name] + 1]
            for slot, key in sl.mine:
                if lo <= slot < hi:
                    mine.append((starts[-1] + at * (hi - lo) + slot - lo, key))
                    local.append(grads[key])
            starts.append(starts[-1] + copies * (hi - lo))
        slots = NormSlots(tuple(names), tuple(starts), tuple(mine))
        received = set(self.dense.buffer.received) | set(self.experts.buffer.received)
        scale = self.dense.reduced_regions() + self.experts.reduced_regions()
        return clip_pieces(slots, local, received, scale, max_norm, norm_type, error_if_nonfinite, foreach,
                           device=self.dense.buffer.data.device, dtype=self.dense.master_dtype, comm=self.status_comm,
                           timeout_s=self.status_timeout_s)

    # ------------------------------------------------------------------ step
    def step(self, digest: int = 0) -> None:
        """Both parts' step with one agreement before anything changes (module docstring)."""
        states = [rt.begin_step() for rt in self.parts]
        with phase("canzona/optimizer/step"):
            for rt, st in zip(self.parts, states):
                rt.prepare(st, digest)
            self._agree_flags(states)
            error: BaseException | None = None
            for rt, st in zip(self.parts, states):
                if error is not None and st.error is None:
                    st.error = error  # a part that failed first makes the next one join passively
                rt.apply(st)
                error = error or st.error
            try:
                agree(error, "optimizer step (update)", comm=self.status_comm, timeout_s=self.status_timeout_s)
            except BaseException as exc:
                for rt, st in zip(self.parts, states):
                    rt.update_failed(st, exc)
                raise
            for rt in self.parts:
                rt.after_update()
        for rt, st in zip(self.parts, states):
            rt.finish(st)
        self.steps += 1

    def _agree_flags(self, states: list[StepState]) -> None:
        """The one pre-update exchange over both parts' flags; sets each part's ``skip``. On a
        refusal both parts drop their gradients and every rank raises the same error."""
        (sd, se) = states
        error = sd.error or se.error
        try:
            nd = len(self.dense.step_names)
            flags = torch.cat([sd.flags[:2 + nd], self._expert_received(se), sd.flags[2 + nd:], self._expert_bad(se)])
            names = list(self.dense.step_names) + [f"{n} (expert {k})" for n, k in self._labels]
        except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
            error = error or exc
            flags = torch.zeros(2 + 2 * (len(self.dense.step_names) + len(self._labels)), dtype=torch.int64)
            names = []
        try:
            reduced = agree(error, "optimizer step", flags=flags, comm=self.status_comm, timeout_s=self.status_timeout_s)
            assert reduced is not None
            skip = check_step_flags(reduced, names)
        except BaseException:
            self.discard_grads()
            raise
        sd.skip = frozenset(n for n in skip if n in self.dense.params)
        se.skip = frozenset(n for n in self.experts.step_names if f"{n} (expert {self._first[n] - self._base(n)})" in skip)

    def _base(self, name: str) -> int:
        """The flag slot of global expert 0 of stack ``name``."""
        return self._first[name] - self.ep_rank * self._local[name]

    def _expert_received(self, st: StepState) -> torch.Tensor:
        """Per (stack, global expert) slot: whether this rank received the stack's gradient."""
        ne = len(self.experts.step_names)
        per_param = st.flags[2:2 + ne]
        out = torch.zeros(len(self._labels), dtype=torch.int64)
        for j, name in enumerate(self.experts.step_names):
            first = self._first[name]
            out[first:first + self._local[name]] = per_param[j]
        return out

    def _expert_bad(self, st: StepState) -> torch.Tensor:
        """Per (stack, global expert) slot: whether a gradient slice this rank updates is non-finite.
        The per-parameter flags settle the common all-finite case; only a non-finite stack is
        looked at expert by expert (its pieces' gradients, cut into whole experts)."""
        ne = len(self.experts.step_names)
        out = torch.zeros(len(self._labels), dtype=torch.int64)
        if not bool(st.flags[2 + ne:].any()):
            return out
        for pc, g in self.experts.reduced_grads():
            name = pc.name
            local = self.experts.specs[name].local_shape  # one expert's part of this rank's stack (its TP shard under ETP)
            unit = local[1] * local[2]
            flat = g.reshape(-1)
            for k in range(pc.start // unit, (pc.end - 1) // unit + 1):
                lo, hi = max(pc.start, k * unit) - pc.start, min(pc.end, (k + 1) * unit) - pc.start
                if bool(nonfinite([flat[lo:hi]]).any()):
                    out[self._first[name] + k] = 1
        return out


class _Replicas:
    """The replica guards of several parts, checked and cleared together."""

    def __init__(self, guards: list[Any]) -> None:
        self._guards = guards

    def check(self, what: str) -> None:
        for g in self._guards:
            g.check(what)

    def clear(self) -> None:
        for g in self._guards:
            g.clear()

    def partly_loaded(self, cause: str) -> None:
        for g in self._guards:
            g.partly_loaded(cause)

    def tripped(self) -> bool:
        return any(g.tripped() for g in self._guards)


class _Handles:
    """The handle of a hook registered on both parts."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
