"""Helpers only the repository's tests use: per-case outcomes of a multi-case worker, error
capture, what a rank holds of an optimizer, and a counter of host reads.

- :func:`attempt` / :func:`case_results`: a worker that runs many cases records each outcome, and
  each test reads its own case (a failure names the case and the rank, not the whole run).
- :func:`raised`: which error a call raised, with its message and how long it took to come.
- :func:`held_snapshot` / :func:`load_refused`: what a rank holds of an optimizer (masters, state,
  model pieces), and whether a refused checkpoint load left all of it untouched.
- :func:`doc_differences`: where two consolidated optimizer documents differ (masters, state
  values and memory layouts, step count, hyperparameters).
- :class:`HostReads`: counts the operations that read tensor values back to the host (``item()``,
  ``bool(t)``, ``nonzero``, ``tolist()``...), each with the line that asked: on CUDA each is a
  synchronization, so a test on CPU can check that a step's count does not grow with the model.

The rendezvous helpers the tests use (``file_init_method``, ``process_group``) are the launcher's
own, :mod:`canzona.runtime.launch`; the model, gradients and reference are the exactness suite's,
:mod:`validation.harness`.
"""

from __future__ import annotations

import collections
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from validation.harness import tensors_equal

__all__ = ["HostReads", "attempt", "case_results", "doc_differences", "held_snapshot", "load_refused", "raised"]


def held_snapshot(opt: Any) -> dict[str, torch.Tensor]:
    """Copies of every master, optimizer-state tensor and model piece this rank holds of ``opt``
    (either front end: anything implementing :class:`canzona.runtime.checkpoint.Checkpointable`)."""
    out: dict[str, torch.Tensor] = {}
    for i, h in enumerate(opt.held()):
        if h.master is not None:
            out[f"{i}.{h.name}.master"] = h.master.detach().clone()
        for k, v in h.state().items():
            if torch.is_tensor(v):
                out[f"{i}.{h.name}.{k}"] = v.detach().clone()
    for mp in opt.model_pieces():
        out[f"model.{mp.name}"] = mp.local.detach().clone()
    return out


