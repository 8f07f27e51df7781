"""FP8 GEMMs through torchao's float8 training (torchao.float8), as torchtitan applies it.

The model's linears are swapped for `Float8Linear` *before* any sharding (the order torchtitan uses:
convert → tensor parallelism → recompute → compile → FSDP), so every later stage sees float8 modules:
- tensor parallelism uses torchao's float8 TP styles for tensorwise scaling (the activations
  all-gathered under sequence parallelism travel in float8); rowwise scaling keeps the plain styles
  (torchao ships float8 TP styles for tensorwise scaling only);
- FSDP2 all-gathers float8 weights under tensorwise scaling (`enable_fsdp_float8_all_gather`, half
  the bytes of a 16-bit gather); their scales are precomputed once per step for all weights in one
  all-reduce (`precompute_float8_dynamic_scale_for_fsdp`), as torchtitan does after the optimizer step.
Which linears are converted: every `nn.Linear` outside the LM head whose input and output features,
and their per-rank shares under tensor parallelism, are multiples of 16 (`torch._scaled_mm` requires
it; torchao's own auto-filter keeps the same rule and skips the LM head too). The planner prices the
same set (`autopar.planner.fp8_costs`).
On devices without FP8 tensor cores (CPUs, GPUs below compute capability 8.9) torchao's emulation
(`Float8LinearConfig(emulate=True)`) runs the same casts and scales with a high-precision matmul, so
the CPU tests exercise the real conversion, sharding and collectives; only the FP8 GEMM kernel differs.
torchao is imported here only when a plan asks for FP8 (importing it costs seconds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from autopar.capture.graph import ModelGraph
from autopar.config import FP8_RUNTIME_RECIPES
from autopar.errors import PlanMismatchError

__all__ = ["FP8_DIM_MULTIPLE", "float8_linear_names", "convert_float8", "float8_supported", "is_float8_linear",
           "tp_style", "precompute_fsdp_scales"]

FP8_DIM_MULTIPLE = 16  # torch._scaled_mm: K and N multiples of 16 (torchao float8_linear_utils._auto_filter_for_*)
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores (NVIDIA H100 datasheet; CUDA C guide §FP8)


def _head_modules(graph: ModelGraph) -> set[str]:
    """Module paths of the LM head: left in 16 bits (torchao and torchtitan skip the output projection,
    whose logits the loss is sensitive to)."""
    out: set[str] = set()
    for layer in graph.layers:
        if layer.kind == "head":
            out.update(layer.modules or (layer.name,))
        for pattern in layer.tp_patterns:
            if pattern.kind == "lm_head":
                out.update(pattern.column)
    return out


def _inside(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def float8_linear_names(model: nn.Module, graph: ModelGraph, tp: int) -> tuple[str, ...]:
    """Fully qualified names of the linears FP8 training converts under tensor-parallel degree `tp`."""
    head = _head_modules(graph)
    column = {n for la in graph.layers for p in la.tp_patterns if p.kind in ("mlp", "attention") for n in p.column}
    row = {n for la in graph.layers for p in la.tp_patterns if p.kind in ("mlp", "attention") for n in p.row}
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or _inside(name, head):
            continue
        k, n = module.in_features, module.out_features
        k_local = k // tp if name in row else k
        n_local = n // tp if name in column else n
        if all(d % FP8_DIM_MULTIPLE == 0 for d in (k, n, k_local, n_local)):
            names.append(name)
    return tuple(names)


def float8_supported(device: torch.device) -> bool:
    """Whether `device` runs FP8 GEMMs natively (otherwise torchao emulates them)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def _config(recipe: str, *, emulate: bool, fsdp_float8_all_gather: bool):
    from torchao.float8 import Float8LinearConfig

    if recipe not in FP8_RUNTIME_RECIPES["torchao"]:
        raise PlanMismatchError(f"fp8={recipe!r} is a Transformer Engine recipe autopar prices but does not run (its "
                                f"codegen runs torchao's {FP8_RUNTIME_RECIPES['torchao']}); plan with "
                                "PlannerOptions(fp8_runtime='torchao') and fp8='tensorwise' or 'rowwise'")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise PlanMismatchError(f"float8 all-gather under FSDP needs tensorwise scaling, not {recipe!r}")
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def convert_float8(model: nn.Module, names: Iterable[str], recipe: str, *, device: torch.device,
                   fsdp_float8_all_gather: bool = False) -> int:
    """Swap the linears `names` of `model` for torchao `Float8Linear`s in place; returns how many.

    Call before any sharding. `fsdp_float8_all_gather`: the weights become torchao's float8-castable
    tensor subclass that FSDP2 all-gathers in float8 (tensorwise scaling only).
    """
    wanted = set(names)
    if not wanted:
        raise PlanMismatchError(
            f"the plan trains with fp8={recipe!r} but no linear of this model qualifies (outside the LM head, "
            f"features multiples of {FP8_DIM_MULTIPLE} per tensor-parallel rank); re-plan with --fp8 none")
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:  # pragma: no cover - torchao is a dependency of FP8 plans only
        raise PlanMismatchError(f"the plan trains with FP8 (float8 training) but {e.name} is not installed; "
                                f"pip install {e.name}, or re-plan with --fp8 none") from e
    config = _config(recipe, emulate=not float8_supported(device), fsdp_float8_all_gather=fsdp_float8_all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn in wanted)
    converted = sum(1 for n, m in model.named_modules() if n in wanted and is_float8_linear(m))
    if converted != len(wanted):
        raise PlanMismatchError(f"the float8 conversion converted {converted} of the {len(wanted)} linears the plan "
                                "prices in FP8")
    return converted


def is_float8_linear(module: nn.Module) -> bool:
    """A torchao `Float8Linear` (checked by class name, so that callers need not import torchao)."""
    return any(c.__name__ == "Float8Linear" for c in type(module).__mro__)


def tp_style(module: nn.Module, style: str, **kwargs):
    """The tensor-parallel style `style` ("colwise" or "rowwise") for `module`: torchao's float8 variant for a
    tensorwise-scaled `Float8Linear` (its activations cast before they are gathered), else DTensor's own."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # torchao's float8 styles cast the output's gradient to float8 before a bias sees it (torchtitan's models have
    # no biases): a biased linear keeps DTensor's style, so its bias gradient stays in high precision as on one
    # process (parity test, tests/test_fp8_offload.py)
    if is_float8_linear(module) and _tensorwise(module) and module.bias is None:
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        return (Float8ColwiseParallel if style == "colwise" else Float8RowwiseParallel)(**kwargs)
    return (ColwiseParallel if style == "colwise" else RowwiseParallel)(**kwargs)


def _tensorwise(module: nn.Module) -> bool:
    from torchao.float8.config import ScalingGranularity

    config = module.config
    return all(c.scaling_granularity is ScalingGranularity.TENSORWISE
               for c in (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output))


def precompute_fsdp_scales(modules: Iterable[nn.Module]) -> None:
    """After an optimizer step under float8 all-gather: every weight's scale from one all-reduce of amaxes."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for module in modules:
        precompute_float8_dynamic_scale_for_fsdp(module)
