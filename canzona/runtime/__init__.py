"""canzona's torch.distributed machinery: collectives, the ZeRO-1, TP and FSDP2 runtimes, checkpoints, launch.

Importing this package (``canzona.distributed``, ``canzona.train`` and the launchers do) also makes
sure ``torch.distributed.nn.functional`` does not hold the default process group. That module gives
its functions ``group=group.WORLD`` as a default argument, evaluated when it is first imported;
torch's FSDP package imports it, and canzona imports FSDP lazily, after the group has formed. Those
defaults would then hold the default group to interpreter shutdown, so its gloo worker threads
outlive ``destroy_process_group``, and one of them releasing a tensor while the interpreter
finalizes aborts the process ("terminate called without an active exception", at random, after a
run that succeeded). Imported before any group, the defaults are ``None``; where a group already
formed (a launcher such as accelerate that joins it before canzona is imported), a default that is
that group is replaced by ``None``, which those functions read as the same group.
``tests/test_lifetime.py`` checks both.
"""

import torch.distributed as _dist
import torch.distributed.nn.functional as _nn_functional


def _unpin_default_group() -> None:
    world = _dist.GroupMember.WORLD
    if world is None:
        return
    for fn in vars(_nn_functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if getattr(fn, "__module__", None) == _nn_functional.__name__ and defaults and any(d is world for d in defaults):
            fn.__defaults__ = tuple(None if d is world else d for d in defaults)


_unpin_default_group()
