"""The autopar side of `autopar profile MODEL`: turn a model's captured layers into timed callables.

cost_models measures; this module knows models. For each distinct layer signature of the captured
graph it materialises one copy of that layer's modules on the local device with random weights, gives
them inputs of the shapes they receive in the real forward pass (recorded on the meta device), and
hands `LayerCase`s to `cost_models.profiler.profile_machine`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autopar.capture.graph import ModelGraph
from autopar.errors import AutoparError, ProfileMismatchError
from cost_models.profile import Profile, ProfileMismatch
from cost_models.profiler import LayerCase, local_device_name, machine_info, profile_machine

__all__ = ["LAYER_MICRO_BATCHES", "layer_cases", "profile_model", "load_local_profile"]


def _record_inputs(model: nn.Module, example_inputs: tuple, names: Sequence[str]) -> dict[str, tuple]:
    """(args, kwargs) each named module receives in one forward pass of `model` (meta is fine)."""
    seen: dict[str, tuple] = {}
    handles = []
    for name in names:
        def hook(_mod: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            seen.setdefault(name, (args, kwargs))
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in seen]
    if missing:
        raise AutoparError(f"modules {missing} did not run in the forward pass; cannot time their layers")
    return seen


def _materialize(value: Any, device: torch.device) -> Any:
    """A real tensor like `value`: random floats that require grad, zeros for integer ids (valid indices)."""
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, dtype=t.dtype, device=device).requires_grad_(True)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    return tree_map(one, value)


def _real_module(module: nn.Module, device: torch.device) -> nn.Module:
    mod = copy.deepcopy(module).to_empty(device=device)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.02)
    return mod.train()


# Micro-batches (in units of the example batch) at which each distinct layer is timed. A layer's time is
# not proportional to its samples on a CPU (framework time per call, and kernels whose cost the
# kernel tables do not see: SDPA with dropout runs the unfused math path), so a plan's micro-batch is
# priced from the largest one measured at or below it (autopar.planner.compute_costs: _measured_floor_s).
LAYER_MICRO_BATCHES = (1, 2, 4, 8)


def _with_batch(example_inputs: tuple, factor: int) -> tuple:
    """The example inputs with `factor` times as many samples (dim 0 repeated)."""
    return tuple(torch.cat([t] * factor) if isinstance(t, torch.Tensor) and t.dim() >= 1 else t
                 for t in example_inputs)


def layer_cases(model: nn.Module, example_inputs: tuple, graph: ModelGraph, device: torch.device,
                micro_batches: Sequence[int] = (1,)) -> list[LayerCase]:
    """One LayerCase per distinct signature (the first layer carrying it) and micro-batch (multiples of
    the example batch), smallest micro-batches first, so a time budget drops the largest."""
    firsts = {}
    for layer in graph.layers:
        firsts.setdefault(layer.signature, layer)
    names = [m for layer in firsts.values() for m in layer.modules]
    modules = {name: _real_module(model.get_submodule(name), device) for name in names}
    cases = []
    for factor in micro_batches:
        inputs = _record_inputs(model, _with_batch(example_inputs, factor), names)
        for sig, layer in firsts.items():
            runs: list[Callable[[], Any]] = []
            for name in layer.modules:
                args, kwargs = _materialize(inputs[name], device)
                runs.append(lambda mod=modules[name], args=args, kwargs=kwargs: mod(*args, **kwargs))
            cases.append(LayerCase(signature=sig, micro_batch=graph.example_batch_size * factor, label=layer.name,
                                   forward=lambda runs=runs: [run() for run in runs]))
    return cases


def profile_model(model_spec: str | None, *, nproc: int | None = None, quick: bool = False,
                  seq_len: int | None = None, progress: Callable[[str], None] | None = None,
                  collectives: bool = True, dtype: str | None = None, clock: str = "wall",
                  budget_s: float | None = None,
                  overrides: dict | None = None) -> Profile:
    """Measure this machine and, when `model_spec` is given, each distinct layer of that model, in `dtype`
    (default autopar.models.training_dtype() here: the kernel tables of other dtypes are left out), within
    budget_s seconds (default: cost_models.profiler's for quick or full). clock "thread" times kernels with
    one thread's CPU time, so torch runs one thread while measuring, as each CPU training process does."""
    from autopar.models import training_dtype

    if budget_s is not None and not budget_s > 0:
        raise AutoparError(f"--budget {budget_s}: give the seconds the profile may take, e.g. --budget 300")
    cases: list[LayerCase] = []
    name = None
    shapes: list[tuple[int, ...]] = []
    threads = torch.get_num_threads()
    torch_dtype = training_dtype("local", dtype)
    if clock == "thread":
        torch.set_num_threads(1)
    if model_spec:
        from autopar.capture import capture
        from autopar.models import resolve_model

        model, example_inputs, example_kwargs = resolve_model(model_spec, seq_len=seq_len, dtype=torch_dtype,
                                                              overrides=overrides)
        if example_kwargs:
            raise AutoparError(f"autopar profile times a model's layers from positional example inputs; "
                               f"{model_spec} takes keyword inputs ({', '.join(example_kwargs)}): profile "
                               "without a model (the GEMM and elementwise mix), or return them positionally")
        graph = capture(model, example_inputs)
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        cases = layer_cases(model, example_inputs, graph, device, LAYER_MICRO_BATCHES)
        name = graph.model_name
        shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    try:
        return profile_machine(nproc=nproc, quick=quick, layers=cases, progress=progress, model_name=name,
                               collectives=collectives, clock=clock, budget_s=budget_s,
                               dtypes=[str(torch_dtype).removeprefix("torch.")], param_shapes=shapes)
    finally:
        torch.set_num_threads(threads)


def load_local_profile(path: str | Path) -> Profile:
    """Load a profile and check that it describes this machine, this device and this torch."""
    import socket

    from cost_models.profiler.cpu import cpu_kind

    try:
        prof = Profile.load(path)
        here = machine_info()
        prof.check_matches(device_name=local_device_name(), torch_version=torch.__version__,
                           hostname=socket.gethostname(), processor=here.processor, cpu_count=here.cpu_count,
                           cpu_model=cpu_kind().model_name)
    except ProfileMismatch as e:
        raise ProfileMismatchError(str(e)) from e
    return prof
