"""Optimizer state in the shape torch expects: a per-rank ``state_dict()`` that DCP saves and loads.

``torch.distributed.checkpoint`` drives an object with ``state_dict()``/``load_state_dict()`` (a
``Stateful``) like this: to save, every rank calls ``state_dict()`` and writes the tensors it
returns (of a DTensor only its local chunks, at their global offsets; a plain tensor once, from
one rank); to load, every rank calls ``state_dict()`` to get the *target*, DCP reads the saved
values into the target's tensors in place, then it calls ``load_state_dict(target)``. So
``dcp.save({"model": model_sd, "optim": opt})`` and ``dcp.load(...)`` work with canzona's
optimizer, at any layout on either side, when :func:`sharded_state_dict` returns:

- ``<name>.master`` / ``<name>.state.<key>``: global tensors of the parameter's full shape as
  DTensors whose local tensor (``LocalShardsWrapper``) lists the regions this rank holds, as
  *views* of its masters and state (no copy; the regions are those of
  :func:`canzona.runtime.dcp.save_sharded`, so DCP re-shards them the same way; an expert's
  state tensors, of any shape, are entry ``e`` of the stack's ``(E, *shape)`` state);
  ``<name>.model``: the model's own values of the parameter, so a load leaves model and masters
  equal even where a rank's masters do not cover its model piece (ZeRO-1);
- ``<name>.pystate.<key>``: Python-valued state (ints, floats, bools) as 0-dim tensors;
- ``<name>.keys``: a 62-bit hash of the parameter's state entry names (0-dim), so that a load
  can tell "saved with no state" from "saved with these entries" from "saved with others";
- ``canzona.format`` (the format, the optimizer classes and the master dtype, hashed),
  ``canzona.steps`` and ``canzona.hyper.<group>.<key>`` (each numeric hyperparameter).

A fresh optimizer has no state tensors for DCP to read into: :func:`sharded_state_dict` then
returns zero-filled targets shaped by a throw-away step of the inner optimizer class at lr 0 on a
copy of the master (what ``torch.distributed.checkpoint.state_dict`` does to the optimizer
itself, here without touching it); the ``.keys`` entry still says "no state", so saving a fresh
optimizer saves none.

:func:`load_sharded_state_dict` checks everything (format, entry names, shapes, finiteness,
hyperparameter ranges) on every rank and joins a status exchange before it writes anything of
its own; then it copies each region into the live tensor (a no-op where DCP already wrote it in
place) and re-assembles what derives from the masters. Because DCP writes into the targets
before ``load_state_dict`` runs, a refusal at that point leaves the optimizer holding partly
loaded values: the error says so, and every later step or save raises
:class:`~canzona.runtime.agree.PartlyLoaded` on every rank until a load succeeds.

Every collective entry point first joins :func:`join_collective`: a rendezvous in the process
group's store, with no collective issued until every rank has arrived. A rank that calls
``state_dict()`` where another does not (e.g. only rank 0 saving) raises within
``status_timeout_s`` naming the ranks that did not come, and a rank arriving at the abandoned
call later raises at once; the process group stays usable, since no collective is left in flight.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from canzona.runtime.checkpoint import (
    FORMAT,
    Box,
    CheckpointError,
    Checkpointable,
    CollectiveMismatch,
    Held,
    check_hyper_section,
    expert_box,
    join_collective,
    load_consolidated_state_dict,
    agree_on_checkpoint,
    restore_hyperparams,
    scalar_tensor,
    whole_box,
)
from canzona.runtime.exchange import same_elements
from canzona.runtime.integrity import hash_text

__all__ = [
    "FORMAT_KEY",
    "NOT_SERVED",
    "STATE_FORMAT",
    "CollectiveMismatch",
    "OptimizerStateNotice",
    "ShardedOptimizerState",
    "TorchStateNotServed",
    "join_collective",
    "load_state",
    "load_sharded_state_dict",
    "sharded_state_dict",
]

STATE_FORMAT = "canzona.stateful"
STATE_VERSION = 1
FORMAT_KEY = "canzona.format"
#: the ``canzona.format`` code of a state_dict() taken while the optimizer's replica guard is
#: tripped (never a format hash, which is 62-bit non-negative): a load refuses it
UNLOADABLE = -1
STEPS_KEY = "canzona.steps"
HYPER_PREFIX = "canzona.hyper."


# ------------------------------------------------------------------------------ torch's state_dict API

#: why ``torch.distributed.checkpoint.state_dict``'s optimizer functions cannot serve canzona
NOT_SERVED = (
    "canzona's optimizer state is not a torch.optim state dict (each rank holds whole parameters' state or "
    "pieces of a ZeRO-1 buffer, not one shard of every parameter's), so torch.distributed.checkpoint.state_dict's "
    "get_optimizer_state_dict / set_optimizer_state_dict cannot serve it; save and load the optimizer itself: "
    "dcp.save({'model': model_sd, 'optim': opt}) / dcp.load(...) (it is a Stateful), or canzona.runtime.dcp.save_sharded / load_sharded"
)


class TorchStateNotServed(KeyError):
    """Raised where torch's optimizer state-dict API reads ``"state"`` / ``"param_groups"``."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return NOT_SERVED


