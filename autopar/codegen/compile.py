"""`torch.compile` of one block module, as torchtitan compiles each transformer block.

Compiling block by block keeps compile time bounded by one block's graph (identical blocks reuse the
compiled code: parameters are graph inputs) and leaves module paths and parameter names unchanged
(`nn.Module.compile` compiles the module's call in place), so tensor parallelism, `fully_shard` and
checkpoints see the same module tree. Activation recompute is applied first (autopar.codegen.recompute)
and is compiled with the block, as torchtitan orders them. TorchInductor fuses each chain of pointwise
ops into one kernel (Ansel et al. 2024, "PyTorch 2", §4: TorchInductor's loop-level fusion), which is
how the planner prices a compiled block (autopar.planner.compute_costs).
"""

from __future__ import annotations

import shutil

from torch import nn

from autopar.errors import PlanMismatchError

__all__ = ["apply_compile"]

_CXX = ("c++", "g++", "clang++")


def apply_compile(module: nn.Module) -> None:
    """Compile `module`'s call in place. Graph breaks fall back to eager for their part (fullgraph=False),
    so a block whose Python dynamo cannot follow still trains, only with less fusion. On CPU TorchInductor
    builds C++ kernels: without a C++ compiler on PATH the plan is refused here, not at the first step."""
    param = next(module.parameters(), None)
    if param is not None and param.device.type == "cpu" and not any(shutil.which(c) for c in _CXX):
        raise PlanMismatchError(f"the plan compiles blocks (compile=1) but no C++ compiler ({', '.join(_CXX)}) is on "
                                "PATH, which torch.compile needs on CPU; install one (e.g. g++) or re-plan with "
                                "--compile off")
    module.compile(fullgraph=False)
