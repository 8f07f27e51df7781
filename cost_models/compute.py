"""Time of an op or layer on one device: a roofline with a size-dependent efficiency and a launch floor.

    t = max(W / (P · eff(W)), B / (M · eff_mem)) + t_launch

W FLOPs, B bytes moved, P peak FLOP/s of the dtype, M memory bandwidth. eff(W) = eff_max · W / (W + W½)
saturates in the arithmetic work, so a small GEMM cannot fill the machine (few tiles per SM, pipeline
fill and drain); with W½ = P · eff_max · t_ramp it is exactly a fixed ramp time added to the ideal time.
GEMM shapes are also rounded up to the tensor-core tile (tile quantization).

With a measured `Profile` (same device), measurement wins: a layer time stored under `key`, then the
GEMM, batched-matmul (attention) and elementwise tables (time against work / bytes, log-log
interpolated, made monotone), whose times already include the launch floor.

A layer pass is a sequence of kernels, so its time is the sum of their times (`kernel_time_s` per
kernel, as capture lists them): GEMMs against weights by work and layout, attention kernels (a fused
flash kernel on GPU, batched matmuls by shape on CPU) and memory-bound kernels (norms, activations,
residual adds) in their own measured class at their own tensor size. `kernels_time_s` prices the older
per-kind totals, spreading work evenly over a kind's kernels (a mix of sizes at its mean size).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from cost_models.hardware import DeviceSpec
from cost_models.monotone import nondecreasing_fit
from cost_models.profile import GemmSample, Profile

__all__ = ["ComputeModel", "GPU_GEMM_EFF_MAX", "GPU_GEMM_RAMP_S", "GPU_MEM_EFF", "GPU_LAUNCH_S", "GPU_TILE",
           "GPU_ATTENTION_EFF_MAX", "MEMORY_KINDS", "GEMM_EFF_MAX_BY_DEVICE", "ATTENTION_EFF_BY_DEVICE",
           "FLASH3_ATTENTION_EFF_BY_DEVICE",
           "gemm_eff_max", "attention_eff", "CAUSAL_TIME_FRACTION", "FITTED_FILE", "sustained_fraction"]

MEMORY_KINDS = ("elementwise", "reduction", "transcendental", "copy")
# which measured elementwise table (profiler.kernels.measure_elementwise) prices each memory-bound kind
_TABLE_OP = {"elementwise": "add", "reduction": "sum", "transcendental": "exp", "copy": "transpose_copy"}

# The best bf16 GEMM shapes through cuBLAS reach a device-specific fraction of the dense tensor-core peak:
# the Maximum Achievable Matmul FLOPS (MAMF) measured by a brute-force shape sweep (Bekman, "Machine Learning
# Engineering", github.com/stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul
# FLOPS comparison table", bf16, mean of 100 iterations): A100 SXM 271.2 of 312 (86.9%), A100 PCIe 252.9
# (81.1%), H100 SXM 794.5 of 989 (80.3%, "H200 is the same"), B200 SXM 1745 of 2250 (77.6%). Catalog names by
# prefix; devices without a measurement take GPU_GEMM_EFF_MAX, the H100's figure.
GEMM_EFF_MAX_BY_DEVICE = {"a100-sxm": 0.869, "a100-pcie": 0.811, "h100-sxm": 0.803, "h200": 0.803, "b200": 0.776}
GPU_GEMM_EFF_MAX = 0.80
# Ramp (fill + drain) per GEMM: with 5 µs a 1024³ bf16 GEMM on A100 reaches ~50% of peak and 8192³
# ~79%, the shape of the curves in Anthony et al. 2024 (Fig. "GEMM throughput vs. size").
GPU_GEMM_RAMP_S = 5e-6
# Memory-bound kernels stream at ~85% of HBM bandwidth (BabelStream on A100/H100: Deakin et al.,
# "Evaluating attainable memory bandwidth of parallel programming models via BabelStream", 2018, and
# later published A100 runs at ~1.3–1.4 TB/s of 1.555).
GPU_MEM_EFF = 0.85
# Host-side launch floor of one eager PyTorch op on CUDA (dispatch + cudaLaunchKernel): the low end of the
# 5–20 µs that Meta's Holistic Trace Analysis reports as the usual CPU time of a kernel launch in PyTorch
# training traces (facebookresearch/HolisticTraceAnalysis, docs/source/features/cuda_kernel_launch_stats.rst,
# "Short GPU kernels"); profiles replace it with launch_overhead_s measured on the machine.
GPU_LAUNCH_S = 5e-6
# Fused attention reaches a lower fraction of peak than a GEMM, and how much lower depends on the
# architecture, because FlashAttention-2 (the kernel PyTorch's scaled_dot_product_attention runs on CUDA) does
# not use Hopper's asynchronous tensor-core instructions. Forward + backward of a non-causal kernel, the
# backward doing 2.5× the forward's FLOPs (its five matmuls, the scores recomputed):
#   A100  the maxima of Dao 2023 (FlashAttention-2, arXiv:2307.08691, §4.1: forward up to 73% of the
#         theoretical 312 TFLOP/s, backward up to 63%): 3.5 / (1/0.73 + 2.5/0.63) = 65.6% of peak;
#   H100  hopper/benchmark_attn.py in the flash-attention repository (PR #1791, H100 SXM, bf16, head dim 128,
#         sequence 8,192): FlashAttention-2 forward 369.9 TFLOP/s, backward 290.6: 3.5 / (1/369.9 + 2.5/290.6)
#         = 309.6 TFLOP/s, 31.3% of 989 (Shah et al. 2024, FlashAttention-3, §1: "only 35% utilization").
# Applied to capture's attention FLOPs (4·b·heads·s_q·s_k·d forward: the whole score matrix); a causal kernel
# then takes CAUSAL_TIME_FRACTION of that time. Devices by prefix.
ATTENTION_EFF_BY_DEVICE = {"a100": 0.656, "h100": 0.313, "h200": 0.313}
GPU_ATTENTION_EFF_MAX = 0.313
# Hopper's asynchronous kernels (DeviceSpec.attention_kernel = "flash3"): FlashAttention-3 (Shah et al. 2024,
# arXiv:2407.08608) and cuDNN's fused attention, which Transformer Engine (Megatron-Core, NeMo) runs and which
# times within a few percent of FlashAttention-3 at head dim 128 (flash-attention issue #1310, benchmark_attn.py
# on Hopper: "CuDNN" vs "Fav3" rows). H100 SXM, bf16, head dim 128, sequence 8,192, non-causal (meta-pytorch/
# tritonbench PR #1254 forward "flash_v3" 638.6 TFLOP/s, PR #1256 backward 561.4): 3.5 / (1/638.6 + 2.5/561.4)
# = 581.5 TFLOP/s, 58.8% of 989. Devices without a Hopper measurement run FlashAttention-2's rates.
FLASH3_ATTENTION_EFF_BY_DEVICE = {"h100": 0.588, "h200": 0.588, "h800": 0.588}
# A fused kernel under a causal mask computes only the score tiles on or below the diagonal (about half of
# them: FlashAttention-2 §4.1 halves its FLOP count for causal), at a lower rate per computed tile (the
# diagonal tiles are masked elementwise and the query blocks' work is unequal). Measured time of the causal
# kernel over the non-causal one, same shapes (flash-attention PR #1791, H100 SXM, head dim 128, sequence
# 8,192): forward 1.935 / 2.972 ms = 0.651, backward 4.788 / 9.460 ms = 0.506.
CAUSAL_TIME_FRACTION = {"forward": 0.651, "backward": 0.506}
# Sustained versus burst: the rates above are short benchmarks (MAMF's 100 iterations of the best shape of a
# sweep, FlashAttention's microbenchmarks). Inside a training step that runs for hours, GEMMs and attention
# run at clocks held down by power and thermal limits, on the model's own shapes rather than a sweep's best,
# beside other kernels' cache and HBM traffic. No GPU was at hand to time it, so the fraction of the burst
# rate they sustain is the one quantity of this model fitted to published runs:
# `python benchmarks/published_runs.py --write-bands` fits it to every run and writes FITTED_FILE, and its
# leave-one-source-out validation fits it again without each source before pricing that source.
FITTED_FILE = Path(__file__).parent / "catalog" / "fitted.toml"
# Tensor-core GEMM tiles: M and N are padded to multiples of 128 (NVIDIA Deep Learning Performance
# Guide, "Matrix Multiplication Background": tile and wave quantization).
GPU_TILE = 128
# Without a profile, a CPU is assumed to reach these fractions (this repo's measurements on the dev VM:
# `autopar profile --quick` reached ~90% of the best GEMM rate for 2048³ and a ~20 µs eager op floor).
CPU_GEMM_EFF_MAX = 0.9
CPU_GEMM_RAMP_S = 20e-6
CPU_LAUNCH_S = 10e-6


def _by_prefix(table: dict[str, float], device: DeviceSpec, default: float) -> float:
    return next((v for k, v in table.items() if device.name.startswith(k)), default)


def gemm_eff_max(device: DeviceSpec) -> float:
    """The fraction of the dense peak the best GEMM shapes reach on `device` (GEMM_EFF_MAX_BY_DEVICE)."""
    return _by_prefix(GEMM_EFF_MAX_BY_DEVICE, device, GPU_GEMM_EFF_MAX)


def attention_eff(device: DeviceSpec) -> float:
    """The fraction of the dense peak the fused attention kernel of `device` (its `attention_kernel`) reaches."""
    flash2 = _by_prefix(ATTENTION_EFF_BY_DEVICE, device, GPU_ATTENTION_EFF_MAX)
    if device.attention_kernel == "flash3":
        return _by_prefix(FLASH3_ATTENTION_EFF_BY_DEVICE, device, flash2)
    return flash2


@functools.cache
def _fitted(path: Path = FITTED_FILE) -> dict:
    if not path.exists():
        return {}
    return tomllib.loads(path.read_text())


def sustained_fraction(device: DeviceSpec) -> float:
    """The fraction of its burst tensor-core rate `device` sustains in training: its own `sustained_fraction`
    when set, else the value fitted on published runs (FITTED_FILE; 1 when none was fitted); 1 on a CPU,
    whose rates come from its own profile."""
    if device.kind != "gpu":
        return 1.0
    if device.sustained_fraction is not None:
        return device.sustained_fraction
    return float(_fitted().get("sustained_fraction", 1.0))


def _monotone_interp(xs: list[float], ts: list[float], x: float, tail_rate: float) -> float:
    """Time at x from (x, time) rows: log-log interpolation of the least-squares non-decreasing fit;
    below the range the smallest time (a floor); above it the last time plus (x − x_max) / tail_rate."""
    order = np.argsort(xs)
    xa = np.asarray(xs, dtype=float)[order]
    ta = np.array(nondecreasing_fit([float(ts[i]) for i in order]))
    if x <= xa[0]:
        return float(ta[0])
    if x >= xa[-1]:
        return float(ta[-1] + (x - xa[-1]) / tail_rate)
    return float(np.exp(np.interp(math.log(x), np.log(xa), np.log(ta))))


class ComputeModel:
    """Compute time on one `device`; `profile` (measured on this device) takes precedence."""

    def __init__(self, device: DeviceSpec, profile: Profile | None = None) -> None:
        self.device = device
        self.profile = profile
        gpu = device.kind == "gpu"
        sustained = sustained_fraction(device)  # of the burst rates, what a training step sustains
        self.eff_max = gemm_eff_max(device) * sustained if gpu else CPU_GEMM_EFF_MAX
        self.attention_eff = attention_eff(device) * sustained if gpu else self.eff_max
        self.ramp_s = GPU_GEMM_RAMP_S if gpu else CPU_GEMM_RAMP_S
        self.mem_eff = GPU_MEM_EFF if gpu else 1.0
        self.tile = GPU_TILE if gpu else 1
        self.launch_s = profile.launch_overhead_s if profile is not None else (GPU_LAUNCH_S if gpu else CPU_LAUNCH_S)

    def __repr__(self) -> str:
        return f"ComputeModel({self.device.name}, profile={'yes' if self.profile else 'no'})"

    # ---- the default curves ----
    def efficiency(self, flops: float, dtype: str = "bfloat16") -> float:
        """eff(W) = eff_max · W / (W + W½), W½ = peak · eff_max · ramp_s."""
        w_half = self.device.peak_flops_for(dtype) * self.eff_max * self.ramp_s
        return self.eff_max * flops / (flops + w_half) if flops > 0 else 0.0

    def _compute_s(self, flops: float, dtype: str, layout: str | None = None, *, attention: bool = False) -> float:
        """One matmul kernel of `flops`: the profile's table (batched matmuls for attention, when measured),
        else the roofline with eff(W), capped at attention_eff(device) for a fused GPU attention kernel."""
        if flops <= 0:
            return 0.0
        samples = []
        if self.profile is not None:
            batched = self.profile.gemm_samples(dtype, layout, batched=True) if attention else []
            if batched:  # shape unknown: the typical rate of measured attention matmuls of similar work
                return flops / _work_rate(batched, flops)
            samples = self.profile.gemm_samples(dtype, layout)
        if samples:
            best = max(s.flops_per_s for s in samples)
            return _monotone_interp([s.flops for s in samples], [s.time_s for s in samples], flops, best)
        eff = self.efficiency(flops, dtype)
        if attention and self.device.kind == "gpu":
            eff *= self.attention_eff / self.eff_max
        return flops / (self.device.peak_flops_for(dtype) * eff)

    def _memory_s(self, bytes_moved: float, dtype: str, kind: str = "elementwise",
                  tensor_bytes: float | None = None) -> float:
        """Memory-bound time. With the largest tensor's size known (and recorded in the table), the
        measured rate at that tensor size prices the traffic: the rate depends on where that tensor lives
        (cache, reused heap, fresh mapping), the time on how many bytes move. Else the table's time at
        the same traffic."""
        if bytes_moved <= 0:
            return 0.0
        rows = list(self.profile.elementwise) if self.profile else []
        rows = [r for r in rows if r.dtype == dtype] or rows
        rows = [r for r in rows if r.op == _TABLE_OP[kind]] or [r for r in rows if r.op == "add"] or rows
        if rows and tensor_bytes and all(r.tensor_bytes > 0 for r in rows):
            order = sorted(rows, key=lambda r: r.tensor_bytes)
            log_rate = np.interp(math.log(tensor_bytes), [math.log(r.tensor_bytes) for r in order],
                                 [math.log(r.bytes_per_s) for r in order])
            return max(bytes_moved / math.exp(log_rate), min(r.time_s for r in rows))
        if rows:
            best = max(r.bytes_per_s for r in rows)
            return _monotone_interp([r.n_bytes for r in rows], [r.time_s for r in rows], bytes_moved, best)
        return bytes_moved / (self.device.memory_bandwidth_Bps * self.mem_eff)

    def _measured_tables(self, dtype: str) -> bool:
        return self.profile is not None and bool(self.profile.gemm_samples(dtype)) and bool(self.profile.elementwise)

    # ---- public API ----
    def op_time_s(self, flops: float, bytes_moved: float, dtype: str = "bfloat16", key: str | None = None,
                  kind: str = "elementwise", tensor_bytes: float | None = None) -> float:
        """Seconds for an op or a layer doing `flops` and moving `bytes_moved` (read + written).

        `key` names a measured entry in profile.layer_times (e.g. layer_key(sig, "fwd", 2, 1)), used as is.
        `kind` (one of MEMORY_KINDS) picks which measured memory table prices the bytes: a CPU spends more
        per byte on exp/softmax/GELU or on a transposing copy than on an add. `tensor_bytes`, the op's
        largest tensor, picks the measured rate by size (see `_memory_s`).
        """
        if flops < 0 or bytes_moved < 0:
            raise ValueError(f"op_time_s: flops={flops} and bytes_moved={bytes_moved} must be non-negative")
        if kind not in MEMORY_KINDS:
            raise ValueError(f"op_time_s: kind={kind!r}; expected one of {MEMORY_KINDS}")
        if key is not None and self.profile is not None and key in self.profile.layer_times:
            return self.profile.layer_times[key]
        if flops == 0 and bytes_moved == 0:
            return 0.0
        roof = max(self._compute_s(flops, dtype), self._memory_s(bytes_moved, dtype, kind, tensor_bytes))
        if self._measured_tables(dtype):  # measured times already include the launch floor
            return max(roof, self.launch_s)
        return roof + self.launch_s

    def gemm_time_s(self, m: int, n: int, k: int, dtype: str = "bfloat16", layout: str = "nn") -> float:
        """Seconds for (m×k)·(k×n): an exact measured shape and layout if profiled, else the FLOP rate of
        the nearest measured shapes of that layout (`_shape_rate`), else the roofline on the tile-padded
        FLOPs and the bytes of both operands and the result."""
        if min(m, n, k) <= 0:
            raise ValueError(f"gemm_time_s: m={m}, n={n}, k={k} must be positive")
        rows = self.profile.gemm_samples(dtype, layout) if self.profile is not None else []
        for s in rows:
            if (s.m, s.n, s.k, s.layout) == (m, n, k, layout):
                return s.time_s
        if rows:  # the rate of the nearest measured shapes: at equal work, a large m×n output is slower
            return max(2.0 * m * n * k / _shape_rate(rows, m, n, k), self.launch_s)
        pad_m = math.ceil(m / self.tile) * self.tile
        pad_n = math.ceil(n / self.tile) * self.tile
        flops = 2.0 * pad_m * pad_n * k
        bytes_moved = _dtype_bytes(dtype) * (m * k + k * n + m * n)
        roof = self._gemm_roof_s(flops, bytes_moved, dtype, layout)
        return max(roof, self.launch_s) if self._measured_tables(dtype) else roof + self.launch_s

    def _gemm_roof_s(self, flops: float, bytes_moved: float, dtype: str, layout: str) -> float:
        """A matmul's time before the launch floor. Measured GEMM times already include streaming the
        operands, so with a GEMM table of this dtype there is no separate memory roof: the elementwise
        (add) table is the wrong one for a GEMM's operands, and its monotone envelope let one slow row
        (a bf16 add at 256 KiB timed at 0.1 GB/s on this shared VM) floor every bf16 GEMM of 1.5–13 MB of
        operands at ~8 ms (`python benchmarks/cost_model_accuracy.py`). Without a table, the roofline."""
        compute = self._compute_s(flops, dtype, layout)
        if self.profile is not None and self.profile.gemm_samples(dtype):
            return compute
        return max(compute, self._memory_s(bytes_moved, dtype))

    def batched_gemm_time_s(self, batch: int, m: int, n: int, k: int, dtype: str = "bfloat16",
                            layout: str = "nn") -> float:
        """Seconds for torch.bmm of `batch` products (m×k)·(k×n) (eager attention's QKᵀ, PV and their
        gradients): the profile's batched-matmul table at the same per-matrix shape and layout (time scaled
        by the batch), else its FLOP rate interpolated between the nearest measured shapes (`_shape_rate`),
        else one GEMM kernel doing all the work (the tile-padded roofline)."""
        if min(batch, m, n, k) <= 0:
            raise ValueError(f"batched_gemm_time_s: batch={batch}, m={m}, n={n}, k={k} must be positive")
        rows = self.profile.gemm_samples(dtype, layout, batched=True) if self.profile is not None else []
        if rows:
            for s in rows:
                if (s.m, s.n, s.k, s.layout) == (m, n, k, layout):
                    return s.time_s * batch / s.batch
            return max(batch * 2.0 * m * n * k / _shape_rate(rows, m, n, k), self.launch_s)
        pad_m = math.ceil(m / self.tile) * self.tile
        pad_n = math.ceil(n / self.tile) * self.tile
        flops = 2.0 * batch * pad_m * pad_n * k
        bytes_moved = _dtype_bytes(dtype) * batch * (m * k + k * n + m * n)
        roof = self._gemm_roof_s(flops, bytes_moved, dtype, layout)
        return max(roof, self.launch_s) if self._measured_tables(dtype) else roof + self.launch_s

    def kernel_time_s(self, kind: str, work: float, *, dtype: str = "bfloat16", tensor_bytes: float = 0.0,
                      layout: str | None = None, mnk: tuple[int, int, int] | None = None, groups: int = 1,
                      causal: bool = False, backward: bool = False, launch_per_group: bool = False) -> float:
        """Seconds for one kernel of a layer pass, priced as `optrace.predict_op_time_s` prices the op:

          gemm            `work` FLOPs at the GEMM table's rate for that work and operand layout (the
                          roofline with eff(W) without a profile)
          attention       a batched matmul of per-matrix shape `mnk` (work / 2mnk matrices) from the
                          batched-matmul table (`batched_gemm_time_s`); a fused kernel (mnk None) by work,
                          at attention_eff(device) on a GPU
          memory kinds    `work` bytes in the measured table of that class (MEMORY_KINDS) at the rate of a
                          tensor of `tensor_bytes`; bandwidth × efficiency without a profile
        plus the launch floor (measured times already include it, so there it is a minimum). A grouped GEMM
        (`groups` > 1: one launch over that many weight matrices, as torch._grouped_mm runs a mixture of
        experts) is `groups` GEMMs of work / groups each, at the efficiency of that smaller size, and one
        launch floor; with `launch_per_group` (a framework that issues each group's GEMM as a kernel of its
        own: cost_models.pipeline.EXPERT_GEMMS "per_expert") each of them pays the floor. A `causal` fused
        attention kernel on a GPU (Kernel.causal) takes CAUSAL_TIME_FRACTION of its pass's (`backward` or
        forward) full-matrix time: it skips the masked tiles.
        """
        if work < 0 or tensor_bytes < 0 or groups < 1:
            raise ValueError(f"kernel_time_s: work={work}, tensor_bytes={tensor_bytes} must be non-negative and "
                             f"groups={groups} ≥ 1")
        if kind == "gemm":
            t = self._compute_s(work / groups, dtype, layout)
            if launch_per_group:
                return groups * _kernel_floor(self._measured_tables(dtype), self.launch_s, t)
            t *= groups
        elif kind == "attention":
            rows = self.profile.gemm_samples(dtype, layout, batched=True) if self.profile is not None else []
            if mnk is not None and rows and work > 0:
                m, n, k = mnk
                exact = [r for r in rows if (r.m, r.n, r.k) == (m, n, k) and (layout is None or r.layout == layout)]
                t = exact[0].time_s * work / exact[0].flops if exact else work / _shape_rate(rows, m, n, k)
            else:
                t = self._compute_s(work, dtype, attention=True)
            if causal and mnk is None and self.device.kind == "gpu":
                t *= CAUSAL_TIME_FRACTION["backward" if backward else "forward"]
        elif kind in MEMORY_KINDS:
            t = self._memory_s(work, dtype, kind, tensor_bytes or None)
        else:
            raise ValueError(f"kernel_time_s: kind={kind!r}; expected 'gemm', 'attention' or one of {MEMORY_KINDS}")
        return _kernel_floor(self._measured_tables(dtype), self.launch_s, t)

    def kernels_time_s(self, *, gemm_flops: float, gemm_count: int, attention_flops: float, attention_count: int,
                       memory_bytes: float, memory_count: int, dtype: str = "bfloat16") -> float:
        """Seconds for one layer pass as the sum of its kernels (a capture KernelMix, in numbers):

            gemm_count × t_gemm(gemm_flops / gemm_count) + attention_count × t_attn(attention_flops /
            attention_count) + memory_count × t_mem(memory_bytes / memory_count)

        t_gemm: the GEMM table or the roofline with eff(W) and the launch floor; t_attn: the batched-matmul
        table (CPU) or the roofline at attention_eff(device) (fused flash attention); t_mem: the elementwise
        table or bandwidth × efficiency. Every kernel costs at least the launch floor. Work is spread
        evenly over a group's kernels, which prices a mix of sizes at their mean size.
        """
        parts = {"gemm": (gemm_flops, gemm_count), "attention": (attention_flops, attention_count),
                 "memory": (memory_bytes, memory_count)}
        for name, (work, count) in parts.items():
            if work < 0 or count < 0 or (work > 0 and count == 0):
                raise ValueError(f"kernels_time_s: {name} work={work} over count={count}; work must be "
                                 "non-negative and spread over at least one kernel")
        measured = self._measured_tables(dtype)

        def kernel_s(work_s: float) -> float:
            return max(work_s, self.launch_s) if measured else work_s + self.launch_s

        total = 0.0
        if gemm_count:
            total += gemm_count * kernel_s(self._compute_s(gemm_flops / gemm_count, dtype))
        if attention_count:
            total += attention_count * kernel_s(self._compute_s(attention_flops / attention_count, dtype,
                                                                attention=True))
        if memory_count:
            total += memory_count * kernel_s(self._memory_s(memory_bytes / memory_count, dtype))
        return total


def _kernel_floor(measured: bool, launch_s: float, work_s: float) -> float:
    """A kernel's time with the launch floor: measured times include it (a minimum), modelled ones add it."""
    return max(work_s, launch_s) if measured else work_s + launch_s


