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

Transformer Engine (PlannerOptions.fp8_runtime = "transformer_engine": Megatron-LM and NeMo runs) is priced
as TE's modules run it (`te_cast_work`). Its recipes: "delayed" (DelayedScaling: per-tensor scales from an
amax history, so a cast needs no pass over its tensor first and fuses into the kernel that produces the
tensor), "tensorwise" (Float8CurrentScaling: per-tensor scales from the tensor's own amax, an amax pass
before every cast) and "mxfp8" (MXFP8BlockScaling: one E8M0 scale per 32 elements, computed inside the
cast; only on devices whose catalog lists an `mxfp8` tensor-core rate: Blackwell). Which casts remain
kernels of their own (TE's LayerNormLinear / LayerNormMLP / Linear, transformer_engine/pytorch/module):
  fused         the input of the attention's column linears (LayerNorm + cast, `layernorm_fwd` writing FP8),
                of the MLP's column linears (the same) and of its row linear (the activation + cast,
                `gelu`/`swiglu` writing FP8), and the gradient of the MLP's column outputs (the activation's
                backward + cast + transpose, `dswiglu_cast_transpose`): no traffic beyond the 16-bit kernel's
  standalone    the attention output before its row linear, the gradient of the attention's column outputs
                (from attention's backward) and of every row linear's output (the residual stream):
                one cast-transpose kernel each (`fp8_cast_transpose_fused`), reading 16 bits per element
                and writing the FP8 copy and its transpose (1 byte each; MXFP8 adds a scale per 32 elements
                for each copy); under current scaling an amax kernel reads the tensor once more first, and
                every operand is such a standalone cast (a producer cannot know the scale before it is done)
  weights       cast and transposed once per optimizer step, on the first micro-batch (`is_first_microbatch`)
                and kept across the others (TE's FP8 weight workspaces): 16 bits read, 2 bytes written per
                converted parameter per step, and the copies held for the whole step (`te_weight_cache_bytes`)
A layer without a tensor-parallel pattern to tell its linears' producers prices every linear's input and
output gradient as a standalone cast. The GEMMs converted are torchao's: every linear outside the LM head
(Megatron-Core's output layer is no TE module), attention's matmuls and expert banks in 16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.capture.graph import Kernel, LayerSpec, ModelGraph
from autopar.config import FP8_RUNTIME_RECIPES as RUNTIME_RECIPES
from autopar.config import FP8_RUNTIMES
from autopar.errors import InfeasiblePlanError
from cost_models.hardware import DeviceSpec

__all__ = ["FP8_DTYPE", "MXFP8_DTYPE", "FP8_RUNTIMES", "RUNTIME_RECIPES", "MX_BLOCK", "RESCALE_PASSES",
           "te_cast_work", "te_weight_cast_bytes", "te_weight_cache_bytes", "gemm_dtype",
           "CastWork", "is_fp8_layer", "fp8_gemm", "cast_work", "check_fp8_device",
           "fp8_param_share", "fp8_recipes", "fp8_copy_bytes"]

FP8_DTYPE = "fp8"  # the catalog's peak_TFLOPs key for FP8 tensor-core throughput
MXFP8_DTYPE = "mxfp8"  # the catalog's key for block-scaled (OCP MX) FP8 tensor-core throughput: Blackwell
# MXFP8's block: one 8-bit (E8M0) scale per 32 consecutive elements (OCP Microscaling Formats (MX) v1.0
# specification, 2023, §5: block size 32; TE's MXFP8BlockScaling)
MX_BLOCK = 32
# A rowwise backward GEMM's output is rescaled after cuBLAS (module docstring): read once, written once
RESCALE_PASSES = 2


def fp8_recipes(device: DeviceSpec, runtime: str = "torchao") -> tuple[str, ...]:
    """The FP8 recipes `runtime` runs on a device: torchao's on FP8 tensor cores and on a CPU (emulated);
    Transformer Engine's on FP8 tensor cores only, MXFP8 where the device has block-scaled ones; none elsewhere."""
    if runtime == "torchao":
        return RUNTIME_RECIPES[runtime] if FP8_DTYPE in device.peak_flops or device.kind == "cpu" else ()
    if FP8_DTYPE not in device.peak_flops:
        return ()
    return tuple(r for r in RUNTIME_RECIPES[runtime] if r != "mxfp8" or MXFP8_DTYPE in device.peak_flops)


def check_fp8_device(device: DeviceSpec, recipe: str, runtime: str = "torchao") -> None:
    """Refuse a recipe `runtime` does not have, or one the device cannot run (no FP8, or no MXFP8, tensor cores)."""
    if recipe == "none":
        return
    if recipe not in RUNTIME_RECIPES[runtime]:
        other = next(r for r, recipes in RUNTIME_RECIPES.items() if recipe in recipes)
        raise InfeasiblePlanError(
            f"fp8={recipe!r} is a {other} recipe, and fp8_runtime={runtime!r} runs {RUNTIME_RECIPES[runtime]}; "
            f"pick one of those, or set PlannerOptions(fp8_runtime={other!r})")
    if recipe == "mxfp8" and FP8_DTYPE in device.peak_flops and MXFP8_DTYPE not in device.peak_flops:
        raise InfeasiblePlanError(
            f"fp8='mxfp8' needs block-scaled (MX) FP8 tensor cores, which {device.name} lacks (its catalog entry "
            f"lists {', '.join(sorted(device.peak_flops))}; MXFP8 arrived with Blackwell: B200); use "
            "fp8='delayed' or 'tensorwise' (per-tensor scales) on this device")
    if not fp8_recipes(device, runtime):
        raise InfeasiblePlanError(
            f"fp8={recipe!r} needs FP8 tensor cores, which {device.name} lacks (its catalog entry lists "
            f"{', '.join(sorted(device.peak_flops))}; FP8 arrived with Ada and Hopper: L40S, H100, H200, B200); "
            "use --fp8 none, or a cluster of such devices")


def gemm_dtype(device: DeviceSpec, recipe: str) -> str | None:
    """The catalog rate a converted GEMM runs at under `recipe` (None: the compute dtype's, as emulated)."""
    if recipe == "none":
        return None
    key = MXFP8_DTYPE if recipe == "mxfp8" else FP8_DTYPE
    return key if key in device.peak_flops else None


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


def _te_cast_bytes(recipe: str, elem_bytes: float) -> tuple[float, int]:
    """(bytes moved per element, kernels) of one standalone TE cast-transpose (module docstring)."""
    writes = 2.0 * (1.0 + 1.0 / MX_BLOCK) if recipe == "mxfp8" else 2.0  # the FP8 copy and its transpose
    if recipe == "tensorwise":  # current scaling: an amax pass over the tensor, then the cast
        return 2.0 * elem_bytes + writes, 2
    return elem_bytes + writes, 1


def _converted_params(layer: LayerSpec, graph: ModelGraph, tp: int) -> tuple[float, int]:
    """(converted weight elements of one layer on one device, converted linears)."""
    lin = _linears(layer, graph)
    return sum(k.count * p / (tp if k.tp_sharded else 1) for k, p in lin), sum(k.count for k, _ in lin)


def te_cast_work(layer: LayerSpec, graph: ModelGraph, *, recipe: str, elem_bytes: float, micro_batch: float,
                 tp: int, sp: bool) -> CastWork:
    """The casts Transformer Engine runs for this layer's converted linears per micro-batch on one device
    (module docstring): its standalone cast-transposes, the fused ones costing nothing beyond the 16-bit
    kernel they are fused into; the weights' casts are per step (`te_weight_cast_bytes`)."""
    if recipe == "none" or not is_fp8_layer(layer):
        return CastWork(forward_bytes=0.0, backward_bytes=0.0, forward_kernels=0, backward_kernels=0,
                        amax_allreduces=0)
    per_elem, kernels = _te_cast_bytes(recipe, elem_bytes)
    h = float(graph.hidden_size or 0)
    tokens = micro_batch * (graph.seq_len or 1)
    attn = [p for p in layer.tp_patterns if p.kind == "attention"]
    mlp = [p for p in layer.tp_patterns if p.kind == "mlp"]
    lin = _linears(layer, graph)
    if not h or not (attn or mlp):  # no pattern to tell producers: every input and output gradient standalone
        n = sum(k.count for k, _ in lin)
        acts = sum(k.count * tokens * ((h + p / h / (tp if k.tp_sharded else 1)) if h else 2.0 * p ** 0.5)
                   for k, p in lin) / 2.0
        return CastWork(forward_bytes=acts * per_elem, backward_bytes=acts * per_elem, forward_kernels=n * kernels,
                        backward_kernels=n * kernels, amax_allreduces=0)
    residual = tokens * h / (tp if sp else 1)  # a row linear's output gradient, sequence-sharded under SP
    fwd = bwd = 0.0
    attn_params = 0.0
    for p in attn:
        head_dim = p.head_dim or int(h) // p.num_heads
        out_w, qkv_w = p.num_heads * head_dim, (p.num_heads + 2 * (p.num_kv_heads or p.num_heads)) * head_dim
        attn_params += h * (qkv_w + out_w)
        fwd += tokens * out_w / tp  # the attention output before the row linear
        bwd += tokens * qkv_w / tp + residual  # the q/k/v outputs' gradient; the row output's
    bwd += residual * len(mlp)
    n_fwd, n_bwd = len(attn), 2 * len(attn) + len(mlp)
    if recipe == "tensorwise" and mlp:  # current scaling: the norm- and activation-fed casts stand alone too
        ffn = max(p / h for _, p in lin)  # the MLP's hidden width: its widest linear's non-h side
        mlp_mats = max(0.0, sum(k.count * p for k, p in lin) - attn_params) / (h * ffn * len(mlp))
        col_w = max(0.0, mlp_mats - 1.0) * ffn  # the column linears' outputs (gate and up: 2·ffn)
        fwd += residual * (len(attn) + len(mlp)) + len(mlp) * tokens * ffn / tp
        bwd += len(mlp) * tokens * col_w / tp
        n_fwd, n_bwd = n_fwd + len(attn) + 2 * len(mlp), n_bwd + len(mlp)
    return CastWork(forward_bytes=fwd * per_elem, backward_bytes=bwd * per_elem, forward_kernels=n_fwd * kernels,
                    backward_kernels=n_bwd * kernels, amax_allreduces=0)


def te_weight_cast_bytes(layer: LayerSpec, graph: ModelGraph, *, recipe: str, elem_bytes: float,
                         tp: int) -> tuple[float, int]:
    """(bytes, kernels) of one layer's converted weights cast and transposed once per optimizer step by TE."""
    if recipe == "none" or not is_fp8_layer(layer):
        return 0.0, 0
    params, n = _converted_params(layer, graph, tp)
    per_elem, kernels = _te_cast_bytes(recipe, elem_bytes)
    return params * per_elem, n * kernels


def te_weight_cache_bytes(layer: LayerSpec, graph: ModelGraph, *, recipe: str, tp: int) -> float:
    """Bytes of one layer's FP8 weight copies (and transposes: MXFP8's columnwise copy, with its scales) that
    TE keeps across a step's micro-batches."""
    if recipe == "none" or not is_fp8_layer(layer):
        return 0.0
    per_param = 2.0 * (1.0 + 1.0 / MX_BLOCK) if recipe == "mxfp8" else 2.0
    return per_param * _converted_params(layer, graph, tp)[0]