class ShardedOptimizerState(dict):
    """What :func:`sharded_state_dict` returns: a plain dict of DCP entries that refuses, with
    :data:`NOT_SERVED`, to be read as a torch.optim state dict."""

    def __missing__(self, key: Any) -> Any:
        if key in ("state", "param_groups"):
            raise TorchStateNotServed(key)
        raise KeyError(key)


class OptimizerStateNotice(dict):
    """The front end's own ``Optimizer.state``: empty (the state lives in the inner optimizers) but
    true, so ``torch.distributed.checkpoint.state_dict`` does not take a zero-gradient lr-0 step
    of the real optimizer to "initialize" it (that step would advance every step counter) before
    it reaches ``state_dict()`` and is refused with :data:`NOT_SERVED`."""

    def __bool__(self) -> bool:
        return True


# ------------------------------------------------------------------------------ the per-rank form


def _format_code(src: Checkpointable) -> int:
    master = str(src.master_dtype).removeprefix("torch.")
    return hash_text(f"{STATE_FORMAT}|{STATE_VERSION}|{src.matrix_cls.__name__}|{src.elementwise_cls.__name__}|{master}")


def _keys_code(keys: Any) -> int:
    return hash_text("|".join(sorted(str(k) for k in keys)))


def _probe_state(h: Held) -> dict[str, Any]:
    """The state the inner optimizer would create for ``h``'s parameter: one step at lr 0 with a
    zero gradient of a throw-away instance over a copy of the master (the real one is untouched)."""
    opt, param = h.optimizer, h.param
    assert opt is not None and param is not None
    group = next((g for g in opt.param_groups if any(p is param for p in g["params"])), opt.param_groups[0])
    copy = param.detach().clone().requires_grad_(True)
    try:
        probe = type(opt)([copy])
        probe.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        probe.param_groups[0]["lr"] = 0.0
        copy.grad = torch.zeros_like(copy)
        probe.step()
    except Exception as exc:  # noqa: BLE001 - say which parameter and what to do
        raise CheckpointError(
            f"{h.name}: a fresh {type(opt).__name__} has no state to load into and a probe step failed "
            f"({type(exc).__name__}: {exc}); take one step first or use canzona.runtime.dcp.load_sharded"
        ) from None
    return {k: (torch.zeros_like(v) if torch.is_tensor(v) else v) for k, v in probe.state.get(copy, {}).items()}


