"""The ZeRO-1 gradient buffer: plan geometry, backward hooks, bucket readiness order (single process)."""

from __future__ import annotations

import pytest
import torch

from canzona.plan import PlanInputs, make_plan
from canzona.runtime.buffer import GradBuffer, GradSyncError
from canzona.specs import specs_from_module
from validation.harness import ToyModel, inject_grads, integer_grads


def _plan(model: torch.nn.Module, strategy: str = "lb-asc", dp: int = 2, bucket_numel: int = 40):
    specs = specs_from_module(model)
    inputs = PlanInputs(
        model="toy", layout="module", dp=dp, tp=1, optimizer="muon", strategy=strategy, tp_schedule="sync", bucket_numel=bucket_numel
    )
    return make_plan(specs, inputs)


def _buffer(model: torch.nn.Module, **kw):
    plan = _plan(model, **kw)
    launched: list[int] = []
    buf = GradBuffer(plan, dict(model.named_parameters()), on_ready=launched.append)
    buf.attach()
    return plan, buf, launched


def test_slots_follow_plan_geometry_and_hooks_fill_them() -> None:
    model = ToyModel()
    plan, buf, launched = _buffer(model)
    assert len(plan.buckets) > 2
    base = buf.data.data_ptr()
    for pp in plan.params:
        slot = buf.slots[pp.name]
        assert (slot.data_ptr() - base) // 4 == plan.buckets[pp.bucket].start + pp.offset
        assert slot.numel() == pp.numel
    grads = integer_grads(model, step=0, rank=0)
    inject_grads(model, grads)
    for n, p in model.named_parameters():
        assert p.grad is None, "the hook frees p.grad once the buffer holds it"
        assert torch.equal(buf.slots[n], grads[n].reshape(-1))
    # backward produces gradients back to front, so buckets complete (and launch) in index order
    assert launched == list(range(len(plan.buckets)))
    assert buf.all_launched


def test_ready_buckets_launch_in_index_order_only() -> None:
    model = ToyModel()
    plan, buf, launched = _buffer(model)
    named = dict(model.named_parameters())
    last = plan.buckets[-1]
    for n in last.params:  # complete the last bucket first
        named[n].grad = torch.ones_like(named[n])
        buf.accumulate(n, named[n])
    assert launched == [], "a later bucket must wait for the earlier ones (one collective order on every rank)"
    for b in plan.buckets[:-1]:
        for n in b.params:
            named[n].grad = torch.ones_like(named[n])
            buf.accumulate(n, named[n])
    assert launched == list(range(len(plan.buckets)))


def test_no_sync_accumulates_then_launches() -> None:
    model = ToyModel()
    _, buf, launched = _buffer(model)
    g1, g2 = integer_grads(model, step=0, rank=0), integer_grads(model, step=1, rank=0)
    with buf.no_sync():
        inject_grads(model, g1)
    assert launched == []
    inject_grads(model, g2)
    assert buf.all_launched
    for n in g1:
        assert torch.equal(buf.slots[n], (g1[n] + g2[n]).reshape(-1))


def test_gradient_after_launch_is_an_error_and_reset_recovers() -> None:
    model = ToyModel()
    _, buf, launched = _buffer(model)
    inject_grads(model, integer_grads(model, step=0, rank=0))
    with pytest.raises(GradSyncError, match="after its bucket's collective was launched"):
        inject_grads(model, integer_grads(model, step=1, rank=0))
    buf.reset()
    assert not buf.all_launched and int(buf.data.count_nonzero()) == 0
    launched.clear()
    inject_grads(model, integer_grads(model, step=2, rank=0))
    assert buf.all_launched and launched


def test_flush_takes_direct_grads_and_launches_incomplete_buckets() -> None:
    model = ToyModel()
    plan, buf, launched = _buffer(model)
    named = dict(model.named_parameters())
    grads = integer_grads(model, step=0, rank=0)
    first = plan.buckets[0].params[0]
    named[first].grad = grads[first].clone()  # set directly, no backward; every other parameter has none
    buf.flush()
    assert launched == list(range(len(plan.buckets)))
    assert torch.equal(buf.slots[first], grads[first].reshape(-1))
    assert named[first].grad is None
    assert int(buf.data.count_nonzero()) == int(grads[first].count_nonzero())


def test_low_precision_grads_accumulate_exactly_in_fp32() -> None:
    model = ToyModel(dtype=torch.bfloat16)
    plan = _plan(model)
    buf = GradBuffer(plan, dict(model.named_parameters()), dtype=torch.float32)
    buf.attach()
    grads = integer_grads(model, step=0, rank=0, dtype=torch.bfloat16)
    inject_grads(model, grads)
    for n in grads:
        assert torch.equal(buf.slots[n], grads[n].float().reshape(-1))


def test_plan_for_other_shapes_is_rejected() -> None:
    plan = _plan(ToyModel())
    other = ToyModel(ffn=12)
    with pytest.raises(ValueError, match="the plan expects"):
        GradBuffer(plan, dict(other.named_parameters()))


# ------------------------------------------------------------------------------ other code's hooks


