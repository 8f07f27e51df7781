"""GEMM, elementwise and launch-floor sweeps on the local device.

GEMM shapes cover squares from latency-bound to compute-bound plus the skinny shapes of transformer
layers (tokens × hidden × 4·hidden), so the compute model can interpolate throughput in work; batched
matmuls at attention's per-head shapes get their own table. Elementwise kernels are timed on cold
operands into fresh outputs, the way they run inside a layer.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cost_models.profile import ElementwiseSample, GemmSample
from cost_models.profiler.budget import SizeSweep
from cost_models.profiler.timing import time_callable

__all__ = ["gemm_shapes", "elementwise_sizes", "attention_shapes", "measure_gemm", "measure_elementwise",
           "measure_attention_matmuls", "measure_launch_s"]

ATTENTION_BATCH = 8  # heads per timed bmm: enough to amortise the call, few enough to stay quick

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
    # transformer GEMMs (tokens × hidden × 4·hidden) at 1024 and 4096 tokens: at 4096 the m×n output
    # no longer stays in cache across k-blocks and the rate drops (~12% here, fp32), which no square shows
    skinny = [(1024, 768, 768), (1024, 3072, 768), (1024, 768, 3072), (4096, 3072, 768), (4096, 1024, 256),
              (256, 4096, 1024)]
    if not quick:
        skinny += [(2048, 2048, 512), (512, 2048, 2048), (8192, 1024, 1024), (2048, 8192, 2048)]
    return [(s, s, s) for s in squares] + skinny


def elementwise_sizes(quick: bool) -> list[int]:
    """Bytes of one operand: 16 KiB (cache-resident) to 64 MiB (DRAM-bound), ×4 (quick) or ×2 apart, plus
    24 MiB: glibc serves blocks above its mmap ceiling (32 MiB on 64-bit, mallopt(3) M_MMAP_THRESHOLD) with
    fresh, page-faulting mappings on every allocation, so the table brackets that step on both sides."""
    step = 2 if quick else 1
    return sorted([2**e for e in range(14, 27, step)] + [3 * 2**23])


def attention_shapes(quick: bool) -> list[tuple[int, int, int, str]]:
    """Per-head (m, n, k, layout) of eager attention's batched matmuls at sequence s, head dim d: scores
    QKᵀ and dP = dO·Vᵀ are (s, s, d); P·V and dQ = dS·K are (s, d, s); dKᵀ, dVᵀ-style products are
    (d, s, s). Which operand arrives transposed depends on the model's reshapes, so all three layouts."""
    seqs = (128, 256, 1024) if quick else (128, 256, 512, 1024, 2048)
    return [(*shape, layout) for s in seqs for d in (64, 128) for shape in ((s, s, d), (s, d, s), (d, s, s))
            for layout in ("nn", "nt", "tn")]


Progress = Callable[[str, float], None]  # (message, expected seconds left in this sweep)


def _flops(m: int, n: int, k: int, batch: int = 1) -> float:
    return 2.0 * batch * m * n * k


def measure_gemm(device: torch.device, dtypes: list[str], quick: bool, progress: Progress, clock: str = "wall",
                 budget_s: float = math.inf) -> list[GemmSample]:
    """torch.mm at `gemm_shapes`, per dtype and layout in increasing FLOPs, within budget_s: a range that
    would overrun its share stops and is extrapolated from its fitted curve (budget.SizeSweep)."""
    out = []
    trials = 3 if quick else 5
    shapes = sorted(gemm_shapes(quick), key=lambda s: _flops(*s))
    cases = [(dtype, layout, shape) for dtype in dtypes for layout in ("nn", "nt", "tn") for shape in shapes]
    sweep = SizeSweep(budget_s, [((d, lay), _flops(*sh)) for d, lay, sh in cases])
    for dtype, layout, (m, n, k) in cases:
        work = _flops(m, n, k)
        share = sweep.share_s((dtype, layout), work, fallback=dtype)
        if share is None:
            t = sweep.predict_s((dtype, layout), work, fallback=dtype)
            if t is not None:
                out.append(GemmSample(m=m, n=n, k=k, dtype=dtype, time_s=t, layout=layout, extrapolated=True))
            continue
        a, b = _operands(m, n, k, layout, _DTYPES[dtype], device)
        t = time_callable(lambda a=a, b=b: torch.mm(a, b), device, trials=trials, clock=clock, budget_s=share)
        sweep.done(work, t, (dtype, layout), dtype)
        sample = GemmSample(m=m, n=n, k=k, dtype=dtype, time_s=t, layout=layout)
        progress(f"gemm {m}x{n}x{k} {layout} {dtype}: {t * 1e3:.3f} ms, {sample.flops_per_s / 1e9:.1f} GFLOP/s",
                 sweep.expected_left_s(trials))
        out.append(sample)
    _report_stops(sweep, "gemm", progress)
    return out


