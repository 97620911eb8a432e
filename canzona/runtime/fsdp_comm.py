"""Bounded waits for FSDP2's own collectives (the all-gathers of forward, the reduce-scatters of
backward) on gloo.

canzona bounds every wait of its own collectives by ``status_timeout_s``
(:func:`canzona.runtime.comm.wait_bounded`), but on an FSDP2 model most of a step's collectives are
torch's: ``fully_shard``'s parameter all-gathers and gradient reduce-scatters. A rank that skips an
``opt.step()`` (or takes one more) leaves the others in the step's status exchange, which gives up
within the bound, while it sits in FSDP2's next all-gather until the process group's timeout (30
minutes by default) and then reports a transport error that names nobody.

:func:`bound_fsdp_collectives` (called when the optimizer is built on an FSDP2 model, setting
``bound_fsdp_collectives``, on by default) gives every ``fully_shard`` module whose collectives run
on gloo with CPU tensors a custom all-gather and reduce-scatter (torch's
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``) that delegate to the module's
own default comm objects, so they issue the same collective on the same tensors (the same bits),
asynchronously, then wait with :func:`~canzona.runtime.comm.wait_bounded`, bounded by
``status_timeout_s``. A wait that runs out, or sees that another rank gave up, raises
:class:`~canzona.runtime.comm.CollectiveTimeout` with the line every rank of the world raises: each
rank's position (here: the collective, forward or backward, and the module), the optimizer steps
each rank has begun when they differ (the rank with more is ahead), and that the process group
cannot be used further. An all-gather FSDP2 asks for asynchronously (``unshard(async_op=True)``,
prefetching) returns a work whose ``wait()`` is bounded the same way; the synchronous ones
(FSDP2's default on CPU) wait before returning None, which FSDP2 takes as done.

Left as they are (unbounded, docs/robustness.md says so):

- NCCL, and any module whose parameters live on a device other than CPU: a bounded
  ``wait(timeout)`` there makes the host wait for the GPU, undoing the overlap; the NCCL watchdog
  (the process group's ``timeout=``) is the bound;
- modules with several parameter groups (per-parameter meshes through ``shard_placement_fn``, as
  expert parallelism builds them): torch refuses custom comms on them;
- a comm the user (or torch, ``set_allocate_memory_from_process_group``, symmetric memory)
  installed: only torch's plain defaults are wrapped, never overwritten otherwise;
- HSDP's all-reduce across replicas, which FSDP2 issues itself outside its comm objects.

Installing is local (no collective): every rank makes the same decisions from the same model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.runtime.comm import wait_bounded

__all__ = ["BoundedAllGather", "BoundedReduceScatter", "bound_fsdp_collectives", "gloo_for_cpu"]


def gloo_for_cpu(backend: str) -> bool:
    """Whether a process group of ``backend`` (``dist.get_backend``'s string) runs CPU tensors on
    gloo: ``gloo``, or a device map naming gloo for ``cpu`` (``cpu:gloo,cuda:nccl``)."""
    b = backend.lower().replace(" ", "")
    if ":" not in b:
        return b == "gloo"
    return any(part == "cpu:gloo" for part in b.split(","))


def _stage(param_group: Any, collective: str) -> str:
    """``forward`` or ``backward``: where FSDP2 is when it issues ``collective`` (best effort)."""
    state = getattr(getattr(param_group, "_training_state", None), "name", "")
    if collective == "reduce-scatter" or state in ("PRE_BACKWARD", "POST_BACKWARD"):
        return "backward"
    return "forward" if state == "FORWARD" else "unshard"


class _BoundedWork(dist.distributed_c10d.Work):
    """The work of an asynchronous all-gather whose ``wait()`` without a timeout is bounded (FSDP2
    checks ``isinstance(work, Work)`` before it waits, hence the base class)."""

    def __init__(self, work: Any, timeout_s: float, where: str) -> None:
        super().__init__()
        self._work, self._timeout_s, self._where = work, timeout_s, where

    def wait(self, timeout: Any = None) -> bool:  # noqa: D401 - torch's name
        if timeout is not None:
            return bool(self._work.wait(timeout))
        wait_bounded(self._work.wait, self._timeout_s, self._where)
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class _Bounded:
    """Shared part of the two wrappers: the default comm object delegated to, the bound, and the
    words for this rank's position."""

    collective = ""

    def __init__(self, inner: Any, timeout_s: float, module: str, param_group: Any) -> None:
        #: torch's default comm object of the parameter group (restored by ``bound_fsdp_collectives(..., on=False)``)
        self.inner = inner
        self.timeout_s = float(timeout_s)
        self.module = module
        self._group_ref = param_group

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def _where(self) -> str:
        return f"FSDP2's {self.collective} ({_stage(self._group_ref, self.collective)}) of {self.module}"

    def _bounded(self, tensor: torch.Tensor, group: Any) -> bool:
        """Whether this call is bounded: CPU tensors on a gloo group (anything else passes through)."""
        return tensor.device.type == "cpu" and gloo_for_cpu(str(dist.get_backend(group)))

    def _run(self, launch: Callable[[bool], Any], tensor: torch.Tensor, group: Any, async_op: bool) -> Any:
        """Issue the collective through ``launch(async_op)``. A bounded call (:meth:`_bounded`) is
        issued asynchronously: with ``async_op`` its work comes back with a bounded ``wait()``,
        without it the wait happens here, bounded, and nothing comes back (FSDP2 then treats the
        collective as done)."""
        if not self._bounded(tensor, group):
            return launch(async_op)
        work = launch(True)
        if work is None:
            return None
        if async_op:
            return _BoundedWork(work, self.timeout_s, self._where())
        wait_bounded(work.wait, self.timeout_s, self._where())
        return None


def _base(name: str) -> type:
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    return getattr(_fsdp_api, name)


class BoundedAllGather(_Bounded, _base("AllGather")):  # type: ignore[misc]
    """FSDP2's default all-gather, its wait bounded by ``timeout_s`` (module docstring)."""

    collective = "all-gather"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        return self._run(lambda a: self.inner(output_tensor, input_tensor, group, async_op=a), input_tensor, group, async_op)


class BoundedReduceScatter(_Bounded, _base("ReduceScatter")):  # type: ignore[misc]
    """FSDP2's default reduce-scatter, its wait bounded by ``timeout_s`` (module docstring)."""

    collective = "reduce-scatter"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
        return self._run(lambda a: self.inner(output_tensor, input_tensor, group, op, async_op=a), input_tensor, group, async_op)


def _module_words(name: str) -> str:
    return f"module '{name}'" if name else "the root module"


def bound_fsdp_collectives(model: nn.Module, timeout_s: float, *, on: bool = True) -> list[str]:
    """Install (``on``) or remove the bounded all-gather and reduce-scatter on every eligible
    ``fully_shard`` module of ``model`` (module docstring); returns the names of the modules that
    carry them afterwards ("" is the root). A module that carries canzona's from an earlier
    optimizer gets the new bound (or torch's default back, ``on=False``); any other custom comm is
    left alone. No collective: every rank decides alike."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    bounded: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        groups = list(m._get_fsdp_state()._fsdp_param_groups)  # noqa: SLF001 - what set_custom_* acts on
        if len(groups) != 1:  # none, or several (per-parameter meshes): torch refuses custom comms there
            continue
        pg = groups[0]
        ag, rs = pg._all_gather_comm, pg._reduce_scatter_comm  # noqa: SLF001
        ag_inner = ag.inner if isinstance(ag, BoundedAllGather) else ag
        rs_inner = rs.inner if isinstance(rs, BoundedReduceScatter) else rs
        eligible = pg.device.type == "cpu" and gloo_for_cpu(str(dist.get_backend(pg.mesh_info.shard_process_group)))
        if on and eligible:
            words = _module_words(name)
            if type(ag_inner) is DefaultAllGather:
                m.set_custom_all_gather(BoundedAllGather(ag_inner, timeout_s, words, pg))
            if type(rs_inner) is DefaultReduceScatter:
                m.set_custom_reduce_scatter(BoundedReduceScatter(rs_inner, timeout_s, words, pg))
        else:
            if ag_inner is not ag:
                m.set_custom_all_gather(ag_inner)
            if rs_inner is not rs:
                m.set_custom_reduce_scatter(rs_inner)
        if isinstance(pg._all_gather_comm, BoundedAllGather) or isinstance(pg._reduce_scatter_comm, BoundedReduceScatter):  # noqa: SLF001
            bounded.append(name)
    return bounded
