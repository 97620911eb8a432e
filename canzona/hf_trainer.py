"""``canzona.hf.Trainer``: ``transformers.Trainer`` with canzona's optimizer, under torchrun.

A drop-in subclass: the same arguments, plus ``optimizer=`` (a canzona name such as ``"muon"``, or
any per-parameter ``torch.optim.Optimizer`` class), ``strategy=``, ``optimizer_kwargs=``,
``elementwise_optimizer=``, ``elementwise_kwargs=`` and ``canzona_kwargs=`` (any other
:class:`canzona.DistributedOptimizer` argument). What it changes, and why:

- **optimizer**: :meth:`create_optimizer` builds :class:`canzona.DistributedOptimizer` over the
  model (the lr schedulers the Trainer creates drive its two parameter groups, ``matrix`` and
  ``elementwise``, as they drive any torch optimizer). Defaults: ``lr`` and ``weight_decay``
  from ``TrainingArguments`` for both roles, and for torch's Adam or AdamW (the element-wise
  default) ``betas=(adam_beta1, adam_beta2)`` and ``eps=adam_epsilon`` too, so an ``adam_beta2=0.95`` reaches AdamW as it
  does under ``transformers.Trainer`` (:func:`hf_default_kwargs`). ``TrainingArguments.optim``
  must name torch's AdamW (``adamw_torch`` or the default ``adamw_torch_fused``, which canzona
  runs unfused: torch's fused CPU kernel is not exact on the pieces each rank holds,
  docs/robustness.md) and ``optim_args`` must be unset: any other choice is refused at
  construction in one line, since canzona's optimizers come from ``optimizer=`` and
  ``elementwise_optimizer=``.
- **weight decay**: as ``transformers.Trainer`` does, biases and norm weights
  (``get_decay_parameter_names``) of the element-wise role are stepped without weight decay: they go to
  :class:`~canzona.DistributedOptimizer`'s ``no_weight_decay`` (a second param group of the
  element-wise optimizer). ``canzona_kwargs={"no_weight_decay": [...]}`` replaces that list (an
  empty one decays every element-wise parameter).
- **no DDP**: canzona reduces the gradients itself (its buffer hooks take them and reduce-scatter
  per bucket); a ``DistributedDataParallel`` wrapper would all-reduce them again and write
  ``p.grad`` after canzona took it. The Trainer's accelerator prepares the model in its
  evaluation mode (mixed-precision autocast and compilation as configured; no DDP wrapper, and
  no second device placement: the Trainer placed the model when it was constructed), and wraps
  the optimizer without accelerate's state round trip at prepare time (``state_dict()`` is a
  collective in canzona).
- **clipping**: ``max_grad_norm`` goes to ``opt.clip_grad_norm_`` (:mod:`canzona.runtime.clip`),
  so the logged ``grad_norm`` is the true norm of the reduced gradients (``torch.nn.utils.clip_grad_norm_``
  finds no ``p.grad`` on the ZeRO-1 path); with ``max_grad_norm=0`` the norm is still logged,
  computed the same way without clipping.
- **gradient accumulation**: every micro-batch but the last of a step runs inside ``opt.no_sync()``.
- **zero_grad**: the Trainer clears gradients with ``model.zero_grad()``, which cannot reach
  canzona's buffer; the optimizer clears it after each step (a step post-hook).
- **checkpoints**: every rank takes part in saving and loading the optimizer
  (:func:`canzona.runtime.checkpoint.save_checkpoint` / ``load_checkpoint``, into
  ``canzona_optimizer.pt`` beside the Trainer's own files); the scheduler, RNG and trainer state
  are saved as the Trainer saves them, so ``resume_from_checkpoint`` continues bit for bit.

Without torch.distributed (no torchrun) the optimizer cannot be built: :meth:`create_optimizer`
says so. A plain ``transformers.Trainer(optimizers=(canzona_opt, sched))`` under torchrun wraps the
model in DDP and fails at the first step with a :class:`~canzona.runtime.buffer.GradSyncError`
naming this class.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers.trainer import SCHEDULER_NAME

from canzona.distributed import DistributedOptimizer, resolve_optimizer

__all__ = ["OPTIMIZER_FILE", "SERVED_OPTIM", "Trainer", "hf_default_kwargs"]

#: the optimizer's file in a Trainer checkpoint folder (the consolidated canzona document)
OPTIMIZER_FILE = "canzona_optimizer.pt"
#: the ``TrainingArguments.optim`` values this Trainer serves: torch's AdamW, which is its
#: element-wise default (run unfused; the default ``adamw_torch_fused`` included)
SERVED_OPTIM = ("adamw_torch", "adamw_torch_fused")


def hf_default_kwargs(cls: type[torch.optim.Optimizer], args: Any) -> dict[str, Any]:
    """The arguments a role's optimizer ``cls`` gets from ``TrainingArguments`` ``args`` when none
    are given: ``lr`` and ``weight_decay``, and for torch's Adam or AdamW (or a subclass)
    ``betas=(adam_beta1, adam_beta2)`` and ``eps=adam_epsilon``, as ``transformers.Trainer``
    builds its AdamW. Other optimizers keep their own betas and eps (SOAP's are not Adam's,
    Muon's ``eps`` is its Newton-Schulz normalization)."""
    out: dict[str, Any] = {"lr": args.learning_rate, "weight_decay": args.weight_decay}
    if issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        out["betas"] = (args.adam_beta1, args.adam_beta2)
        out["eps"] = args.adam_epsilon
    return out


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` running :class:`canzona.DistributedOptimizer` (see the module docstring)."""

    def __init__(
        self,
        *args: Any,
        optimizer: str | type[torch.optim.Optimizer] = "muon",
        strategy: str = "lb-asc",
        optimizer_kwargs: Mapping[str, Any] | None = None,
        elementwise_optimizer: str | type[torch.optim.Optimizer] = torch.optim.AdamW,
        elementwise_kwargs: Mapping[str, Any] | None = None,
        canzona_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise TypeError(
                "canzona.hf.Trainer builds its optimizer from optimizer=/strategy=/optimizer_kwargs=; "
                "do not pass optimizers=(optimizer, ...) (a scheduler alone goes in optimizers=(None, scheduler))"
            )
        self._canzona_args = {
            "optimizer": optimizer,
            "strategy": strategy,
            "optimizer_kwargs": dict(optimizer_kwargs) if optimizer_kwargs is not None else None,
            "elementwise_optimizer": elementwise_optimizer,
            "elementwise_kwargs": dict(elementwise_kwargs) if elementwise_kwargs is not None else None,
            **dict(canzona_kwargs or {}),
        }
        super().__init__(*args, **kwargs)
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if optim not in SERVED_OPTIM or self.args.optim_args:
            given = f"optim={optim!r}" + (f", optim_args={self.args.optim_args!r}" if self.args.optim_args else "")
            raise TypeError(
                f"TrainingArguments({given}) is not what canzona.hf.Trainer runs: its optimizers are optimizer= (default 'muon') "
                "and elementwise_optimizer= (default torch.optim.AdamW, given learning_rate, weight_decay, adam_beta1, adam_beta2 "
                f"and adam_epsilon); leave optim at {SERVED_OPTIM[1]!r} or {SERVED_OPTIM[0]!r} and pass the classes and their "
                "optimizer_kwargs= / elementwise_kwargs= instead"
            )
        self._keep_out_of_ddp()

    # ------------------------------------------------------------------------- accelerate
    def _keep_out_of_ddp(self) -> None:
        """Make this Trainer's accelerator prepare the model without DDP and the optimizer without
        a state round trip (instance attributes: other accelerators are untouched)."""
        acc = self.accelerator
        prepare_model, prepare_optimizer = acc.prepare_model, acc.prepare_optimizer

        def model_without_ddp(model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False) -> Any:
            # The Trainer placed the model on its device at construction, before the optimizer was
            # built; a second model.to() here would replace some parameters' storage (transformers'
            # .to re-assigns lm_head's), which the optimizer's parameter views are bound to.
            return prepare_model(model, device_placement=False, evaluation_mode=True)

        def optimizer_as_is(optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
            return prepare_optimizer(optimizer, device_placement=False)

        acc.prepare_model = model_without_ddp
        acc.prepare_optimizer = optimizer_as_is

    @property
    def canzona_optimizer(self) -> DistributedOptimizer:
        """The :class:`canzona.DistributedOptimizer` (``self.optimizer`` may be accelerate's wrapper)."""
        opt: Any = self.optimizer
        while opt is not None and not isinstance(opt, DistributedOptimizer):
            opt = getattr(opt, "optimizer", None)
        if opt is None:
            raise RuntimeError("the canzona optimizer is not built yet (it is created when training starts)")
        return opt

    # ------------------------------------------------------------------------- optimizer
    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "canzona.hf.Trainer needs torch.distributed: launch with torchrun (one process per rank; "
                "TrainingArguments(ddp_backend='gloo') on CPU)"
            )
        args = dict(self._canzona_args)
        model = model if model is not None else self.model
        if "no_weight_decay" not in args:  # transformers.Trainer's exemption: biases and norm weights
            from canzona.specs import module_roles

            decay = set(self.get_decay_parameter_names(model))
            # of the element-wise role only (a 2-D expert bias the matrix optimizer updates keeps its decay)
            roles = module_roles(model, args.get("roles"))
            args["no_weight_decay"] = [n for n, p in model.named_parameters()
                                       if p.requires_grad and n not in decay and roles[n][0] == "elementwise"]
        for key, role in (("optimizer_kwargs", "optimizer"), ("elementwise_kwargs", "elementwise_optimizer")):
            if args[key] is None:
                args[key] = hf_default_kwargs(resolve_optimizer(args[role], role), self.args)
        opt = DistributedOptimizer(model, args.pop("optimizer"), **args)
        # the Trainer clears gradients with model.zero_grad(), which cannot reach canzona's buffer
        opt.register_step_post_hook(lambda o, _args, _kwargs: o.zero_grad())
        self.optimizer = opt
        return opt

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return self.canzona_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            # the norm without clipping (max_norm=inf: the coefficient is 1), as the Trainer logs it
            grad_norm = self.canzona_optimizer.clip_grad_norm_(float("inf"))
        return grad_norm

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        # the Trainer marks the last micro-batch of an accumulation window as the one that syncs
        if self.accelerator.gradient_state.sync_gradients:
            return super().training_step(model, inputs, num_items_in_batch)
        with self.canzona_optimizer.no_sync():
            return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------------- checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from canzona.runtime.checkpoint import save_checkpoint

        save_checkpoint(self.canzona_optimizer, os.path.join(output_dir, OPTIMIZER_FILE))  # every rank
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        from canzona.runtime.checkpoint import load_checkpoint

        if checkpoint is None:
            return
        load_checkpoint(self.canzona_optimizer, os.path.join(checkpoint, OPTIMIZER_FILE))  # every rank; clear errors
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, map_location="cpu", weights_only=True))