def _report_stops(sweep: SizeSweep, what: str, progress: Progress) -> None:
    for group in sorted(sweep.stopped, key=str):
        progress(f"{what} {group}: larger sizes over the time budget, extrapolated from the fitted curve",
                 sweep.expected_left_s())


# A block's elementwise kernels read tensors written several kernels earlier and write fresh ones, so the
# table is taken that way, not on a hot, reused buffer: operands are views rotating through a pool this
# large (well above a CPU core's L2 of 1-4 MiB and an A100's 40 MiB L2) and each output is kept alive for
# OUTPUTS_ALIVE further calls, so the allocator cannot hand the same already-faulted, cached block back.
# On this VM that halves the measured rate of a 3 MiB add (28 → 15 GB/s), the rate it runs at inside a
# GPT block (benchmarks/cost_model_accuracy.py, "elementwise in place" note).
COLD_POOL_BYTES = 128 * 2**20
OUTPUTS_ALIVE = 4


def _time_rotating(fn: Callable[[Any], torch.Tensor], operands: Sequence[Any], device: torch.device,
                   trials: int, clock: str, budget_s: float | None = None) -> float:
    """Median seconds per call of fn over the operand pool, outputs kept alive OUTPUTS_ALIVE calls."""
    alive: collections.deque[torch.Tensor] = collections.deque(maxlen=OUTPUTS_ALIVE)
    state = {"i": 0}

    def call() -> None:
        alive.append(fn(operands[state["i"] % len(operands)]))
        state["i"] += 1

    return time_callable(call, device, trials=trials, trial_s=0.05, clock=clock, budget_s=budget_s)