def _real_backward(model: ToyModel, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    model.loss(torch.randint(0, 13, (3, 7), generator=g)).backward()


def _reference_grads(seed: int = 0) -> dict[str, torch.Tensor]:
    ref = ToyModel()
    _real_backward(ref, seed)
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("when", ["before", "after"])
def test_hooks_of_other_code_see_the_gradient_and_the_buffer_sees_theirs(when: str) -> None:
    """A post-accumulate-grad hook registered before or after canzona's (a TP plan that all-reduces a
    replicated parameter's gradient, a user hook) receives ``p.grad`` set, and what it leaves in
    ``p.grad`` (here: the gradient times 3, in place or replaced) is what the buffer takes."""
    model = ToyModel()
    named = dict(model.named_parameters())
    seen: dict[str, bool] = {}

    def user_hook(name: str):
        def hook(p: torch.Tensor) -> None:
            seen[name] = p.grad is not None
            if name.endswith("bias"):
                p.grad.mul_(3)  # in place, as an all-reduce does
            else:
                p.grad = p.grad * 3  # replaced

        return hook

    def register() -> None:
        for n, p in named.items():
            p.register_post_accumulate_grad_hook(user_hook(n))

    if when == "before":
        register()
    plan, buf, launched = _buffer(model)
    if when == "after":
        register()
    _real_backward(model)
    assert seen == dict.fromkeys(named, True), f"hooks saw p.grad None: {sorted(n for n, v in seen.items() if not v)}"
    ref = _reference_grads()
    for n, p in named.items():
        assert p.grad is None, "the buffer frees p.grad once every hook has run"
        assert torch.equal(buf.slots[n], (ref[n] * 3).reshape(-1)), n
    assert launched == list(range(len(plan.buckets))) and buf.all_launched


def test_node_hooks_and_plain_tensor_hooks_run_before_the_gradient_is_taken() -> None:
    """A hook on the parameter's ``AccumulateGrad`` node (DDP-style reducers) runs after every
    post-accumulate hook; the buffer still takes the gradient only after it."""
    model = ToyModel()
    named = dict(model.named_parameters())
    _, buf, _ = _buffer(model)
    acc_nodes = []  # keep the nodes alive: their hooks live on them
    for n, p in named.items():
        node = p.view_as(p).grad_fn.next_functions[0][0]

        def hook(_grad_inputs, _grad_outputs, p=p) -> None:
            assert p.grad is not None
            p.grad.add_(1)

        node.register_hook(hook)
        acc_nodes.append(node)
    _real_backward(model)
    ref = _reference_grads()
    for n in named:
        assert torch.equal(buf.slots[n], (ref[n] + 1).reshape(-1)), n


def test_buckets_still_launch_during_backward() -> None:
    """Deferring each gradient by one parameter keeps the per-bucket overlap: the first bucket is
    launched while autograd is still producing the last bucket's gradients."""
    model = ToyModel()
    plan, buf, launched = _buffer(model, bucket_numel=20)
    assert len(plan.buckets) >= 3
    named = dict(model.named_parameters())
    at_last_bucket: list[list[int]] = []
    for n in plan.buckets[-1].params:
        named[n].register_post_accumulate_grad_hook(lambda _p: at_last_bucket.append(list(launched)))
    _real_backward(model)
    assert at_last_bucket and all(0 in seen for seen in at_last_bucket), at_last_bucket
    assert launched == list(range(len(plan.buckets)))


def test_a_failed_backward_leaves_nothing_stale() -> None:
    """A backward pass that raises in a hook never runs its end-of-backward callback; the next pass
    queues its own, and every gradient is still taken."""
    model = ToyModel()
    plan, buf, launched = _buffer(model)
    named = dict(model.named_parameters())
    fail = {"on": True}

    def boom(_p: torch.Tensor) -> None:
        if fail["on"]:
            raise RuntimeError("boom")

    first = plan.buckets[-1].params[0]
    named[first].register_post_accumulate_grad_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        _real_backward(model)
    buf.reset()
    launched.clear()
    for p in named.values():
        p.grad = None
    fail["on"] = False
    _real_backward(model)
    assert buf.all_launched and launched == list(range(len(plan.buckets)))
    ref = _reference_grads()
    for n in named:
        assert torch.equal(buf.slots[n], ref[n].reshape(-1)), n


# ------------------------------------------------------------------------------ gradients straight into the buffer


def _views_of_buffer(buf: GradBuffer, model: torch.nn.Module) -> dict[str, bool]:
    """Per parameter: whether the ``p.grad`` a post-accumulate hook sees is its slot of the buffer."""
    seen: dict[str, bool] = {}
    for n, p in model.named_parameters():
        def hook(q: torch.Tensor, n: str = n) -> None:
            seen[n] = q.grad is not None and q.grad.data_ptr() == buf.slots[n].data_ptr()

        p.register_post_accumulate_grad_hook(hook)
    return seen


def test_autograd_accumulates_straight_into_the_slots() -> None:
    """A real backward: every fp32 parameter's gradient is accumulated by autograd into its slot (no
    copy), hooks see ``p.grad`` as that slot, and the slots equal a plain backward bitwise."""
    model = ToyModel()
    plan, buf, launched = _buffer(model)
    assert buf.viewable == {pp.name for pp in plan.params}
    seen = _views_of_buffer(buf, model)
    _real_backward(model)
    ref = _reference_grads()
    assert seen == dict.fromkeys(ref, True)
    assert buf.in_place == set(ref)
    for n, p in model.named_parameters():
        assert p.grad is None
        assert torch.equal(buf.slots[n], ref[n].reshape(-1)), n
    assert launched == list(range(len(plan.buckets)))


def test_grad_views_off_copies_every_gradient_and_gives_the_same_slots() -> None:
    model = ToyModel()
    plan = _plan(model)
    buf = GradBuffer(plan, dict(model.named_parameters()), grad_views=False)
    buf.attach()
    seen = _views_of_buffer(buf, model)
    _real_backward(model)
    assert buf.viewable == frozenset() and buf.in_place == set()
    assert not any(seen.values())
    ref = _reference_grads()
    for n in ref:
        assert torch.equal(buf.slots[n], ref[n].reshape(-1)), n


def test_no_sync_hands_out_the_slot_only_while_it_is_zero() -> None:
    """Under no_sync only the first micro-batch lands in place; the second is copied, so a hook
    sees each backward's own gradient (never the running sum), as without views."""
    model = ToyModel()
    _, buf, launched = _buffer(model)
    got: dict[str, list[torch.Tensor]] = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda q, n=n: got.setdefault(n, []).append(q.grad.clone()))
    with buf.no_sync():
        _real_backward(model, seed=0)
    assert buf.in_place == set(got) and launched == []
    _real_backward(model, seed=1)
    assert buf.in_place == set(got) and buf.all_launched  # the second pass added nothing in place
    ref0, ref1 = _reference_grads(0), _reference_grads(1)
    for n in ref0:
        assert torch.equal(got[n][0], ref0[n]) and torch.equal(got[n][1], ref1[n]), n
        assert torch.equal(buf.slots[n], (ref0[n] + ref1[n]).reshape(-1)), n


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_autograd_grad_and_create_graph_leave_the_buffer_right() -> None:
    """``torch.autograd.grad`` never accumulates into ``p.grad``: no slot is handed out (a tensor
    hook would have been). ``create_graph=True`` rebuilds ``p.grad`` out of place: it is copied."""
    model = ToyModel()
    _, buf, launched = _buffer(model)
    g = torch.Generator().manual_seed(0)
    loss = model.loss(torch.randint(0, 13, (3, 7), generator=g))
    torch.autograd.grad(loss, list(model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and launched == [] and buf.received == set()
    assert int(buf.data.count_nonzero()) == 0
    g = torch.Generator().manual_seed(0)
    model.loss(torch.randint(0, 13, (3, 7), generator=g)).backward(create_graph=True)
    ref = _reference_grads()
    assert buf.in_place == set() and buf.all_launched
    for n, p in model.named_parameters():
        assert p.grad is None
        assert torch.equal(buf.slots[n], ref[n].reshape(-1)), n


def test_a_replacement_that_reads_the_buffer_is_kept_before_the_slot_is_cleared() -> None:
    """A hook replaces ``p.grad`` of the square ``mix.weight`` by its transpose, a view of the slot:
    the buffer must take the transpose, not zeros."""
    model = ToyModel()
    _, buf, _ = _buffer(model)
    model.mix.weight.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", q.grad.t()))
    _real_backward(model)
    ref = _reference_grads()
    assert "mix.weight" not in buf.in_place
    assert torch.equal(buf.slots["mix.weight"], ref["mix.weight"].t().reshape(-1))


def test_reset_after_a_failed_backward_drops_handed_out_slots() -> None:
    """A backward that fails in a hook can leave ``p.grad`` as a slot; reset() (zero_grad) clears
    them, so the next backward neither reads nor doubles stale values."""
    model = ToyModel()
    plan, buf, launched = _buffer(model)
    first = plan.buckets[-1].params[0]
    fail = {"on": True}

    def boom(_p: torch.Tensor) -> None:
        if fail["on"]:
            raise RuntimeError("boom")

    dict(model.named_parameters())[first].register_post_accumulate_grad_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        _real_backward(model)
    left = [n for n, p in model.named_parameters() if p.grad is not None]
    assert left, "the failed pass should leave a handed-out slot behind"
    buf.reset()
    assert all(p.grad is None for p in model.parameters())
    fail["on"] = False
    launched.clear()
    _real_backward(model)
    ref = _reference_grads()
    for n in ref:
        assert torch.equal(buf.slots[n], ref[n].reshape(-1)), n
    assert buf.in_place == set(ref)


def test_low_precision_parameters_keep_the_copy() -> None:
    model = ToyModel(dtype=torch.bfloat16)
    buf = GradBuffer(_plan(model), dict(model.named_parameters()), dtype=torch.float32)
    assert buf.viewable == frozenset()
