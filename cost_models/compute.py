"""Time of an op or layer on one device: a roofline with a size-dependent efficiency and a launch floor.

    t = max(W / (P · eff(W)), B / (M · eff_mem)) + t_launch

W FLOPs, B bytes moved, P peak FLOP/s of the dtype, M memory bandwidth. eff(W) = eff_max · W / (W + W½)
saturates in the arithmetic work, so a small GEMM cannot fill the machine (few tiles per SM, pipeline
fill and drain); with W½ = P · eff_max · t_ramp it is exactly a fixed ramp time added to the ideal time.
GEMM shapes are also rounded up to the tensor-core tile (tile quantization).

With a measured `Profile` (same device), measurement wins: a layer time stored under `key`, then the
GEMM and elementwise tables (time against work / bytes, log-log interpolated, made monotone), whose
times already include the launch floor.
"""

from __future__ import annotations

import math

import numpy as np

from cost_models.hardware import DeviceSpec
from cost_models.profile import Profile

__all__ = ["ComputeModel", "GPU_GEMM_EFF_MAX", "GPU_GEMM_RAMP_S", "GPU_MEM_EFF", "GPU_LAUNCH_S", "GPU_TILE"]

# Large bf16/fp16 GEMMs through cuBLAS reach ~80% of the dense tensor-core peak: ~250 TFLOP/s of 312 on
# A100 (Anthony et al. 2024, "The Case for Co-Designing Model Architectures with Hardware", GEMM sweeps)
# and ~700–790 TFLOP/s of 989 on H100/H200 SXM (NVIDIA Transformer Engine / cuBLASLt benchmarks).
GPU_GEMM_EFF_MAX = 0.80
# Ramp (fill + drain) per GEMM: with 5 µs a 1024³ bf16 GEMM on A100 reaches ~50% of peak and 8192³
# ~79%, the shape of the curves in Anthony et al. 2024 (Fig. "GEMM throughput vs. size").
GPU_GEMM_RAMP_S = 5e-6
# Memory-bound kernels stream at ~85% of HBM bandwidth (BabelStream on A100/H100: Deakin et al.,
# "Evaluating attainable memory bandwidth of parallel programming models via BabelStream", 2018, and
# later published A100 runs at ~1.3–1.4 TB/s of 1.555).
GPU_MEM_EFF = 0.85
# Host-side launch floor of one eager PyTorch op on CUDA (dispatch + cudaLaunchKernel), ~4–10 µs;
# profiles replace it with launch_overhead_s measured on the machine.
GPU_LAUNCH_S = 5e-6
# Tensor-core GEMM tiles: M and N are padded to multiples of 128 (NVIDIA Deep Learning Performance
# Guide, "Matrix Multiplication Background": tile and wave quantization).
GPU_TILE = 128
# Without a profile, a CPU is assumed to reach these fractions (this repo's measurements on the dev VM:
# `autopar profile --quick` reached ~90% of the best GEMM rate for 2048³ and a ~20 µs eager op floor).
CPU_GEMM_EFF_MAX = 0.9
CPU_GEMM_RAMP_S = 20e-6
CPU_LAUNCH_S = 10e-6


def _monotone_interp(xs: list[float], ts: list[float], x: float, tail_rate: float) -> float:
    """Time at x from (x, time) rows: log-log interpolation, made non-decreasing; below the range the
    smallest time (a floor); above it the last time plus (x − x_max) / tail_rate."""
    order = np.argsort(xs)
    xa = np.asarray(xs, dtype=float)[order]
    ta = np.maximum.accumulate(np.asarray(ts, dtype=float)[order])
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
        self.eff_max = GPU_GEMM_EFF_MAX if gpu else CPU_GEMM_EFF_MAX
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

    def _compute_s(self, flops: float, dtype: str, layout: str | None = None) -> float:
        if flops <= 0:
            return 0.0
        samples = self.profile.gemm_samples(dtype, layout) if self.profile else []
        if samples:
            best = max(s.flops_per_s for s in samples)
            return _monotone_interp([s.flops for s in samples], [s.time_s for s in samples], flops, best)
        return flops / (self.device.peak_flops_for(dtype) * self.efficiency(flops, dtype))

    def _memory_s(self, bytes_moved: float, dtype: str, kind: str = "elementwise") -> float:
        if bytes_moved <= 0:
            return 0.0
        rows = list(self.profile.elementwise) if self.profile else []
        rows = [r for r in rows if r.dtype == dtype] or rows
        table_op = {"reduction": "sum", "transcendental": "exp"}.get(kind, "add")
        rows = [r for r in rows if r.op == table_op] or rows
        if rows:
            best = max(r.bytes_per_s for r in rows)
            return _monotone_interp([r.n_bytes for r in rows], [r.time_s for r in rows], bytes_moved, best)
        return bytes_moved / (self.device.memory_bandwidth_Bps * self.mem_eff)

    def _measured_tables(self, dtype: str) -> bool:
        return self.profile is not None and bool(self.profile.gemm_samples(dtype)) and bool(self.profile.elementwise)

    # ---- public API ----
    def op_time_s(self, flops: float, bytes_moved: float, dtype: str = "bfloat16", key: str | None = None,
                  kind: str = "elementwise") -> float:
        """Seconds for an op or a layer doing `flops` and moving `bytes_moved` (read + written).

        `key` names a measured entry in profile.layer_times (e.g. layer_key(sig, "fwd", 2, 1)), used as is.
        `kind` ("elementwise" | "reduction" | "transcendental") picks which measured memory table prices the
        bytes: a CPU spends more per byte on exp/softmax/GELU than on an add.
        """
        if flops < 0 or bytes_moved < 0:
            raise ValueError(f"op_time_s: flops={flops} and bytes_moved={bytes_moved} must be non-negative")
        if key is not None and self.profile is not None and key in self.profile.layer_times:
            return self.profile.layer_times[key]
        if flops == 0 and bytes_moved == 0:
            return 0.0
        roof = max(self._compute_s(flops, dtype), self._memory_s(bytes_moved, dtype, kind))
        if self._measured_tables(dtype):  # measured times already include the launch floor
            return max(roof, self.launch_s)
        return roof + self.launch_s

    def gemm_time_s(self, m: int, n: int, k: int, dtype: str = "bfloat16", layout: str = "nn") -> float:
        """Seconds for (m×k)·(k×n): an exact measured shape and layout if profiled, else the roofline on
        the tile-padded FLOPs and the bytes of both operands and the result (measured tables of the same
        operand layout when the profile has them)."""
        if min(m, n, k) <= 0:
            raise ValueError(f"gemm_time_s: m={m}, n={n}, k={k} must be positive")
        if self.profile is not None:
            for s in self.profile.gemm_samples(dtype, layout):
                if (s.m, s.n, s.k, s.layout) == (m, n, k, layout):
                    return s.time_s
        pad_m = math.ceil(m / self.tile) * self.tile
        pad_n = math.ceil(n / self.tile) * self.tile
        flops = 2.0 * pad_m * pad_n * k
        bytes_moved = _dtype_bytes(dtype) * (m * k + k * n + m * n)
        roof = max(self._compute_s(flops, dtype, layout), self._memory_s(bytes_moved, dtype))
        return max(roof, self.launch_s) if self._measured_tables(dtype) else roof + self.launch_s


def _dtype_bytes(dtype: str) -> int:
    sizes = {"float32": 4, "fp32": 4, "tf32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "fp8": 1,
             "float64": 8}
    if dtype not in sizes:
        raise KeyError(f"unknown dtype {dtype!r}; expected one of {sorted(sizes)}")
    return sizes[dtype]