def measure_elementwise(device: torch.device, dtype: str, quick: bool, progress: Progress, clock: str = "wall",
                        budget_s: float = math.inf) -> list[ElementwiseSample]:
    """Four memory-bound kernel classes, each out of place into a fresh tensor on cold operands (see
    COLD_POOL_BYTES); n_bytes counts every byte read and written:
      add             c = a + b (residuals, biases, scaling): 3 × operand bytes
      exp             a transcendental (softmax, GELU, norms): 2 ×
      sum             a reduction over rows (bias gradients, norm statistics): 1 × plus the small result
      transpose_copy  a head transpose made contiguous (.transpose(1, 2).contiguous()): 2 ×
    Sizes in increasing order within budget_s, each op a range of its own (budget.SizeSweep)."""
    out = []
    torch_dtype = _DTYPES[dtype]
    elem = torch.empty((), dtype=torch_dtype).element_size()
    sizes = elementwise_sizes(quick)
    pool = torch.randn(max(COLD_POOL_BYTES, 2 * max(sizes)) // elem, device=device, dtype=torch_dtype)
    trials = 5 if quick else 9  # cheap, and the noisiest table on a shared machine
    ops = {"add": 3, "exp": 2, "sum": 1, "transpose_copy": 2}  # traffic per operand byte
    sweep = SizeSweep(budget_s, [(op, float(n_bytes)) for n_bytes in sizes for op in ops])
    for n_bytes in sizes:
        n = n_bytes // elem
        # operand pairs (a, b) side by side, walking through the pool
        pairs = [pool[o:o + 2 * n] for o in range(0, max(1, pool.numel() - 2 * n + 1), 2 * n)]
        cases = {
            "add": lambda ab, n=n: torch.add(ab[:n], ab[n:]),
            "exp": lambda ab, n=n: torch.exp(ab[:n]),
            "sum": lambda ab, n=n: ab[:n].view(-1, 256).sum(dim=0),
            "transpose_copy": lambda ab, n=n: ab[:n].view(-1, 8, 64).transpose(0, 1).contiguous(),
        }
        for op, fn in cases.items():
            traffic = ops[op] * n_bytes + (256 * elem if op == "sum" else 0)
            share = sweep.share_s(op, n_bytes)
            if share is None:
                t = sweep.predict_s(op, n_bytes)
                if t is not None:
                    out.append(ElementwiseSample(op=op, dtype=dtype, n_bytes=traffic, time_s=t,
                                                 tensor_bytes=n_bytes, extrapolated=True))
                continue
            t = _time_rotating(fn, pairs, device, trials, clock, share)
            sweep.done(n_bytes, t, op)
            sample = ElementwiseSample(op=op, dtype=dtype, n_bytes=traffic, time_s=t, tensor_bytes=n_bytes)
            progress(f"{op} {n_bytes / 2**20:.2f} MiB {dtype} (cold, fresh output): "
                     f"{sample.bytes_per_s / 1e9:.2f} GB/s", sweep.expected_left_s(trials, 0.05))
            out.append(sample)
    _report_stops(sweep, f"elementwise {dtype}", progress)
    return out


def _carve(pool: torch.Tensor, offset: int, batch: int, rows: int, cols: int, transposed: bool) -> torch.Tensor:
    """A (batch, rows, cols) view of pool at offset, stored column-major per matrix when transposed."""
    shape = (batch, cols, rows) if transposed else (batch, rows, cols)
    view = pool[offset:offset + batch * rows * cols].view(shape)
    return view.transpose(-1, -2) if transposed else view


def measure_attention_matmuls(device: torch.device, dtypes: list[str], quick: bool, progress: Progress,
                              clock: str = "wall", budget_s: float = math.inf) -> list[GemmSample]:
    """torch.bmm over ATTENTION_BATCH heads at the per-head shapes of `attention_shapes`, on operands
    rotating through a cold pool into fresh outputs, as attention runs inside a layer (see
    COLD_POOL_BYTES). Small-k and small-n products reach a lower rate than a square GEMM of the same
    FLOPs, so attention gets its own table (GemmSample.batch > 1). Per dtype and layout in increasing
    FLOPs within budget_s, as `measure_gemm`."""
    out = []
    trials = 3 if quick else 5
    shapes = sorted(attention_shapes(quick), key=lambda s: (s[3], _flops(*s[:3])))
    cases = [(dtype, shape) for dtype in dtypes for shape in shapes]
    sweep = SizeSweep(budget_s, [((d, sh[3]), _flops(*sh[:3])) for d, sh in cases])
    pools: dict[str, torch.Tensor] = {}
    for dtype, (m, n, k, layout) in cases:
        work = _flops(m, n, k)
        share = sweep.share_s((dtype, layout), work, fallback=dtype)
        if share is None:
            t = sweep.predict_s((dtype, layout), work, fallback=dtype)
            if t is not None:
                out.append(GemmSample(m=m, n=n, k=k, dtype=dtype, time_s=t, layout=layout, batch=ATTENTION_BATCH,
                                      extrapolated=True))
            continue
        torch_dtype = _DTYPES[dtype]
        if dtype not in pools:
            pools = {dtype: torch.randn(COLD_POOL_BYTES // torch.empty((), dtype=torch_dtype).element_size(),
                                        device=device, dtype=torch_dtype)}
        pool = pools[dtype]
        size_a, size_b = ATTENTION_BATCH * m * k, ATTENTION_BATCH * k * n
        pairs = [(_carve(pool, o, ATTENTION_BATCH, m, k, layout[0] == "t"),
                  _carve(pool, o + size_a, ATTENTION_BATCH, k, n, layout[1] == "t"))
                 for o in range(0, pool.numel() - size_a - size_b + 1, size_a + size_b)]
        t = _time_rotating(lambda ab: torch.bmm(*ab), pairs, device, trials, clock, share)
        sweep.done(work, t, (dtype, layout), dtype)
        sample = GemmSample(m=m, n=n, k=k, dtype=dtype, time_s=t, layout=layout, batch=ATTENTION_BATCH)
        progress(f"bmm {ATTENTION_BATCH}x{m}x{n}x{k} {layout} {dtype} (cold): {t * 1e3:.3f} ms, "
                 f"{sample.flops_per_s / 1e9:.1f} GFLOP/s", sweep.expected_left_s(trials, 0.05))
        out.append(sample)
    _report_stops(sweep, "bmm", progress)
    return out


def measure_launch_s(device: torch.device, clock: str = "wall") -> float:
    """The floor of one eager op: an add of two 1-element tensors."""
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    return time_callable(lambda: torch.add(a, b), device, trial_s=0.02, trials=5, clock=clock)