def _entries(src: Checkpointable, probe: bool) -> Iterator[tuple[str, tuple[int, ...], tuple[Box, ...], torch.Tensor, bool]]:
    """(key, global shape, region, flat or whole values, sliced) for every tensor this rank holds;
    with ``probe``, held parameters without state get zero-filled targets (:func:`_probe_state`)."""
    shapes = {r.name: tuple(r.shape) for r in src.checkpoint_params()}
    for h in src.held():
        shape = shapes[h.name]
        if h.master is not None:
            yield f"{h.name}.master", shape, h.region, h.master.detach().reshape(-1), True
        if h.optimizer is None or h.param is None:
            continue
        state = dict(h.state())
        yield f"{h.name}.keys", (), (), torch.tensor(_keys_code(state), dtype=torch.int64), False
        if not state and probe:
            state = _probe_state(h)
        for k, v in state.items():
            if not torch.is_tensor(v):
                yield f"{h.name}.pystate.{k}", (), (), scalar_tensor(v, f"{h.name}.{k}"), False
            elif v.dim() == 0 or not h.sliced:
                yield f"{h.name}.state.{k}", tuple(v.shape), (whole_box(v.shape),), v.detach(), False
            elif h.expert is not None:  # its entry of the stack's per-expert state
                yield f"{h.name}.state.{k}", (shape[0], *v.shape), (expert_box(h.expert, tuple(v.shape)),), v.detach().unsqueeze(0), False
            else:
                if h.master is None or v.numel() != h.master.numel():
                    raise CheckpointError(f"{h.name}: element-wise optimizer state {k!r} has {v.numel()} elements, its piece is not that size")
                yield f"{h.name}.state.{k}", shape, h.region, v.detach().reshape(-1), True
    for mp in src.model_pieces():
        # an aliased piece's values are its master's, loaded through the master entry: a copy
        # here, so that DCP never writes the model entry's values into the master's storage
        local = mp.local.detach().clone() if mp.aliased else mp.local.detach()
        yield f"{mp.name}.model", shapes[mp.name], (mp.box,), local, False


def sharded_state_dict(src: Checkpointable) -> dict[str, Any]:
    """This rank's optimizer state in DCP's shape (see the module docstring). Collective: every
    rank calls it (:func:`join_collective`, then a status exchange)."""
    from canzona.runtime.dcp import CHUNK_BYTES, _Chunks

    join_collective(src, "state_dict()")
    # A tripped guard (replicas a failed step left different, a state a refused load left partly
    # loaded) still serves: dcp.load takes its targets from here, and loading a good checkpoint
    # is the way out. What dcp.save would write from it carries a format code no load accepts.
    unloadable = src.runtime.replicas.tripped()  # the same flag on every rank
    chunks, plain = _Chunks(CHUNK_BYTES), {}
    error: BaseException | None = None
    try:
        src.finish_param_sync()
        for key, shape, region, values, sliced in _entries(src, probe=True):
            if not shape:
                plain[key] = values
            elif sliced:
                chunks.add_region(key, shape, region, values)
            else:
                chunks.add_box(key, shape, region[0], values)
    except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
        error = exc
    agree_on_checkpoint(src, error, "state_dict()")
    out = ShardedOptimizerState({**chunks.state_dict(src.mesh), **plain})
    out[FORMAT_KEY] = torch.tensor(UNLOADABLE if unloadable else _format_code(src), dtype=torch.int64)
    out[STEPS_KEY] = torch.tensor(int(src.steps), dtype=torch.int64)
    for group, values in src.hyperparams().items():
        for k, v in values.items():
            t = _hyper_tensor(v)
            if t is not None:
                out[f"{HYPER_PREFIX}{group}.{k}"] = t
    return out


def _hyper_tensor(v: Any) -> torch.Tensor | None:
    t = scalar_tensor(v)
    if t is not None:
        return t
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return torch.tensor([float(x) for x in v], dtype=torch.float64)
    return None


def _py_value(t: torch.Tensor) -> Any:
    if t.dtype == torch.bool:
        return bool(t.item())
    if t.is_floating_point():
        return float(t.item()) if t.dim() == 0 else tuple(float(x) for x in t.tolist())
    return int(t.item())


# ------------------------------------------------------------------------------ loading it


