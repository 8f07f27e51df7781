"""What a single-device roofline misses on a fleet of GPUs training in lock step.

Stragglers. GPUs of one SKU in one cluster do not run at one speed: power management and manufacturing
variability spread them by 8% on average (max 22%) from the slowest to the fastest, with outliers up to
1.5× slower than the median (Sinha et al., "Not All GPUs Are Created Equal: Characterizing Variability in
Large-Scale, Accelerator-Rich Systems", SC'22, abstract: 18,800 GPU-hours on Summit, Vortex, Frontera,
Longhorn and Corona, hundreds to tens of thousands of GPUs each). Synchronous training waits at every
collective for its slowest rank, so a step runs at the speed of the slowest of its N GPUs. With per-GPU
speed normal with relative spread σ, the slowest of N lags the median by σ·E[max of N standard normals];
σ follows from the published 8% range taken as the expected range of a cluster of VARIATION_CLUSTER_GPUS
GPUs (the geometric mean of the smallest and largest clusters studied, Longhorn's 448 and Summit's 27,648
GPUs). The factor grows with world size: ×1.016 on 8 GPUs, ×1.036 on 1,024, ×1.044 on 16,384.

Compute beside communication. NCCL runs each channel of a collective as one CTA resident on one SM for the
whole collective ("number of CTAs (channels) used for a collective", NCCL_MIN_CTAS / NCCL_MAX_CTAS in the
NCCL user guide), so a GEMM overlapped with it gets the other SMs only: an all-gather on H100 was measured
occupying 24 CTAs of 132 SMs beside a GEMM (NVIDIA developer forum, "Compute-communication overlap causes
severe GEMM performance degradation because of tail effect", thread 337991, nsys trace; the GEMM fell from
~80% to ~47% of peak there, wave quantization adding to the lost SMs). The SM share NCCL takes is the
floor of that slowdown and what is modelled: while overlapped communication runs, compute proceeds at
1 − NCCL_COLLECTIVE_CTAS / SMs of its speed (HBM contention and wave tails, which depend on the kernel's
shape, come on top and are not priced).
"""

from __future__ import annotations

import math
from statistics import NormalDist

from cost_models.hardware import DeviceSpec

__all__ = ["GPU_VARIATION", "VARIATION_CLUSTER_GPUS", "NCCL_COLLECTIVE_CTAS", "SM_COUNT_BY_DEVICE",
           "expected_max_normal", "gpu_speed_sigma", "straggler_factor", "overlap_interference", "hidden_beside_s"]

GPU_VARIATION = 0.08  # mean slowest-to-fastest spread of one SKU's GPUs in a cluster (Sinha et al. SC'22)
VARIATION_CLUSTER_GPUS = round(math.sqrt(448 * 27_648))  # 3,519: Longhorn (448) to Summit (27,648)
NCCL_COLLECTIVE_CTAS = 24  # CTAs (channels) of an all-gather beside a GEMM on H100 (NVIDIA forum, thread 337991)
# Streaming multiprocessors per GPU, from the architecture whitepapers / datasheets (catalog names by prefix):
# V100 80, A100 108, H100 SXM 132 (the 96 GB Grand Teton part is an SXM H100), H100 PCIe 114, H200 132,
# B200 148 (two dies of 74), L40S 142.
SM_COUNT_BY_DEVICE = {"v100": 80, "a100": 108, "h100-sxm": 132, "h100-pcie": 114, "h200": 132, "b200": 148,
                      "l40s": 142}


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals], Blom's approximation Φ⁻¹((n − 0.375)/(n + 0.25)); 0 for n = 1."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive integer")
    return 0.0 if n == 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def gpu_speed_sigma() -> float:
    """Relative spread σ of GPU speed whose expected range over a cluster is GPU_VARIATION."""
    return GPU_VARIATION / (2.0 * expected_max_normal(VARIATION_CLUSTER_GPUS))


def straggler_factor(world_size: int) -> float:
    """How much longer a lock-step computation over `world_size` GPUs takes than on the median GPU."""
    return 1.0 + gpu_speed_sigma() * expected_max_normal(world_size)


def overlap_interference(device: DeviceSpec) -> float:
    """The fraction of `device`'s compute that an overlapped NCCL collective takes (0 for a device whose SM
    count is not known, and for CPUs, where gloo shares the cores and nothing is modelled as overlapped)."""
    if device.kind != "gpu":
        return 0.0
    sms = next((v for k, v in SM_COUNT_BY_DEVICE.items() if device.name.startswith(k)), 0)
    return NCCL_COLLECTIVE_CTAS / sms if sms else 0.0


def hidden_beside_s(comm_s: float, compute_s: float, interference: float) -> float:
    """Of `comm_s` of communication overlapped with `compute_s` of compute, the part that costs no time.

    While both run, compute proceeds at (1 − f) of its speed, so the pair takes max(comm, compute + f·comm)
    instead of compute + comm: what is hidden is min((1 − f)·comm, compute) (f = 0: min(comm, compute))."""
    if comm_s < 0 or compute_s < 0 or not 0.0 <= interference < 1.0:
        raise ValueError(f"comm_s={comm_s} and compute_s={compute_s} must be ≥ 0, interference={interference} "
                         "in [0, 1)")
    return min((1.0 - interference) * comm_s, compute_s)