def _shape_rate(rows: list[GemmSample], m: int, n: int, k: int) -> float:
    """FLOP/s at shape (m, n, k) from measured shapes: a weighted geometric mean of their rates with
    weights 1/d⁴, d the distance in (log2 m, log2 n, log2 k). Work alone does not set a small matmul's
    rate: (s, s, 64) writes an s×s result while (s, 64, s) reads it, at equal FLOPs and very different
    speeds, so neighbours are found in shape space; the 4th power keeps it local (to the shapes one
    doubling away), and the midpoint of two measured shapes gets the geometric mean of their rates."""
    target = np.log2([m, n, k])
    dist = np.array([np.linalg.norm(np.log2([s.m, s.n, s.k]) - target) for s in rows])
    weights = 1.0 / np.maximum(dist, 1e-9) ** 4
    log_rates = np.log([s.flops_per_s for s in rows])
    return float(np.exp(np.sum(weights * log_rates) / np.sum(weights)))


def _work_rate(rows: list[GemmSample], flops: float) -> float:
    """Geometric mean FLOP/s of the samples whose work is within ×4 of `flops` (else the nearest in log
    work): without the shape, every measured shape and layout of that size is equally likely."""
    dist = np.abs(np.log([s.flops / flops for s in rows]))
    near = dist <= math.log(4.0) if np.any(dist <= math.log(4.0)) else dist == dist.min()
    return float(np.exp(np.mean(np.log([s.flops_per_s for s, keep in zip(rows, near, strict=True) if keep]))))


def _dtype_bytes(dtype: str) -> int:
    sizes = {"float32": 4, "fp32": 4, "tf32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "fp8": 1,
             "mxfp8": 1, "float64": 8}
    if dtype not in sizes:
        raise KeyError(f"unknown dtype {dtype!r}; expected one of {sorted(sizes)}")
    return sizes[dtype]
