"""FP8 pricing: torchao float8 training as autopar.codegen.float8 runs it, per layer and micro-batch.

Which GEMMs: the weight GEMMs (Kernel.kind "gemm", no batched shape) of every layer but the LM head — the
filter codegen applies (`float8_linear_names`: every linear outside the head; its multiple-of-16 widths
hold for the zoo's and the published models' linears, which the graph does not list one by one). Their
forward GEMM and both backward GEMMs (grad-input, grad-weight) run at the device's FP8 tensor-core peak
(catalog `peak_TFLOPs.fp8`, at the bf16 GEMM efficiency of the same device); attention's matmuls stay
16-bit. A GPU without FP8 tensor cores is refused (`check_fp8_device`); a CPU runs torchao's emulation: the
GEMM in the compute dtype, plus the casts.

The casts (torchao float8_scaling_utils / float8_linear): each operand of an FP8 GEMM is scaled and cast
to 1 byte, its scale taken from an amax reduction over it. Per linear with weight K×N (P = K·N elements,
from the GEMM's FLOPs: 2·tokens·P) and a micro-batch of T tokens, one side of every transformer linear
is the model width h, so the activations it reads and writes hold T·(h + P/h) elements (the h side is
never the TP-sharded one: column-parallel shards N, row-parallel K):
  tensorwise   casts of the input (T·K), the weight (P) and the output gradient (T·N), one amax each, and
               the three FP8 transposes the other two GEMMs read (1 byte read + written per element); with
               FSDP's float8 all-gather the weight is cast on its shard before the gather (P/dp, and no
               per-micro-batch weight cast), its amax from one all-reduce per step for all weights
  rowwise      every operand cast twice (row scales for one GEMM, column scales for the other): input,
               weight and output gradient each twice, with their amaxes; the all-gather stays 16-bit.
               The two backward GEMMs run without fast accumulation (Float8LinearConfig's grad_input and
               grad_weight Float8GemmConfig default, torchao/float8/config.py), and for row/column scales
               without it torchao calls cuBLAS's tensorwise kernel with unit scales and multiplies the
               output by the outer product of the scales afterwards (torchao/float8/float8_ops.py,
               addmm_float8_unwrapped, since pytorch/ao PR #1325: "the rowwise CUTLASS-based kernel is so
               slow without fast-accum"); under torch.compile that is at least one extra kernel per GEMM
               (pytorch/ao issue #2184): a read and a write of grad_input (T·K) and grad_weight (P)
A cast of n elements of e bytes reads n·e for its amax and n·e again for the cast and writes n bytes; a
compiled block fuses the amax into the cast and the transposes into it (torchtitan: "torch.compile
required for competitive performance ... to fuse the float8 scaling/casting kernels"): n·e read, n (and
n more for a transposed copy) written. Under tensor parallelism a tensorwise amax over a sharded tensor
is one more all-reduce of a scalar per cast (DTensor reduces the partial amax).
Memory: the FP8 copies of the largest layer's weights and their transposes live during its passes
(1 byte each), and FSDP's gathered buffers hold the converted weights in 1 byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.capture.graph import Kernel, LayerSpec, ModelGraph
from autopar.errors import InfeasiblePlanError
from cost_models.hardware import DeviceSpec

__all__ = ["FP8_DTYPE", "RESCALE_PASSES", "CastWork", "is_fp8_layer", "fp8_gemm", "cast_work", "check_fp8_device",
           "fp8_param_share", "fp8_recipes", "fp8_copy_bytes"]

FP8_DTYPE = "fp8"  # the catalog's peak_TFLOPs key for FP8 tensor-core throughput
# A rowwise backward GEMM's output is rescaled after cuBLAS (module docstring): read once, written once
RESCALE_PASSES = 2


def fp8_recipes(device: DeviceSpec) -> tuple[str, ...]:
    """The FP8 recipes a device can run: both on FP8 tensor cores and on a CPU (emulated), none elsewhere."""
    return ("tensorwise", "rowwise") if FP8_DTYPE in device.peak_flops or device.kind == "cpu" else ()


def check_fp8_device(device: DeviceSpec, recipe: str) -> None:
    if recipe != "none" and not fp8_recipes(device):
        raise InfeasiblePlanError(
            f"fp8={recipe!r} needs FP8 tensor cores, which {device.name} lacks (its catalog entry lists "
            f"{', '.join(sorted(device.peak_flops))}; FP8 arrived with Ada and Hopper: L40S, H100, H200, B200); "
            "use --fp8 none, or a cluster of such devices")


def is_fp8_layer(layer: LayerSpec) -> bool:
    """Whether codegen converts this layer's linears: every layer but the LM head."""
    return layer.kind != "head"


