"""The pipeline runtime a layout with pp > 1 runs on: how it moves stage-boundary tensors, what it holds, how
it sums the micro-batches' weight gradients, and how the framework around it launches expert GEMMs.

One name per runtime, four consequences priced apart: `p2p`, the issue pattern of the boundary transfers
(cost_models.comm.PIPELINE_P2P), `memory`, what the runtime keeps beyond the layers' activations and the
ZeRO stage's states (cost_models.memory.PIPELINE_MEMORY), `accumulation`, the memory traffic of adding
each micro-batch's weight gradients into the step's (GRAD_ACCUMULATION), and `expert_gemm`, how many launches
a mixture-of-experts bank's GEMMs take (EXPERT_GEMMS). autopar runs "autopar"; the others
price runs made with another framework (the published runs of benchmarks/data/published_runs.toml).

  autopar    torch.distributed.pipelining's schedules over autopar's stages (codegen/inflight_stage.py): sends
             and receives batched (batch_isend_irecv), receive buffers for micro-batches in flight only, outputs
             freed once sent, FSDP's backward unsynchronised until the step's last micro-batch
  torch      the same schedules over torch's own PipelineStage, as torchtitan runs them: a receive buffer for
             every micro-batch and every in-flight output kept until its backward
  megatron   Megatron-LM / Megatron-Core (and Meta's Llama 3 trainer, which frees stage inputs and outputs
             as soon as used, Dubey et al. 2024 §3.3.2): batched sends, each TP rank sending its 1/t slice
             (Narayanan et al. SC'21 §4.1, on by default), outputs freed once sent
  deepspeed  DeepSpeed's PipelineEngine (Megatron-DeepSpeed, MT-NLG): blocking send/recv of partitioned
             tensors (deepspeed/runtime/pipe/p2p.py, engine.py), buffers for in-flight micro-batches only;
             the module runs in 16 bits (engine.py, `self.module.half()` under fp16) and each backward is
             torch.autograd.backward into its 16-bit param.grad, which autograd's AccumulateGrad sums in place

How a runtime sums gradients over the m micro-batches of a step (GRAD_ACCUMULATION):
  autograd_16bit  the weight-gradient GEMM writes a fresh gradient and AccumulateGrad adds it to param.grad
                  (torch/csrc/autograd/functions/accumulate_grad.h: `variable_grad += new_grad` once a
                  gradient is held; the first micro-batch's is kept as is): from the second micro-batch on,
                  one elementwise kernel per parameter tensor reading both 16-bit gradients and writing one,
                  3 × 2 bytes per parameter, on the compute stream in the backward
  fused           the weight-gradient GEMM accumulates into the gradient buffer itself (Megatron-LM's
                  gradient_accumulation_fusion, on by default, `--no-gradient-accumulation-fusion` to disable:
                  the wgrad GEMM of fused_weight_gradient_mlp_cuda adds into main_grad): no pass of its own
  not_priced      autopar's own runtime (torch.distributed.pipelining's backward into param.grad, FSDP2's
                  unsharded accumulation) sums through autograd as well; not priced yet

How a runtime runs a mixture-of-experts bank's E / ep local experts (EXPERT_GEMMS), per GEMM of the expert FFN:
  grouped     one kernel launch over every local expert's GEMM (torch._grouped_mm, autopar's runtime:
              autopar/capture/moe.py)
  per_expert  one GEMM launch per local expert, each paying its own launch floor
              (cost_models.compute.ComputeModel.kernel_time_s `launch_per_group`). Megatron-Core's TEGroupedMLP
              (--moe-grouped-gemm with Transformer Engine; megatron/core/models/gpt/moe_module_specs.py) runs
              TE's GroupedLinear, whose bf16 path is nvte_multi_stream_cublas_gemm: a loop issuing one cuBLAS
              GEMM per expert, round-robin over 4 streams (TransformerEngine PR #853, "Grouped GEMM via
              multi-stream cuBLAS"; transformer_engine/common/gemm/cublaslt_gemm.cu); DeepSpeed-MoE's Experts
              module calls each local expert's FFN in a Python loop (deepspeed/moe/experts.py, Experts.forward)
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.comm import PIPELINE_P2P
from cost_models.memory import PIPELINE_MEMORY

__all__ = ["PipelineRuntime", "PIPELINE_RUNTIMES", "GRAD_ACCUMULATION", "ACCUMULATE_PASSES", "EXPERT_GEMMS", "runtime"]

GRAD_ACCUMULATION = ("autograd_16bit", "fused", "not_priced")
EXPERT_GEMMS = ("grouped", "per_expert")
ACCUMULATE_PASSES = 3  # gradient elements moved per parameter by `grad += new`: two read, one written


@dataclass(frozen=True)
class PipelineRuntime:
    p2p: str  # cost_models.comm.PIPELINE_P2P
    memory: str  # cost_models.memory.PIPELINE_MEMORY
    accumulation: str  # GRAD_ACCUMULATION
    expert_gemm: str = "grouped"  # EXPERT_GEMMS

    def __post_init__(self) -> None:
        if (self.p2p not in PIPELINE_P2P or self.memory not in PIPELINE_MEMORY
                or self.accumulation not in GRAD_ACCUMULATION or self.expert_gemm not in EXPERT_GEMMS):
            raise ValueError(f"PipelineRuntime({self.p2p!r}, {self.memory!r}, {self.accumulation!r}, "
                             f"{self.expert_gemm!r}): p2p one of {tuple(PIPELINE_P2P)}, memory one of "
                             f"{PIPELINE_MEMORY}, accumulation one of {GRAD_ACCUMULATION}, expert_gemm one of "
                             f"{EXPERT_GEMMS}")


PIPELINE_RUNTIMES = {
    "autopar": PipelineRuntime(p2p="batched", memory="autopar", accumulation="not_priced"),
    "torch": PipelineRuntime(p2p="batched", memory="torch", accumulation="not_priced"),
    "megatron": PipelineRuntime(p2p="scatter_gather", memory="megatron", accumulation="fused",
                                expert_gemm="per_expert"),
    "deepspeed": PipelineRuntime(p2p="blocking_scatter_gather", memory="megatron", accumulation="autograd_16bit",
                                 expert_gemm="per_expert"),
}


def runtime(name: str) -> PipelineRuntime:
    """The runtime called `name`; ValueError naming the known ones otherwise."""
    if name not in PIPELINE_RUNTIMES:
        raise ValueError(f"pipeline_runtime={name!r}; expected one of {tuple(PIPELINE_RUNTIMES)}")
    return PIPELINE_RUNTIMES[name]