def consolidated_on_every_rank(opt: Any) -> dict[str, Any]:
    """``opt.consolidated_state_dict()`` (collective; rank 0 gathers it) broadcast to every rank."""
    import torch.distributed as dist

    box = [opt.consolidated_state_dict() or None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def doc_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """What differs between two consolidated documents (``consolidated_state_dict()``): masters
    and state tensors compared with ``torch.equal`` (and dtype and strides: a layout changes how
    SOAP rounds), other state values, step count and hyperparameters with ``==``."""
    bad = [f"params/{n}" for n in tensors_equal(a["params"], b["params"])]
    for name in sorted(set(a["state"]) | set(b["state"])):
        sa, sb = a["state"].get(name, {}), b["state"].get(name, {})
        for k in sorted(set(sa) | set(sb)):
            x, y = sa.get(k), sb.get(k)
            if torch.is_tensor(x) and torch.is_tensor(y):
                same = x.dtype == y.dtype and x.stride() == y.stride() and torch.equal(x, y)
            else:
                same = type(x) is type(y) and x == y
            if not same:
                bad.append(f"state/{name}/{k}")
    bad += [key for key in ("hyper",) if a[key] != b[key]]
    bad += ["steps"] if a["meta"]["steps"] != b["meta"]["steps"] else []
    return bad


def load_refused(opt: Any, load: Callable[[Any], Any]) -> dict[str, Any]:
    """Run ``load(opt)``, which must raise one ``CheckpointError``: returns its message (``"loaded"``
    when nothing was raised) and whether everything :func:`held_snapshot` sees stayed bit for bit."""
    from canzona.runtime.checkpoint import CheckpointError

    before = held_snapshot(opt)
    try:
        load(opt)
        msg = "loaded"
    except CheckpointError as exc:
        msg = str(exc)
    return {"error": msg, "untouched": tensors_equal(before, held_snapshot(opt)) == []}


def attempt(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """Run one case inside a worker and record its outcome instead of letting it end the run:
    ``{"result": value}`` or ``{"error": "<type>: <message>\\n<traceback>"}``. A worker that runs
    many cases wraps each, so one broken case fails its own test (:func:`case_results`). A case
    that raises on one rank can leave its peers waiting in a collective until the group's timeout;
    the cases after it then fail on their own too, each naming itself."""
    try:
        return {"result": fn(*args)}
    except Exception as exc:  # noqa: BLE001 - recorded and re-raised in the parent as a test failure
        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}


def raised(fn: Callable[[], Any]) -> tuple[str, str, float] | None:
    """Call ``fn()`` expecting an error: ``(type name, message, seconds until it was raised)``, or
    None when nothing was raised (so a test can check which error, its wording, and that no rank
    hung waiting for it)."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the caller inspects whatever was raised
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


def case_results(per_rank: Sequence[Mapping[str, Any]], section: str, key: object = None) -> list[Any]:
    """Every rank's result of case ``key`` in ``section`` of a multi-case run (each rank returned
    ``{section: {key: attempt(...)}}``); AssertionError naming the case and the first failing rank
    with its traceback when the case raised there."""
    out = []
    for rank, res in enumerate(per_rank):
        outcome = res[section][key]
        if "error" in outcome:
            name = section if key is None else f"{section}[{key!r}]"
            raise AssertionError(f"case {name} failed on rank {rank}: {outcome['error']}")
        out.append(outcome["result"])
    return out


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep  # frames from here are torch's, not the caller's


class HostReads:
    """Context manager counting, on this thread, the tensor operations whose result the host must
    read: ``aten._local_scalar_dense`` (``item()``, ``bool(t)``, ``int(t)``, ``float(t)``),
    ``nonzero``, ``equal``, ``is_nonzero`` and ``masked_select`` (their output size depends on
    the values). On CUDA each of them waits for the device (a host synchronization), so counting
    them in a CPU run shows where a GPU step would stall, and a test can check that a step's count
    does not grow with the number of parameters, buckets or micro-groups.

    ``Tensor.tolist()``, ``.cpu()`` and ``.numpy()`` dispatch no operation on a CPU tensor (on a
    CUDA tensor each copies to the host), so while the block runs those methods are wrapped and
    counted too (this patches ``torch.Tensor`` for every thread of the process: a test helper).

    ``where`` counts each read by the innermost frame outside torch (``file:function:line``), so a
    failing check names the line that added a read. Not seen: ``.to("cpu")`` of a CPU tensor (a
    no-op that dispatches nothing) and reads inside gloo's threads. A read of a tensor that stays
    on the CPU in a GPU run (the status exchange's vector, ``torch.optim.AdamW``'s step counter) is
    counted too: it costs no synchronization there.
    """

    OPS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default",
                     "aten.is_nonzero.default", "aten.masked_select.default"})
    #: tensor methods counted as reads by a patch while the block runs (they dispatch nothing on a
    #: CPU tensor; on a CUDA tensor each copies to the host)
    METHODS = ("tolist", "cpu", "numpy")

    def __init__(self) -> None:
        #: reads per operation name
        self.ops: collections.Counter[str] = collections.Counter()
        #: reads per asking line (``file:function:line``, the innermost frame outside torch)
        self.where: collections.Counter[str] = collections.Counter()
        self._mode: Any = None
        self._patched: dict[str, Any] = {}  # method name -> the original, while the block runs

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __enter__(self) -> "HostReads":
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
                name = str(func)
                if name in HostReads.OPS:
                    reads._count(name)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        # reads that dispatch no operation on a CPU tensor (on a CUDA tensor each copies to the host)
        for method in HostReads.METHODS:
            real = getattr(torch.Tensor, method)
            self._patched[method] = real

            def counted(t: torch.Tensor, *a: Any, _real: Any = real, _name: str = f"Tensor.{method}", **k: Any) -> Any:
                reads._count(_name)
                return _real(t, *a, **k)

            setattr(torch.Tensor, method, counted)
        return self

    def _count(self, name: str) -> None:
        self.ops[name] += 1
        frame = next((f for f in reversed(traceback.extract_stack()[:-2])
                      if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__), None)
        self.where[f"{os.path.basename(frame.filename)}:{frame.name}:{frame.lineno}" if frame else "?"] += 1

    def __exit__(self, *exc: Any) -> None:
        for method, real in self._patched.items():
            setattr(torch.Tensor, method, real)
        self._patched = {}
        self._mode.__exit__(*exc)
        self._mode = None
