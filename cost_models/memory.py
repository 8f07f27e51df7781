"""Memory per device: model states, activations, in-flight micro-batches, transient buffers.

Sources:
- Model states under ZeRO: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
  Trillion Parameter Models", §3 and Fig. 1 (mixed-precision Adam: 2 + 2 + 12 bytes per parameter).
- Activations per transformer layer: Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", §4 and Table 2 (16-bit activations, dropout masks at 1 byte).
- In-flight micro-batches: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", §2.2 (1F1B keeps at most p − i micro-batches on stage i; GPipe keeps m),
  and the interleaved schedule's warm-up as torch.distributed.pipelining runs it (schedules.py,
  _get_warmup_ops and ScheduleInterleaved1F1B: (p − i − 1)·2 + (v − 1)·N chunk-micro-batches, N the
  micro-batches per round, m // max(1, m // p); Megatron-LM's is the same with N = p).
All byte counts are per device.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.pipeline_order import group_peaks

__all__ = [
    "ModelStateBytes",
    "model_state_bytes",
    "korthikanti_activation_bytes",
    "layer_activation_bytes",
    "inflight_microbatches",
    "pipeline_buffers",
    "interleaved_round",
    "zero3_gathered_param_bytes",
    "logits_bytes",
    "loss_saved_bytes",
    "FP32_LOSS_PEAK_BYTES_PER_LOGIT",
    "LOSS_KERNELS",
    "LOSS_CHUNK_FP32_BYTES",
    "loss_chunk_tokens",
    "PIPELINE_MEMORY",
    "ALLOCATOR_RESERVE_FRACTION",
    "ALLOCATOR_FRAGMENTATION",
    "reserved_bytes",
    "RECOMPUTE_MODES",
    "SCHEDULES",
]

# Activation recompute per layer, from the most memory to the least: none; "selective" drops the attention
# core (Korthikanti et al. 2022 §4.2); "op_sac" saves matmul and attention outputs and recomputes every
# second matmul and all pointwise ops (torchtitan's op-level selective activation checkpointing); "full"
# keeps only the layer input (Chen et al. 2016). The one list of modes autopar uses.
RECOMPUTE_MODES = ("none", "selective", "op_sac", "full")
# How the loss is computed over the logits: "chunked", autopar's lm_cross_entropy (autopar/codegen/loss.py),
# which upcasts one chunk of rows at a time, keeps a fp32 log-sum-exp per row and recomputes each chunk's
# softmax in backward (as Liger's and torchtitan's chunked losses); "fp32_logits", torch's and Megatron-LM's
# cross-entropy, which upcast the [b, s, V] logits to fp32 and keep a fp32 log-softmax for backward (a loss
# the model computes itself, or a loss_fn of F.cross_entropy(logits.float())); "fused", a fused
# cross-entropy kernel over the 16-bit logits that keeps only a fp32 log-sum-exp per row and writes the
# gradient into the logits' own buffer (flash-attn's `flash_attn/losses/cross_entropy.py`, inplace_backward,
# which llm-foundry's MPT uses by default).
LOSS_KERNELS = ("chunked", "fp32_logits", "fused")
# The fp32 bytes of one chunk of the chunked loss: rows per chunk = this ÷ (4 B × the rank's vocabulary slice)
# (loss_chunk_tokens). 256 MiB: ~1,300 rows of a 50k vocabulary, large enough to keep a GPU busy per kernel.
LOSS_CHUNK_FP32_BYTES = 256 * 2**20
# What the pipeline runtime of a layout with pp > 1 (cost_models.pipeline.PIPELINE_RUNTIMES) holds beyond the
# layers' activations and the ZeRO stage's states (autopar.planner.memory_costs): "autopar",
# torch.distributed.pipelining's schedules with autopar's stages (codegen/inflight_stage.py: receive buffers for
# the micro-batches in flight only, outputs freed once sent, the sends' aliases at the latest at their backward);
# "torch", the same schedules with torch's own PipelineStage, as torchtitan runs them (a receive buffer for every
# micro-batch's input and output gradient, every in-flight output kept until its backward). Both run FSDP's
# backward without gradient sync until the step's last (unsharded gradients accumulated for the whole step);
# "megatron", Megatron-LM's schedules (receive buffers allocated per transfer, outputs freed once sent:
# deallocate_output_tensor in megatron/core/pipeline_parallel/schedules.py), DeepSpeed's
# pipeline engine (buffers for the in-flight micro-batches only, num_pipe_buffers) and Meta's Llama 3 trainer
# (stage inputs and outputs freed as soon as used, Dubey et al. 2024 §3.3.2): nothing beyond the in-flight
# inputs the activations count, and each ZeRO stage's states as Rajbhandari et al. define them.
PIPELINE_MEMORY = ("autopar", "torch", "megatron")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

# Fraction of device memory a layout may not fill with tensors (autopar.PlannerOptions.memory_reserve_fraction):
# what lives outside PyTorch's caching allocator — the CUDA context and loaded kernels (~0.5 GiB), NCCL's
# per-communicator buffers (NCCL_BUFFSIZE 4 MiB × 2 directions × up to 32 channels ≈ 256 MiB per
# communicator, 3–4 communicators in a 3-D layout), cuBLAS workspaces (32 MiB per stream on Hopper,
# PyTorch's CUBLAS_WORKSPACE_CONFIG notes) — about 2–3 GiB, 3–4% of an 80 GB device, plus a little slack.
# The allocator's fragmentation is not part of it: short of memory it frees its cached blocks and retries
# before raising out-of-memory, which is why published runs fill their devices: torchtitan's Llama 2 13B
# without recompute on 80 GB A100s needs ~72.5 GiB of tensors (benchmarks/published_runs.py), more than a
# 10% reserve allowed.
ALLOCATOR_RESERVE_FRACTION = 0.05
# What the caching allocator holds beyond the tensors it serves, as a fraction of what it holds: 15% on
# average over eight LLMs trained with recompute, ZeRO and offloading on A100-80GB (Guo et al. 2024,
# "GMLake: Efficient and Transparent GPU Memory Defragmentation for Large-scale DNN Training with Virtual
# Memory Stitching", ASPLOS'24, abstract and §6: fragmentation reduced by 15% on average, up to 33%).
# It turns a predicted tensor peak (torch.cuda.max_memory_allocated) into the torch.cuda.max_memory_reserved
# that trainers such as torchtitan report (`reserved_bytes`).
ALLOCATOR_FRAGMENTATION = 0.15


@dataclass(frozen=True, kw_only=True)
class ModelStateBytes:
    """Per-device bytes of weights, gradients and optimizer states, and of the 16-bit compute copies of the
    weights a step holds from its first forward to its last backward (cost_models.precision)."""

    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    compute_copy_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.compute_copy_bytes


def _check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; it must be a positive integer")


def model_state_bytes(num_params: float, *, zero_stage: int, dp: int, weight_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes: float = 12) -> ModelStateBytes:
    """Model states per device for `num_params` parameters held by this device (after TP/PP division).

    ZeRO-1 shards the optimizer states over the dp ranks, ZeRO-2 also the gradients, ZeRO-3 also the
    weights. The defaults are mixed-precision Adam: bf16 weights and grads, fp32 master weights,
    momentum and variance (12 bytes). ZeRO Fig. 1: Ψ = 7.5B, N_d = 64 → 120 / 31.4 / 16.6 / 1.9 GB.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}; expected 0, 1, 2 or 3")
    _check_positive_int("dp", dp)
    if num_params < 0:
        raise ValueError(f"num_params={num_params} is negative")
    w = num_params * weight_bytes
    g = num_params * grad_bytes
    o = num_params * optimizer_bytes
    return ModelStateBytes(
        weights_bytes=w / dp if zero_stage >= 3 else w,
        grads_bytes=g / dp if zero_stage >= 2 else g,
        optimizer_bytes=o / dp if zero_stage >= 1 else o,
    )


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r}; expected one of {RECOMPUTE_MODES}")


