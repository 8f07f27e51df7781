"""How much slower kernels run when n training processes run them at once: `Profile.process_slowdown`.

The kernel tables are timed in one process. A CPU training job runs n processes, each with torchrun's
one thread (OMP_NUM_THREADS=1), sharing the cores, the last-level cache, the memory bus and whatever
else the machine is running. Dividing the cores among processes (autopar.cluster.cpu_slowdown) misses
all but the first; calibration used to find the rest afterwards (kernels ×2.2 on this 2-vCPU VM,
README). Here it is measured up front: the same work — the model's layers, forward and backward, when
the profile has them (profiler.layers.training_step), else a kernel mix of a GEMM and cold elementwise
adds, the two kinds a training step spends its time in — is timed where the tables were taken
(`reference_s`, in the profiling process with its clock), then in n processes at once, each with the
training processes' thread count, by the wall clock a training step is measured with.
process_slowdown[n] is the mean over the n processes of their time per call, divided by the reference.
"""

from __future__ import annotations

import collections
import os
import statistics
import time
from collections.abc import Callable

import torch

from cost_models.profiler.timing import synchronize, time_callable

__all__ = ["training_threads", "kernel_mix", "reference_s", "concurrent_mix_s", "MIX_GEMM", "MIX_ADD_BYTES"]

# A transformer-sized GEMM (512 tokens × 512 × 512) and an add of 1 MiB operands rotating through a
# 16 MiB pool (cold, as in kernels.COLD_POOL_BYTES): about 5 ms and 0.3 ms on one core here.
MIX_GEMM = (512, 512, 512)
MIX_ADD_BYTES = 2**20
_POOL_BYTES = 16 * 2**20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def training_threads(nproc: int) -> int:
    """Torch threads of one of `nproc` training processes: OMP_NUM_THREADS when set, else torchrun's
    default (it sets OMP_NUM_THREADS=1 when nproc > 1), else every core."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return 1 if nproc > 1 else (os.cpu_count() or 1)


def kernel_mix(device: torch.device, dtype: str) -> Callable[[], None]:
    """One call: the GEMM then four adds, each add on the next operands of the cold pool."""
    dt = _DTYPES[dtype]
    m, n, k = MIX_GEMM
    a, b = torch.randn(m, k, device=device, dtype=dt), torch.randn(k, n, device=device, dtype=dt)
    elems = MIX_ADD_BYTES // a.element_size()
    pool = torch.randn(_POOL_BYTES // a.element_size(), device=device, dtype=dt)
    slots = pool.numel() // (2 * elems)
    alive: collections.deque[torch.Tensor] = collections.deque(maxlen=4)
    state = {"i": 0}

    def call() -> None:
        torch.mm(a, b)
        for _ in range(4):
            o = (state["i"] % slots) * 2 * elems
            alive.append(torch.add(pool[o:o + elems], pool[o + elems:o + 2 * elems]))
            state["i"] += 1
    return call


def reference_s(device: torch.device, dtype: str, clock: str, budget_s: float | None = None) -> float:
    """Seconds per mix in this process, timed as the kernel tables are (same threads, same clock)."""
    return time_callable(kernel_mix(device, dtype), device, trials=5, trial_s=0.05, clock=clock,
                         budget_s=budget_s)


def concurrent_mix_s(mix: Callable[[], None], device: torch.device, *, window_s: float, trials: int) -> float:
    """Median wall seconds per mix over `trials` windows of window_s each, calling the mix for the whole
    window: every process of the group starts together (after a barrier) and stays busy for the same wall
    time, so they contend throughout (a fixed number of calls would let the first to finish run alone)."""
    mix()
    synchronize(device)
    times = []
    for _ in range(trials):
        calls, t0 = 0, time.perf_counter()
        while (now := time.perf_counter()) - t0 < window_s:
            mix()
            synchronize(device)
            calls += 1
        times.append((now - t0) / max(1, calls))
    return statistics.median(times)
