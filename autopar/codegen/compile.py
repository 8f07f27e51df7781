"""`torch.compile` of one block module, as torchtitan compiles each transformer block.

Compiling block by block keeps compile time bounded by one block's graph (identical blocks reuse the
compiled code: parameters are graph inputs) and leaves module paths and parameter names unchanged
(`nn.Module.compile` compiles the module's call in place), so tensor parallelism, `fully_shard` and
checkpoints see the same module tree. Activation recompute is applied first (autopar.codegen.recompute)
and is compiled with the block, as torchtitan orders them. TorchInductor fuses each chain of pointwise
ops into one kernel (Ansel et al. 2024, "PyTorch 2", §4: TorchInductor's loop-level fusion), which is
how the planner prices a compiled block (autopar.planner.compute_costs).

Under context parallelism a block's forward enters a torch function mode (codegen/context_parallel.py) inside
activation checkpointing's region. Dynamo traces the mode's handler but takes entering it for a side effect
that eager checkpointing would replay in backward and breaks the graph (the whole checkpointed block then
runs eagerly), unless `skip_fwd_side_effects_in_bwd_under_checkpoint` is set; a compiled backward recomputes
from the traced graph and replays no Python, so nothing is lost: the flag is set around such blocks' calls.
(Dynamo ignores a mode entered outside a checkpointed region while tracing its body, which is why each block
enters its own.)
"""

from __future__ import annotations

import functools
import shutil

import torch
from torch import nn

from autopar.errors import PlanMismatchError

__all__ = ["apply_compile"]

_CXX = ("c++", "g++", "clang++")
_MODE_IN_CHECKPOINT = "skip_fwd_side_effects_in_bwd_under_checkpoint"  # torch ≥ 2.9; before, such blocks run eagerly


def apply_compile(module: nn.Module, *, enters_modes: bool = False) -> None:
    """Compile `module`'s call in place. Graph breaks fall back to eager for their part (fullgraph=False),
    so a block whose Python dynamo cannot follow still trains, only with less fusion. On CPU TorchInductor
    builds C++ kernels: without a C++ compiler on PATH the plan is refused here, not at the first step.
    `enters_modes`: the block's forward enters a torch function mode (context parallelism; module docstring)."""
    param = next(module.parameters(), None)
    if param is not None and param.device.type == "cpu" and not any(shutil.which(c) for c in _CXX):
        raise PlanMismatchError(f"the plan compiles blocks (compile=1) but no C++ compiler ({', '.join(_CXX)}) is on "
                                "PATH, which torch.compile needs on CPU; install one (e.g. g++) or re-plan with "
                                "--compile off")
    module.compile(fullgraph=False)
    if enters_modes and hasattr(torch._dynamo.config, _MODE_IN_CHECKPOINT):
        compiled = module._compiled_call_impl  # what nn.Module.compile set; nn.Module.__call__ calls it

        @functools.wraps(compiled)
        def call(*args, **kwargs):
            with torch._dynamo.config.patch(**{_MODE_IN_CHECKPOINT: True}):
                return compiled(*args, **kwargs)
        module._compiled_call_impl = call