def korthikanti_activation_bytes(*, seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                                 sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes per transformer layer per device, Korthikanti et al. 2022, Table 2.

    sbh·(34 + 5as/h) splits into 10·sbh replicated outside the TP regions (layer norms, their inputs,
    dropout masks), 24·sbh inside them and 5as²b for the attention core (scores, softmax, its mask).
    TP divides the 24 and the core by t; SP also divides the 10; selective recompute drops the core;
    full recompute keeps only the 2·sbh layer input (divided by t under SP, as Megatron stores it).
    """
    _check_recompute(recompute)
    if recompute == "op_sac":
        raise ValueError("Korthikanti et al.'s Table 2 has no op-level policy; price op_sac from a captured "
                         "layer (layer_activation_bytes with the bytes the policy keeps)")
    for name, v in (("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden", hidden), ("heads", heads),
                    ("tp", tp)):
        _check_positive_int(name, v)
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True needs tp > 1")
    sbh = seq_len * micro_batch * hidden
    sp_div = tp if sequence_parallel else 1
    if recompute == "full":
        return 2.0 * sbh / sp_div
    core = 5.0 * heads * seq_len / hidden if recompute == "none" else 0.0
    return sbh * (10.0 / sp_div + 24.0 / tp + core / tp)


def layer_activation_bytes(*, saved_bytes: float, tp_sharded_bytes: float, attention_core_bytes: float,
                           input_bytes: float, micro_batch: int, tp: int, sequence_parallel: bool,
                           recompute: str) -> float:
    """Korthikanti's rules applied to a captured layer's measured per-sample bytes.

    saved_bytes: everything saved for backward (no parallelism); tp_sharded_bytes: the part inside
    tensor-parallel regions (÷ tp); attention_core_bytes: the part selective recompute drops (it lies
    inside the TP regions); input_bytes: what full recompute keeps. For "op_sac", saved_bytes and
    tp_sharded_bytes are what the op-level policy keeps (LayerSpec.saved_activation_bytes_op_sac), and
    nothing further is dropped. Returns bytes per device.
    """
    _check_recompute(recompute)
    _check_positive_int("micro_batch", micro_batch)
    _check_positive_int("tp", tp)
    if not 0 <= attention_core_bytes <= tp_sharded_bytes <= saved_bytes:
        raise ValueError(
            f"need 0 ≤ attention_core_bytes ({attention_core_bytes}) ≤ tp_sharded_bytes ({tp_sharded_bytes}) "
            f"≤ saved_bytes ({saved_bytes})"
        )
    sp_div = tp if sequence_parallel else 1
    if recompute == "full":
        return micro_batch * input_bytes / sp_div
    dropped = attention_core_bytes if recompute == "selective" else 0.0
    replicated = saved_bytes - tp_sharded_bytes
    return micro_batch * (replicated / sp_div + (tp_sharded_bytes - dropped) / tp)


def interleaved_round(pp: int, num_microbatches: int) -> int:
    """Micro-batches per round N of torch.distributed.pipelining's ScheduleInterleaved1F1B: m // max(1, m // p)
    (a rank runs N micro-batches through one chunk before moving to its next; Megatron-LM's N is p, and
    Dubey et al. 2024 §3.3.2 make it a knob). N ≥ p whenever m ≥ p, so it is p only when p divides m."""
    _check_positive_int("pp", pp)
    _check_positive_int("num_microbatches", num_microbatches)
    return num_microbatches // max(1, num_microbatches // pp)


def inflight_microbatches(schedule: str, pp: int, num_microbatches: int, stage: int,
                          virtual_stages: int = 1, microbatch_group: int | None = None) -> float:
    """Micro-batches whose activations pipeline rank `stage` (0-based) holds at its peak.

    In units of one micro-batch through the whole rank's layers: with interleaving a rank holds v
    chunks of 1/v of its layers, so chunk-micro-batches count 1/v each; its peak is the warm-up's forwards
    plus the first steady-state forward, before the first backward frees one. With `microbatch_group` N set,
    the peak of the order autopar runs for that N (cost_models.pipeline_order), counted action by action.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; expected one of {SCHEDULES}")
    _check_positive_int("pp", pp)
    _check_positive_int("num_microbatches", num_microbatches)
    _check_positive_int("virtual_stages", virtual_stages)
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} is outside 0..{pp - 1} for pp={pp}")
    m = num_microbatches
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - stage))
    v = virtual_stages
    if microbatch_group is not None:
        return group_peaks(pp, v, m, microbatch_group)[stage] / v
    warmup = (pp - stage - 1) * 2 + (v - 1) * interleaved_round(pp, m)
    chunks = min(warmup + 1, m * v)
    return chunks / v


