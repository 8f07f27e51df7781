"""The pipeline runtime a layout with pp > 1 runs on: how it moves stage-boundary tensors and what it holds.

One name per runtime, two consequences priced apart: `p2p`, the issue pattern of the boundary transfers
(cost_models.comm.PIPELINE_P2P), and `memory`, what the runtime keeps beyond the layers' activations and
the ZeRO stage's states (cost_models.memory.PIPELINE_MEMORY). autopar runs "torch"; the others price runs
made with another framework (the published runs of benchmarks/data/published_runs.toml).

  torch      torch.distributed.pipelining, autopar's runtime and torchtitan's: sends and receives batched
             (batch_isend_irecv), a receive buffer per micro-batch, FSDP's backward unsynchronised until
             the step's last micro-batch
  megatron   Megatron-LM / Megatron-Core (and Meta's Llama 3 trainer, which frees stage inputs and outputs
             as soon as used, Dubey et al. 2024 §3.3.2): batched sends, each TP rank sending its 1/t slice
             (Narayanan et al. SC'21 §4.1, on by default), outputs freed once sent
  deepspeed  DeepSpeed's PipelineEngine (Megatron-DeepSpeed, MT-NLG): blocking send/recv of partitioned
             tensors (deepspeed/runtime/pipe/p2p.py, engine.py), buffers for in-flight micro-batches only
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.comm import PIPELINE_P2P
from cost_models.memory import PIPELINE_MEMORY

__all__ = ["PipelineRuntime", "PIPELINE_RUNTIMES", "runtime"]


@dataclass(frozen=True)
class PipelineRuntime:
    p2p: str  # cost_models.comm.PIPELINE_P2P
    memory: str  # cost_models.memory.PIPELINE_MEMORY

    def __post_init__(self) -> None:
        if self.p2p not in PIPELINE_P2P or self.memory not in PIPELINE_MEMORY:
            raise ValueError(f"PipelineRuntime({self.p2p!r}, {self.memory!r}): p2p one of {tuple(PIPELINE_P2P)}, "
                             f"memory one of {PIPELINE_MEMORY}")


PIPELINE_RUNTIMES = {
    "torch": PipelineRuntime(p2p="batched", memory="torch"),
    "megatron": PipelineRuntime(p2p="scatter_gather", memory="megatron"),
    "deepspeed": PipelineRuntime(p2p="blocking_scatter_gather", memory="megatron"),
}


def runtime(name: str) -> PipelineRuntime:
    """The runtime called `name`; ValueError naming the known ones otherwise."""
    if name not in PIPELINE_RUNTIMES:
        raise ValueError(f"pipeline_runtime={name!r}; expected one of {tuple(PIPELINE_RUNTIMES)}")
    return PIPELINE_RUNTIMES[name]
