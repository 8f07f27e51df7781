"""GEMM, elementwise and launch-floor sweeps on the local device.

GEMM shapes cover squares from latency-bound to compute-bound plus the skinny shapes of transformer
layers (tokens × hidden × 4·hidden), so the compute model can interpolate throughput in work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cost_models.profile import ElementwiseSample, GemmSample
from cost_models.profiler.timing import time_callable

__all__ = ["gemm_shapes", "elementwise_sizes", "measure_gemm", "measure_elementwise", "measure_launch_s"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _operands(m: int, n: int, k: int, layout: str, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(k, m, device=device, dtype=dtype).t() if layout[0] == "t" else \
        torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype).t() if layout[1] == "t" else \
        torch.randn(k, n, device=device, dtype=dtype)
    return a, b


def gemm_shapes(quick: bool) -> list[tuple[int, int, int]]:
    squares = [64, 128, 256, 512, 1024, 2048] if quick else [64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072]
    skinny = [(1024, 768, 768), (1024, 3072, 768), (1024, 768, 3072), (4096, 1024, 256), (256, 4096, 1024)]
    if not quick:
        skinny += [(2048, 2048, 512), (512, 2048, 2048), (8192, 1024, 1024), (2048, 8192, 2048)]
    return [(s, s, s) for s in squares] + skinny


def elementwise_sizes(quick: bool) -> list[int]:
    """Bytes of one operand: 16 KiB (cache-resident) to 64 MiB (DRAM-bound)."""
    step = 4 if quick else 2
    return [2**e for e in range(14, 27, step)]


def measure_gemm(device: torch.device, dtypes: list[str], quick: bool,
                 progress: Callable[[str], None], clock: str = "wall") -> list[GemmSample]:
    out = []
    trials = 3 if quick else 5
    for dtype in dtypes:
        for layout in ("nn", "nt", "tn"):
            for m, n, k in gemm_shapes(quick):
                a, b = _operands(m, n, k, layout, _DTYPES[dtype], device)
                t = time_callable(lambda a=a, b=b: torch.mm(a, b), device, trials=trials, clock=clock)
                sample = GemmSample(m=m, n=n, k=k, dtype=dtype, time_s=t, layout=layout)
                progress(f"gemm {m}x{n}x{k} {layout} {dtype}: {t * 1e3:.3f} ms, "
                         f"{sample.flops_per_s / 1e9:.1f} GFLOP/s")
                out.append(sample)
    return out


def measure_elementwise(device: torch.device, dtype: str, quick: bool,
                        progress: Callable[[str], None], clock: str = "wall") -> list[ElementwiseSample]:
    """c = a + b into a fresh tensor, as model ops run (the allocation and first touch of the output are
    part of the cost on CPU): reads 2 operands, writes 1, so traffic = 3 × operand bytes."""
    out = []
    elem = torch.empty((), dtype=_DTYPES[dtype]).element_size()
    for n_bytes in elementwise_sizes(quick):
        a = torch.randn(n_bytes // elem, device=device, dtype=_DTYPES[dtype])
        b = torch.randn_like(a)
        t = time_callable(lambda a=a, b=b: torch.add(a, b), device, trials=3 if quick else 5, clock=clock)
        sample = ElementwiseSample(op="add", dtype=dtype, n_bytes=3 * n_bytes, time_s=t)
        progress(f"elementwise add {n_bytes / 2**20:.2f} MiB {dtype}: {sample.bytes_per_s / 1e9:.2f} GB/s")
        out.append(sample)
        # a transcendental (softmax, GELU, norms): exp reads the operand and writes as much
        t = time_callable(lambda a=a: torch.exp(a), device, trials=3 if quick else 5, clock=clock)
        sample = ElementwiseSample(op="exp", dtype=dtype, n_bytes=2 * n_bytes, time_s=t)
        progress(f"elementwise exp {n_bytes / 2**20:.2f} MiB {dtype}: {sample.bytes_per_s / 1e9:.2f} GB/s")
        out.append(sample)
        # a reduction over rows (a bias gradient): reads the operand, writes 1/256 of it
        rows = a.view(-1, 256)
        t = time_callable(lambda rows=rows: rows.sum(dim=0), device, trials=3 if quick else 5, clock=clock)
        sample = ElementwiseSample(op="sum", dtype=dtype, n_bytes=n_bytes + 256 * elem, time_s=t)
        progress(f"reduction sum {n_bytes / 2**20:.2f} MiB {dtype}: {sample.bytes_per_s / 1e9:.2f} GB/s")
        out.append(sample)
    return out


def measure_launch_s(device: torch.device, clock: str = "wall") -> float:
    """The floor of one eager op: an add of two 1-element tensors."""
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    return time_callable(lambda: torch.add(a, b), device, trial_s=0.02, trials=5, clock=clock)