def pipeline_buffers(pipeline_memory: str, *, q: int, pp: int, v: int, m: int, inflight: float,
                     schedule: str = "1f1b") -> float:
    """Stage-boundary tensors pipeline rank q holds in its pipelining runtime beyond its layers' activations.

    autopar's stages (codegen/inflight_stage.py, over torch.distributed.pipelining's schedules) allocate a
    receive buffer when the receive is posted and drop it after that micro-batch's backward: the input
    buffers are those of the micro-batches in flight, the inputs the stage's first layer saves, counted
    with its activations; a gradient buffer lives from its receive to its backward, one at the backward
    that makes the rank's peak. A stage frees each output's data once its send is handed to the schedule
    (Megatron-LM's deallocate_output_tensor); the send reads an alias that lives while the schedule holds
    the send: torch's Schedule1F1B keeps the last forward's send and its warm-up's last send work (2);
    ScheduleGPipe keeps its send works to the end of the forwards and the multi-stage runtime (interleaved)
    to the end of the step, so there the alias is freed at its micro-batch's backward: the outputs of the
    sending stages' micro-batches in flight. `inflight`: micro-batches in flight per stage of the rank
    (inflight_microbatches). torch's own PipelineStage (pipeline_memory="torch", torchtitan's runtime) holds
    an input and a gradient buffer for
    every micro-batch index for the whole step, beyond the in-flight inputs the activations count, and every
    in-flight output until its backward (torch/distributed/pipelining/stage.py: _setup_forward_recv_info and
    _setup_backward_recv_info, forward_one_chunk's fwd_cache; tests/test_pipeline_memory.py). Under
    pipeline_memory="megatron" (another framework's runtime, cost_models.memory.PIPELINE_MEMORY) there is
    nothing beyond the activations (PIPELINE_MEMORY)."""
    if pipeline_memory not in PIPELINE_MEMORY:
        raise ValueError(f"pipeline_memory={pipeline_memory!r}; expected one of {PIPELINE_MEMORY}")
    if pp == 1 or pipeline_memory == "megatron":
        return 0.0
    sending = v - (1 if q == pp - 1 else 0)  # stages of the rank that are not the model's last
    if pipeline_memory == "torch":
        receiving = v - (1 if q == 0 else 0)  # nor its first
        return receiving * (m - inflight) + sending * (inflight + m)
    if sending == 0:
        return 0.0
    if schedule == "1f1b":
        held = min(2.0, inflight)
    elif schedule == "gpipe":
        held = float(m)
    else:  # the rank's chunks in flight (inflight counts whole-rank micro-batches: chunks / v); at the last
        # rank's peak they are its sending stages' (the head's chunk runs its backward right after its forward)
        held = inflight * v
    return held + 1.0


