"""What the optimizers over fp32 masters share (`HostOptimizer`, `DistributedOptimizer`): the user's torch
optimizer stepping copies of some model parameters, built by the user's factory under the parameters' names
so its parameter groups, hyper-parameters and LR schedules stay the user's."""

from __future__ import annotations

import torch

__all__ = ["MasterOptimizer"]


class MasterOptimizer:
    """`params[i]` is stepped through `masters[i]` by `optimizer` (the user's); subclasses fill the three."""

    params: list[torch.nn.Parameter]
    masters: list[torch.Tensor]
    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def master_names(self, names: dict[int, list[str]]) -> dict[int, list[str]]:
        """`names` (id of a model parameter → its names) re-keyed by the id of its master."""
        return {id(m): names[id(p)] for p, m in zip(self.params, self.masters, strict=True) if id(p) in names}