def _pieces(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(global offsets, local tensor) of each chunk an entry of a state dict holds on this rank."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(value, DTensor):
        local = value.to_local()
        if isinstance(local, LocalShardsWrapper):
            return [(tuple(int(x) for x in o), t) for o, t in zip(local.local_offsets(), local.local_shards())]
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return [(tuple(offset), local)]
    if torch.is_tensor(value):
        return [((0,) * value.dim(), value)]
    raise CheckpointError(f"a {type(value).__name__} where a tensor was expected")


class _Load:
    """What a load writes: (destination view, source tensor) pairs, each held parameter's new
    state, the hyperparameters and the step count; built and checked before anything is written."""

    def __init__(self, src: Checkpointable, sd: Mapping[str, Any]) -> None:
        from canzona.runtime.dcp import CHUNK_BYTES, _slabs

        self.src, self.sd, self.cap, self.slabs = src, sd, CHUNK_BYTES, _slabs
        self.copies: list[tuple[torch.Tensor, torch.Tensor, str]] = []
        self.states: list[tuple[Held, dict[str, Any]]] = []
        if isinstance(sd, Mapping) and "param_groups" in sd and "state" in sd:
            raise CheckpointError(NOT_SERVED)
        if not isinstance(sd, Mapping) or FORMAT_KEY not in sd:
            raise CheckpointError(
                "load_state_dict takes what state_dict() returns on every rank (after dcp.load wrote into it) or a "
                "consolidated document (opt.consolidated_state_dict(), canzona.runtime.checkpoint.save_checkpoint)"
            )
        if int(self._plain(FORMAT_KEY)) == UNLOADABLE:
            raise CheckpointError(
                "this checkpoint was saved (dcp.save) from an optimizer whose state a failed step or a refused load had "
                "left inconsistent; load one saved before that"
            )
        if int(self._plain(FORMAT_KEY)) != _format_code(src):
            raise CheckpointError(
                f"state was saved by another optimizer ({STATE_FORMAT}: optimizer classes or master dtype differ from "
                f"{src.matrix_cls.__name__} + {src.elementwise_cls.__name__}, {src.master_dtype})"
            )
        self.steps = int(self._plain(STEPS_KEY))
        if self.steps < 0:
            raise CheckpointError(f"the saved step count {self.steps} is negative")
        self.hyper: dict[str, dict[str, Any]] = {}
        for key, v in sd.items():
            if isinstance(key, str) and key.startswith(HYPER_PREFIX):
                group, _, k = key.removeprefix(HYPER_PREFIX).partition(".")
                self.hyper.setdefault(group, {})[k] = _py_value(self._plain(key))
        check_hyper_section(self.hyper)
        shapes = {r.name: tuple(r.shape) for r in src.checkpoint_params()}
        for h in src.held():
            if h.master is not None:
                self._region(f"{h.name}.master", shapes[h.name], h.region, h.master.detach().reshape(-1))
            if h.optimizer is not None and h.param is not None:
                self.states.append((h, self._state(h, shapes[h.name])))
        for mp in src.model_pieces():
            # checked like every entry; an aliased piece is written through its master only
            self._box(f"{mp.name}.model", mp.box, mp.local.detach(), write=not mp.aliased)

    def _plain(self, key: str) -> torch.Tensor:
        v = self.sd.get(key)
        if not torch.is_tensor(v):
            raise CheckpointError(f"state dict lacks {key!r}")
        return v

    def _box(self, key: str, box: Box, dest: torch.Tensor, write: bool = True) -> None:
        if dest.dim() and dest.numel() == 0:
            return  # an empty piece: nothing saved, nothing to load
        if key not in self.sd:
            raise CheckpointError(f"state dict lacks {key!r}")
        have = {(o, tuple(t.shape)): t for o, t in _pieces(self.sd[key])}
        for off, view in self.slabs(box, dest, self.cap) if dest.dim() else [((), dest)]:
            got = have.get((tuple(off), tuple(view.shape)))
            if got is None:
                raise CheckpointError(
                    f"{key}: the state dict holds other regions than this rank does; load_state_dict takes this "
                    "optimizer's own state_dict() form (dcp.load re-shards it, or canzona.runtime.dcp.load_sharded)"
                )
            if got.is_floating_point() and not bool(torch.isfinite(got).all()):
                raise CheckpointError(f"{key}: holds NaN or inf")
            if write:
                self.copies.append((view, got, key))

    def _region(self, key: str, shape: tuple[int, ...], region: tuple[Box, ...], flat: torch.Tensor) -> None:
        pos = 0
        for box in region:
            n = math.prod(box[1])
            self._box(key, box, flat[pos : pos + n].view(box[1]))
            pos += n

    def _state(self, h: Held, shape: tuple[int, ...]) -> dict[str, Any]:
        prefix, py = f"{h.name}.state.", f"{h.name}.pystate."
        names = {k[len(prefix) :]: k for k in self.sd if isinstance(k, str) and k.startswith(prefix)}
        pys = {k[len(py) :]: k for k in self.sd if isinstance(k, str) and k.startswith(py)}
        saved = int(self._plain(f"{h.name}.keys"))
        if saved == _keys_code(()):
            return {}
        if saved != _keys_code([*names, *pys]):
            raise CheckpointError(f"{h.name}: the saved optimizer state has other entries than {sorted([*names, *pys])}")
        old, new = h.state(), {}
        for k, key in names.items():
            pieces = _pieces(self.sd[key])
            sample = pieces[0][1] if pieces else None
            size = tuple(self.sd[key].shape)
            expert = h.expert is not None and len(size) > 0
            if expert:
                if size[0] != shape[0]:
                    raise CheckpointError(f"{h.name}: state {k!r} has shape {size}, expected one entry per expert ({shape[0]}, ...)")
                sample = sample[0] if sample is not None and sample.dim() == len(size) else None
            whole = expert or not (h.sliced and size == shape and len(shape) > 0)
            local = size[1:] if expert else size if whole else tuple(h.master.shape if h.master is not None else (sum(math.prod(b[1]) for b in h.region),))
            dtype = sample.dtype if sample is not None else torch.float32
            t = old.get(k)
            if not (torch.is_tensor(t) and tuple(t.shape) == local and t.dtype == dtype):
                stride = sample.stride() if whole and sample is not None and tuple(sample.shape) == local else None
                t = torch.empty_strided(local, stride, dtype=dtype, device=h.param.device) if stride else torch.empty(local, dtype=dtype, device=h.param.device)  # type: ignore[union-attr]
            new[k] = t
            if expert:
                self._box(key, expert_box(h.expert, local), t.unsqueeze(0))  # type: ignore[arg-type]
            elif whole:
                self._box(key, whole_box(local), t)
            else:
                self._region(key, shape, h.region, t.view(-1))
        for k, key in pys.items():
            new[k] = _py_value(self._plain(key))
        return new

    def shares_memory(self) -> bool:
        """Whether any source is a view of a destination (DCP wrote in place: a refusal now
        leaves partly loaded values)."""
        return any(d.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() for d, s, _ in self.copies)

    def commit(self) -> None:
        with torch.no_grad():
            for dest, srct, _ in self.copies:
                if not same_elements(dest, srct):
                    dest.copy_(srct)
            for h, st in self.states:
                h.optimizer.state[h.param] = st  # type: ignore[union-attr,index]
        restore_hyperparams(self.src, self.hyper)
        self.src.finish_load(self.steps)


def load_sharded_state_dict(src: Checkpointable, sd: Mapping[str, Any]) -> None:
    """Load what :func:`sharded_state_dict` returned on this rank (after ``dcp.load`` read a
    checkpoint into it, or unchanged). Collective: every rank calls it. Checked on every rank
    before anything of the optimizer's own is written (see the module docstring)."""
    join_collective(src, "load_state_dict()")
    error: BaseException | None = None
    plan: _Load | None = None
    try:
        src.finish_param_sync()
        plan = _Load(src, sd)
    except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
        error = exc
    try:
        agree_on_checkpoint(src, error, "load_state_dict()")
    except CheckpointError as exc:
        if plan is not None and plan.shares_memory() or _in_place(src, sd):
            # steps and saves now refuse on every rank (each took this branch: the same exchange,
            # the same state_dict() targets) until a load succeeds
            src.runtime.replicas.partly_loaded(str(exc))
            raise CheckpointError(f"{exc}; dcp.load had already written into this optimizer's tensors: steps and saves "
                                  "are refused until a good checkpoint is loaded") from None
        raise
    assert plan is not None
    plan.commit()


def _in_place(src: Checkpointable, sd: Any) -> bool:
    """Whether ``sd``'s tensors are views of the optimizer's masters (what DCP loads into)."""
    if not isinstance(sd, Mapping):
        return False
    ptrs = {h.master.untyped_storage().data_ptr() for h in src.held() if h.master is not None}
    for h in src.held():
        v = sd.get(f"{h.name}.master")
        if v is not None:
            try:
                return any(t.untyped_storage().data_ptr() in ptrs for _, t in _pieces(v))
            except CheckpointError:
                return False
    return False


def load_state(src: Checkpointable, state: Mapping[str, Any]) -> None:
    """``load_state_dict``'s two accepted forms: a consolidated document (every rank passes the
    whole document: :func:`canzona.runtime.checkpoint.load_consolidated_state_dict`) or this
    rank's :func:`sharded_state_dict` form (:func:`load_sharded_state_dict`)."""
    if isinstance(state, Mapping) and state.get("format") == FORMAT:
        load_consolidated_state_dict(src, state)
    else:
        load_sharded_state_dict(src, state)