def zero3_gathered_param_bytes(*, largest_layer_param_bytes: float, prefetch_layers: int = 1,
                               grad_bytes_ratio: float = 1.0) -> float:
    """Transient bytes of ZeRO-3 / FSDP: unsharded parameters of the running layer and of the
    `prefetch_layers` layers gathered ahead (FSDP forward/backward prefetch), plus the running layer's
    unsharded gradient before its reduce-scatter (grad dtype / param dtype = grad_bytes_ratio).
    """
    if largest_layer_param_bytes < 0 or prefetch_layers < 0:
        raise ValueError("largest_layer_param_bytes and prefetch_layers must be non-negative")
    return largest_layer_param_bytes * (1 + prefetch_layers + grad_bytes_ratio)


# Peak bytes per logit of torch's cross-entropy over upcast logits (F.cross_entropy(logits.float(), t)),
# beyond the logits themselves: its backward holds the saved fp32 log-softmax, nll_loss's dense fp32 gradient
# and log-softmax's fp32 gradient at once (3 × 4 B), more than its forward's fp32 upcast and log-softmax
# (2 × 4 B). Measured: peak resident bytes of that forward and backward on CPU, tests/test_loss_memory.py
# (12.00 B per logit above bf16 logits the caller drops before backward, 14.00 when it keeps them).
FP32_LOSS_PEAK_BYTES_PER_LOGIT = 12


