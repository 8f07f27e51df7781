"""Pipeline stages cut where the plan says, and the `torch.distributed.pipelining` schedule that runs them.

A stage is the ordered list of layer names of one `StagePlan`. `StageModule` holds exactly those
layers under their original module paths (so parameter names, state dicts and checkpoints match
the single-device model) and runs them one after another: the output of a layer is the input of
the next, which is how capture defines layers for decoder-only models.

Hugging Face decoders are the one structure handled explicitly: their decoder layers take the
rotary position embeddings (computed once by `model.rotary_emb`, a parameter-free module that
every stage keeps) and run causal attention without an explicit mask.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from autopar.capture.graph import ModelGraph
from autopar.errors import PlanMismatchError
from autopar.plan import Plan, StagePlan

__all__ = ["StageModule", "layer_modules", "build_stage_module", "build_schedule"]


class _Dropped(nn.Module):
    """Placeholder for a layer that lives on another pipeline stage; calling it is a bug."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer belongs to another pipeline stage")


def layer_modules(graph: ModelGraph, name: str) -> tuple[str, ...]:
    """Module paths making up layer `name`: the layer's own path when it is a module, else its modules."""
    layer = graph.layer(name)
    return layer.modules or (layer.name,)


def _prune(module: nn.Module, prefix: str, drop: set[str]) -> nn.Module:
    """A shallow copy of `module` whose descendants in `drop` are placeholders; kept leaves are shared."""
    if prefix in drop:
        return _Dropped()
    if not any(d == prefix or d.startswith(prefix + ".") or not prefix for d in drop):
        return module
    clone = copy.copy(module)
    clone.__dict__ = dict(module.__dict__)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {name: _prune(child, f"{prefix}.{name}" if prefix else name, drop)
                      for name, child in module._modules.items()}
    return clone


def _hf_rotary(root: nn.Module) -> tuple[str, nn.Module] | None:
    inner = getattr(root, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if isinstance(rotary, nn.Module) and isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return "model.rotary_emb", rotary
    return None


class StageModule(nn.Module):
    """The layers of one stage, under their original paths, run in plan order.

    `sequence_shards`: the tensor-parallel degree when sequence parallelism splits the hidden
    states along the sequence (position embeddings are then made for the full length).
    """

    def __init__(self, model: nn.Module, graph: ModelGraph, layers: Sequence[str], *,
                 sequence_shards: int = 1) -> None:
        super().__init__()
        keep = {m for name in layers for m in layer_modules(graph, name)}
        drop = {m for la in graph.layers for m in layer_modules(graph, la.name)} - keep
        rotary = _hf_rotary(model)
        if rotary:
            drop.discard(rotary[0])
        pruned = _prune(model, "", drop)
        for name, child in pruned.named_children():
            self.add_module(name, child)
        for name, p in pruned.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.layer_names = tuple(la for la in layers if not rotary or la != rotary[0])
        self._rotary_path = rotary[0] if rotary else None
        self._calls = tuple(tuple(p for p in layer_modules(graph, la) if p != self._rotary_path)
                            for la in self.layer_names)
        self._hf_layers_prefix = "model.layers." if rotary else None
        self.sequence_shards = sequence_shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        position = None
        for paths in self._calls:
            for path in paths:
                module = self.get_submodule(path)
                if self._hf_layers_prefix and path.startswith(self._hf_layers_prefix):
                    if position is None:
                        position = self._position_embeddings(x)
                    x = module(x, position_embeddings=position[0], position_ids=position[1])
                else:
                    x = module(x)
        return x

    def _position_embeddings(self, hidden: torch.Tensor):
        seq_len = hidden.size(1) * self.sequence_shards
        position_ids = torch.arange(seq_len, device=hidden.device).unsqueeze(0)
        rotary = self.get_submodule(self._rotary_path)
        return rotary(hidden, position_ids=position_ids), position_ids


def build_stage_module(model: nn.Module, graph: ModelGraph, stage: StagePlan, *,
                       sequence_shards: int = 1) -> StageModule:
    missing = [la for la in stage.layers if la not in {x.name for x in graph.layers}]
    if missing:
        raise PlanMismatchError(f"plan stage {stage.index} names layers {missing} that the model graph lacks; "
                                "re-plan for this model")
    return StageModule(model, graph, stage.layers, sequence_shards=sequence_shards)


def check_stage_placement(plan: Plan) -> None:
    """Schedules place stage i on pipeline rank i mod pp (looping placement for interleaving)."""
    pp = plan.config.pp
    for stage in plan.stages:
        if stage.pp_rank != stage.index % pp:
            raise PlanMismatchError(
                f"plan stage {stage.index} is on pp rank {stage.pp_rank}; the pipelining schedules need "
                f"stage i on rank i mod pp = {stage.index % pp}; re-plan with this autopar version"
            )


def build_schedule(plan: Plan, stage_modules: Sequence[tuple[int, nn.Module]], pp_mesh: DeviceMesh,
                   device: torch.device, loss_fn):
    """The planned schedule over this rank's stages `[(stage_index, module), ...]`.

    scale_grads=True divides gradients by the number of micro-batches, so a mean loss per micro-batch
    gives the gradient of the mean over the whole batch.
    """
    cfg = plan.config
    group = pp_mesh.get_group()
    stages = [PipelineStage(mod, index, len(plan.stages), device, group=group) for index, mod in stage_modules]
    if cfg.schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=cfg.num_microbatches, loss_fn=loss_fn,
                                       scale_grads=True)
    cls = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=cfg.num_microbatches, loss_fn=loss_fn, scale_grads=True)