def fp8_gemm(k: Kernel) -> bool:
    """A GEMM against a weight of an `nn.Linear`: not an attention matmul, nor a mixture-of-experts bank's
    grouped GEMM (its stacked expert weights are no linears, so torchao's conversion leaves them 16-bit)."""
    return k.kind == "gemm" and k.mnk is None and not k.expert


@dataclass(frozen=True, kw_only=True)
class CastWork:
    """Memory-bound cast/scale work of one layer's converted linears for one micro-batch on one device."""

    forward_bytes: float
    backward_bytes: float
    forward_kernels: int
    backward_kernels: int
    amax_allreduces: int  # scalar all-reduces over the TP group (tensorwise casts of sharded tensors)


def _linears(layer: LayerSpec, graph: ModelGraph) -> list[tuple[Kernel, float]]:
    """(kernel, weight elements P of one such linear) of the layer's weight GEMMs, forward pass."""
    tokens = graph.seq_len or 1
    return [(k, k.work / (2.0 * tokens)) for k in layer.kernels_forward.kernels if fp8_gemm(k)]


def fp8_param_share(layer: LayerSpec, graph: ModelGraph) -> float:
    """Share of the layer's parameters in converted linears (what FSDP gathers in 1 byte under tensorwise)."""
    if not is_fp8_layer(layer) or layer.num_params == 0:
        return 0.0
    return min(1.0, sum(k.count * p for k, p in _linears(layer, graph)) / layer.num_params)


def cast_work(layer: LayerSpec, graph: ModelGraph, *, recipe: str, elem_bytes: float, micro_batch: int, tp: int,
              compiled: bool, weights_gathered_fp8: bool, dp: int) -> CastWork:
    """The casts, amaxes and transposes torchao runs for this layer's converted linears (module docstring)."""
    if recipe == "none" or not is_fp8_layer(layer):
        return CastWork(forward_bytes=0.0, backward_bytes=0.0, forward_kernels=0, backward_kernels=0,
                        amax_allreduces=0)
    h = float(graph.hidden_size or 0)
    tokens = micro_batch * (graph.seq_len or 1)
    cast = elem_bytes + 1.0 if compiled else 2.0 * elem_bytes + 1.0  # bytes moved per element cast (+ amax)
    fwd = bwd = 0.0
    fwd_k = bwd_k = amax = 0
    for k, p in _linears(layer, graph):
        shard = tp if k.tp_sharded else 1
        weight = p / shard
        other = p / h if h else p ** 0.5  # the non-h side of the linear (K or N); √P without a model width
        # input and output activations: the h side whole, the other side ÷ tp when the linear is sharded
        act_in_out = tokens * (h + other / shard) if h else tokens * 2.0 * other / shard
        act_in = act_out = act_in_out / 2.0
        n = k.count
        if recipe == "tensorwise":
            w_cast = weight / dp if weights_gathered_fp8 else weight  # cast on the shard before the gather
            fwd += n * cast * (act_in + w_cast)
            transpose = 1.0 if compiled else 2.0  # written beside the cast, or a copy of its own
            bwd += n * (cast * act_out + transpose * (act_in + act_out + weight))
            fwd_k += n * (2 if compiled else 4)
            bwd_k += n * (1 if compiled else 2) + (0 if compiled else 3 * n)
            amax += 3 * n if shard > 1 else 0
        else:  # rowwise: each operand cast along both axes
            fwd += n * cast * (act_in + weight)
            bwd += n * cast * (act_out * 2 + act_in + weight)
            bwd += n * RESCALE_PASSES * elem_bytes * (act_in + weight)  # the backward outputs' rescale
            fwd_k += n * (2 if compiled else 4)
            bwd_k += n * (4 if compiled else 8) + 2 * n
    return CastWork(forward_bytes=fwd, backward_bytes=bwd, forward_kernels=fwd_k, backward_kernels=bwd_k,
                    amax_allreduces=amax)


def fp8_copy_bytes(layer: LayerSpec, graph: ModelGraph, tp: int) -> float:
    """FP8 copies (and transposes) of one layer's converted weights alive during its passes, bytes per device."""
    if not is_fp8_layer(layer):
        return 0.0
    return 2.0 * sum(k.count * p / (tp if k.tp_sharded else 1) for k, p in _linears(layer, graph))
