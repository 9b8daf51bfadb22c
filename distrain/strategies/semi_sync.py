"""Semi-synchronous replica groups for slow links (``ddp_torchft`` with ``semi_sync``): torchft's ``LocalSGD`` and
``DiLoCo``, not ours.

Each replica group trains ``sync_every`` (H) steps alone, its gradients averaged within the group only, and then the
groups meet: ``local_sgd`` averages their parameters; ``diloco`` averages their pseudo-gradients (the change since
the last meeting) and applies the average with an outer optimizer (SGD with Nesterov momentum, as in the paper) to
the weights of the last meeting. Cross-group traffic falls H-fold, and a slow or lost group holds the others up once
every H steps instead of every step.

torchft runs the meeting from a post-hook of the inner optimizer: a quorum, the all-reduce, ``should_commit``; a
failed all-reduce drops the round (DiLoCo goes back to the weights of the last meeting). A group torchrun restarted
meets the others at their next meeting: it takes the live state of a running group (the loop's, and DiLoCo's weights
of the last meeting and outer optimizer), and then takes part in that same meeting, as the others do, so their
all-reduce is never left waiting for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MODES = ("local_sgd", "diloco")


class SemiSync:
    """torchft's LocalSGD or DiLoCo around ``model`` and its inner ``optimizer``, for one replica group."""

    def __init__(
        self, mode: str, manager, model: nn.Module, optimizer, sync_every: int, outer_lr: float, outer_momentum: float
    ):
        from torchft.local_sgd import DiLoCo, LocalSGD

        self.mode = mode
        if mode == "diloco":
            # SGD with Nesterov momentum over the pseudo-gradients: the outer optimizer of the DiLoCo paper
            nesterov = outer_momentum > 0
            self.outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
            self.engine = DiLoCo(manager, [model], optimizer, self.outer, sync_every)
        else:
            self.outer = None
            self.engine = LocalSGD(manager, model, optimizer, sync_every)
        self.engine.__enter__()  # the optimizer's post-hook meets the other groups every sync_every steps

    def close(self) -> None:
        self.engine.__exit__(None, None, None)

    def meet_after_healing(self) -> None:
        """Take part in the meeting the running groups are in (this group has just taken their state in its
        quorum): the same all-reduce and commit, so theirs completes; afterwards this group holds what they hold."""
        if self.mode == "diloco":
            fragment = self.engine._fragments[0]  # one fragment: the whole model (streaming DiLoCo is not wired in)
            fragment.prepare_sync()
            fragment.perform_sync()
        else:
            self.engine._perform_sync()
        self.engine._local_step = 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume the round exactly: the inner steps since the last meeting and, under
        DiLoCo, the weights of that meeting and the outer optimizer's momentum."""
        state: dict[str, Any] = {"local_step": self.engine._local_step}
        if self.mode == "diloco":
            fragment = self.engine._fragments[0]
            state["original_parameters"] = {k: v.clone() for k, v in fragment.original_parameters.items()}
            state["outer_optimizer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], source: str) -> None:
        steps = state.get("local_step")
        if type(steps) is not int or not 0 <= steps:
            raise ValueError(f"{source}: its semi-synchronous local_step is {steps!r}, not a count")
        if self.mode == "diloco":
            fragment = self.engine._fragments[0]
            original = state.get("original_parameters")
            if not isinstance(original, dict) or set(original) != set(fragment.original_parameters):
                raise ValueError(f"{source}: its DiLoCo weights of the last meeting do not match this model's")
            for name, value in original.items():
                if not isinstance(value, torch.Tensor) or value.shape != fragment.original_parameters[name].shape:
                    raise ValueError(f"{source}: its DiLoCo weights of the last meeting for {name} have another shape")
                fragment.original_parameters[name].copy_(value)
            self.outer.load_state_dict(state["outer_optimizer"])
        self.engine._local_step = steps
