"""Training precision policies: the one place that says how many bytes each state takes per element.

A policy (`ParallelConfig.precision`) fixes the dtype of every tensor of a training step. autopar's
policies follow the recipe of torchtitan and Megatron-LM (Micikevicius et al. 2018, "Mixed Precision
Training", §3: fp32 master weights, 16-bit arithmetic, loss scaling for fp16):

  policy  compute (matmuls, activations)  parameters = masters  gradients (and their reduction)  Adam moments
  fp32    fp32                            fp32                  fp32                             2 × fp32
  bf16    bf16                            fp32                  fp32                             2 × fp32
  fp16    fp16 (dynamic loss scaling)     fp32                  fp32                             2 × fp32

The parameters the optimizer steps are the fp32 masters themselves; 16-bit copies exist only for compute:
under ZeRO-2/3 as FSDP2's gathered parameters (`MixedPrecisionPolicy(param_dtype=bf16)`: the all-gather
moves 16-bit bytes, ZeRO-2 keeps the gathered copy from forward to backward), under ZeRO-0, tensor and
pipeline parallelism as autocast's casts, cast once per step and held to its last backward. ZeRO-1 over
dp > 1 ranks is the distributed optimizer (Megatron-LM's; autopar.codegen.dist_optimizer): the model's
parameters are 16-bit (they are the compute copy), each has an fp32 main gradient, and the fp32 masters
with their moments exist only on the rank that steps them, which broadcasts the updated 16-bit weights:
2 + 4 + 12/dp bytes per parameter (`weight_bytes` then counts the masters, `compute_bytes` the
parameters). Gradients are reduced in fp32 (`REDUCE_DTYPE` below says why).

Everything that charges or allocates model state asks this module: the planner's memory and
communication pricing (`state_bytes`, `compute_copy_bytes`, `reduce_bytes`, `compute_dtype`) and the
runtime (`compute_dtype`, `param_dtype`, `reduce_dtype`, `loss_scaling`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRECISIONS", "Precision", "policy", "default_precision", "DTYPE_BYTES", "REDUCE_DTYPE"]

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# Gradients are reduced in fp32 under every policy, as torchtitan sets FSDP2's
# MixedPrecisionPolicy(reduce_dtype=float32) and Megatron-LM accumulates and all-reduces main_grad in fp32
# (--accumulate-allreduce-grads-in-fp32): a bf16 sum of N ranks' gradients keeps 8 mantissa bits, so the
# mean of 64 ranks loses ~6 bits of each gradient, while the fp32 reduction moves twice the bytes. The
# gradients already live in fp32 (the fp32 masters' gradients, or the distributed optimizer's main gradients,
# which accumulate the 16-bit ones), so no cast is needed either.
REDUCE_DTYPE = "float32"
# Per-element bytes of AdamW's state: exp_avg and exp_avg_sq in the parameters' dtype (fp32 masters),
# torch/optim/adamw.py; the scalar `step` is not counted.
ADAM_STATE_BYTES = 8


@dataclass(frozen=True, kw_only=True)
class Precision:
    """The dtypes of one policy (torch dtype names) and the bytes per element of each state."""

    name: str
    compute_dtype: str  # matmuls and activations (autocast / FSDP2 param_dtype)
    param_dtype: str  # the parameters the optimizer steps: the masters (ZeRO-1's owned ones only)
    reduce_dtype: str  # gradients and their data-parallel reduction
    loss_scaling: bool  # dynamic loss scaling (fp16 only: its 5-bit exponent underflows small gradients)

    @property
    def mixed(self) -> bool:
        """Whether compute runs in 16 bits over fp32 masters (16-bit compute copies exist)."""
        return self.compute_dtype != self.param_dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes per parameter of the resident parameter (the fp32 master the optimizer steps)."""
        return DTYPE_BYTES[self.param_dtype]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of compute tensors: activations, 16-bit weight copies, pipeline sends."""
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per parameter of AdamW's moments (over the fp32 masters)."""
        return ADAM_STATE_BYTES

    @property
    def compute_copy_bytes(self) -> int:
        """Bytes per parameter of a 16-bit compute copy of the weights (0 when compute runs on the masters)."""
        return DTYPE_BYTES[self.compute_dtype] if self.mixed else 0

    def reduce_bytes(self, num_params: float) -> float:
        """Bytes of one gradient reduction of `num_params` gradients."""
        return num_params * self.grad_bytes

    def gather_bytes(self, num_params: float) -> float:
        """Bytes of one FSDP2 all-gather of `num_params` parameters (they travel in the compute dtype)."""
        return num_params * DTYPE_BYTES[self.compute_dtype]


_POLICIES = {
    "fp32": Precision(name="fp32", compute_dtype="float32", param_dtype="float32", reduce_dtype=REDUCE_DTYPE,
                      loss_scaling=False),
    "bf16": Precision(name="bf16", compute_dtype="bfloat16", param_dtype="float32", reduce_dtype=REDUCE_DTYPE,
                      loss_scaling=False),
    "fp16": Precision(name="fp16", compute_dtype="float16", param_dtype="float32", reduce_dtype=REDUCE_DTYPE,
                      loss_scaling=True),
}


def policy(name: str) -> Precision:
    """The policy called `name` (one of PRECISIONS)."""
    if name not in _POLICIES:
        raise ValueError(f"precision {name!r} is not one of {', '.join(PRECISIONS)}")
    return _POLICIES[name]


def default_precision(device_kind: str, peak_flops: dict[str, float]) -> str:
    """What a practitioner trains in on this device: bf16 where the catalog lists bf16 tensor throughput
    (A100 and later), fp16 where only fp16 (V100: loss-scaled fp16, as Megatron-LM trained there), fp32 on
    a CPU (a bf16 GEMM runs ~100× slower than fp32 on CPUs without AVX-512-BF16 or AMX)."""
    if device_kind == "cpu":
        return "fp32"
    if "bfloat16" in peak_flops:
        return "bf16"
    if "float16" in peak_flops:
        return "fp16"
    return "fp32"