def loss_chunk_tokens(tokens: int, vocab_local: float) -> int:
    """Rows the chunked loss upcasts to fp32 at a time over `tokens` rows of `vocab_local` logits each."""
    return max(1, min(tokens, int(LOSS_CHUNK_FP32_BYTES // (4 * vocab_local))))


def logits_bytes(*, micro_batch: int, seq_len: int, vocab: int, tp: int = 1, dtype_bytes: int = 2,
                 loss_kernel: str = "fp32_logits", held: bool = False, chunk_tokens: int | None = None) -> float:
    """Peak bytes of the loss over one micro-batch's [b, s, V/t] logits on the last stage: with the
    "fp32_logits" loss kernel, FP32_LOSS_PEAK_BYTES_PER_LOGIT, plus the logits in the model dtype where they
    stay referenced while the loss runs (`held`: torch.distributed.pipelining's last stage keeps its output
    for backward); with "fused", the 16-bit logits and a fp32 log-sum-exp per row (LOSS_KERNELS); with
    "chunked", its backward's peak: the logits it saves (held either way) and their gradient in the model
    dtype, one chunk's fp32 logits (`chunk_tokens` rows, default loss_chunk_tokens) and a fp32 log-sum-exp
    per row (measured: tests/test_loss_memory.py).
    """
    for name, v in (("micro_batch", micro_batch), ("seq_len", seq_len), ("vocab", vocab), ("tp", tp)):
        _check_positive_int(name, v)
    if loss_kernel not in LOSS_KERNELS:
        raise ValueError(f"loss_kernel={loss_kernel!r}; expected one of {LOSS_KERNELS}")
    tokens, v_local = micro_batch * seq_len, vocab / tp
    if loss_kernel == "fused":
        return tokens * (v_local * dtype_bytes + 4)
    if loss_kernel == "chunked":
        chunk = min(tokens, chunk_tokens or loss_chunk_tokens(tokens, v_local))
        return tokens * (v_local * 2 * dtype_bytes + 4) + chunk * v_local * 4
    return tokens * v_local * (FP32_LOSS_PEAK_BYTES_PER_LOGIT + (dtype_bytes if held else 0))


def loss_saved_bytes(*, micro_batch: int, seq_len: int, vocab: int, tp: int = 1, dtype_bytes: int = 2,
                     loss_kernel: str = "fp32_logits", held: bool = False) -> float:
    """Bytes one micro-batch's loss keeps from its forward to its backward (a micro-batch in flight on the last
    stage beside the running one): "chunked" saves the logits and a fp32 log-sum-exp per row; the other kernels
    are priced at their whole peak (logits_bytes)."""
    if loss_kernel == "chunked":
        _check_positive_int("tp", tp)
        return micro_batch * seq_len * (vocab / tp * dtype_bytes + 4)
    return logits_bytes(micro_batch=micro_batch, seq_len=seq_len, vocab=vocab, tp=tp, dtype_bytes=dtype_bytes,
                        loss_kernel=loss_kernel, held=held)


def reserved_bytes(allocated_bytes: float, usable_bytes: float) -> float:
    """torch.cuda.max_memory_reserved() for a tensor peak of `allocated_bytes`: the caching allocator holds
    allocated / (1 − ALLOCATOR_FRAGMENTATION), but never more than the device offers it (`usable_bytes`:
    short of memory it frees cached blocks and retries), nor less than the tensors themselves."""
    if allocated_bytes < 0 or usable_bytes <= 0:
        raise ValueError(f"allocated_bytes={allocated_bytes} must be ≥ 0 and usable_bytes={usable_bytes} > 0")
    return max(allocated_bytes, min(allocated_bytes / (1.0 - ALLOCATOR_FRAGMENTATION), usable_bytes))
