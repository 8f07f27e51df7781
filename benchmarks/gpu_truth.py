"""What one GPU sustains, measured beside what the cost model prices (issue 21's hardware questions).

    python benchmarks/gpu_truth.py [--sustain-s 150] [--out gpu_truth.json]

Needs a CUDA GPU in the catalog (an H100 here). Three measurements, each printed next to the model's figure:

1. **Burst GEMMs of real layer shapes**: every forward, input-gradient and weight-gradient GEMM of a Llama-3
   8B layer (TP1), a Llama-3 70B layer (TP8) and a GPT-3 175B layer (TP8), bf16, CUDA-event median of 50 runs
   after warm-up, against `ComputeModel.gemm_time_s` with the sustained fraction set to 1 (the burst rate the
   MAMF table describes).
2. **Sustained**: the same GEMMs round-robin, back to back, for `--sustain-s` seconds, the rate of each
   window with the SM clock, power and temperature NVML reads: how much of the burst rate the card keeps once
   it is hot and at its power limit. The model's fitted `sustained_fraction` is set beside it.
3. **Compute beside communication**: a GEMM while a copy kernel of NCCL's footprint (NCCL_COLLECTIVE_CTAS
   thread blocks streaming HBM, as a ring all-gather's channels do) runs on another stream, and while a
   full-device copy runs: the GEMM's slowdown against `fleet.overlap_interference`. One GPU cannot run a
   real NCCL all-gather between ranks (NCCL refuses two ranks on one device); the copy kernel reproduces the
   collective's use of SMs and HBM, not its NVLink traffic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models import catalog  # noqa: E402
from cost_models.compute import ComputeModel, gemm_eff_max, sustained_fraction  # noqa: E402
from cost_models.fleet import NCCL_COLLECTIVE_CTAS, overlap_interference  # noqa: E402

# (name, tokens, in_features, out_features): the linear layers of one transformer layer at 8,192 tokens per
# micro-batch (Llama 3: sequence 8,192 × 1; GPT-3: 2,048 × 4), TP shards as Megatron splits them.
LAYERS = (
    ("llama3-8b qkv", 8192, 4096, 6144), ("llama3-8b o", 8192, 4096, 4096),
    ("llama3-8b gate_up", 8192, 4096, 28672), ("llama3-8b down", 8192, 14336, 4096),
    ("llama3-70b/tp8 qkv", 8192, 8192, 1280), ("llama3-70b/tp8 o", 8192, 1024, 8192),
    ("llama3-70b/tp8 gate_up", 8192, 8192, 7168), ("llama3-70b/tp8 down", 8192, 3584, 8192),
    ("gpt3-175b/tp8 qkv", 8192, 12288, 4608), ("gpt3-175b/tp8 proj", 8192, 1536, 12288),
    ("gpt3-175b/tp8 fc1", 8192, 12288, 6144), ("gpt3-175b/tp8 fc2", 8192, 6144, 12288),
)


@dataclasses.dataclass(frozen=True)
class Gemm:
    name: str
    m: int
    n: int
    k: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


def layer_gemms() -> list[Gemm]:
    """Forward (T×in·in×out), input gradient (T×out·out×in) and weight gradient (in×T·T×out) of each layer."""
    out = []
    for name, t, fin, fout in LAYERS:
        out += [Gemm(f"{name} fwd", t, fout, fin), Gemm(f"{name} dgrad", t, fin, fout),
                Gemm(f"{name} wgrad", fin, fout, t)]
    return out


def operands(g: Gemm, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(g.m, g.k, device=dev, dtype=torch.bfloat16),
            torch.randn(g.k, g.n, device=dev, dtype=torch.bfloat16))


def median_ms(fn, reps: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


class Nvml:
    """SM clock (MHz), power (W) and temperature (°C) of GPU 0, or nothing where NVML is missing."""

    def __init__(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001 - NVML is optional: the rates are measured without it
            self.nv = None

    def read(self) -> dict[str, float]:
        if self.nv is None:
            return {}
        nv, h = self.nv, self.h
        return {"sm_clock_MHz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                "power_W": nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                "temp_C": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                "power_limit_W": nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3,
                "max_sm_clock_MHz": nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)}


def burst(gemms: list[Gemm], burst_model: ComputeModel, dev: torch.device) -> list[dict]:
    rows = []
    for g in gemms:
        a, b = operands(g, dev)
        ms = median_ms(lambda a=a, b=b: torch.mm(a, b))
        rows.append({"gemm": g.name, "m": g.m, "n": g.n, "k": g.k, "measured_ms": ms,
                     "tflops": g.flops / ms / 1e9, "model_burst_ms": burst_model.gemm_time_s(g.m, g.n, g.k) * 1e3})
    return rows


def sustain(gemms: list[Gemm], seconds: float, dev: torch.device, nvml: Nvml, window_s: float = 5.0) -> list[dict]:
    """Round-robin passes over every GEMM for `seconds`; one row per window of about `window_s`."""
    ops = [(g, *operands(g, dev)) for g in gemms]
    pass_flops = sum(g.flops for g, _, _ in ops)
    windows, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        passes, w0 = 0, time.perf_counter()
        start.record()
        while time.perf_counter() - w0 < window_s:
            for _, a, b in ops:
                torch.mm(a, b)
            passes += 1
            if passes % 4 == 0:
                torch.cuda.synchronize()  # keep the host within a few passes of the device
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        windows.append({"t_s": round(time.perf_counter() - t0, 1), "tflops": passes * pass_flops / ms / 1e9,
                        **nvml.read()})
        print(f"  sustained t={windows[-1]['t_s']:6.1f} s  {windows[-1]['tflops']:6.1f} TFLOP/s  "
              + "  ".join(f"{k} {v:.0f}" for k, v in nvml.read().items()), flush=True)
    return windows


def stream_copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, iters, BLOCK: tl.constexpr):
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        for _ in range(iters):
            for start in range(pid * BLOCK, n, nprog * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
    return copy


def beside(g: Gemm, dev: torch.device) -> dict:
    """The GEMM alone, beside a copy of NCCL's footprint on another stream, beside a full-device copy."""
    a, b = operands(g, dev)
    alone = median_ms(lambda: torch.mm(a, b), reps=30)
    n = 256 * 2**20  # 512 MiB bf16 source and destination: far larger than L2
    src, dst = torch.randn(n, device=dev, dtype=torch.bfloat16), torch.empty(n, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    out = {"gemm": g.name, "alone_ms": alone}
    variants = {"full_copy": lambda: dst.copy_(src)}
    try:
        kernel = stream_copy_kernel()
        variants["nccl_ctas_copy"] = lambda: kernel[(NCCL_COLLECTIVE_CTAS,)](src, dst, n, 1, BLOCK=4096)
    except Exception as e:  # noqa: BLE001 - Triton missing: the full-device copy still answers
        out["nccl_ctas_copy_error"] = repr(e)
    for name, launch in variants.items():
        launch()
        torch.cuda.synchronize()
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0.record()
        launch()
        c1.record()
        torch.cuda.synchronize()
        copy_ms = c0.elapsed_time(c1)
        reps = max(3, int(8 * copy_ms / alone * 0.8))  # the GEMMs all run while the 8 copies do
        with torch.cuda.stream(side):
            for _ in range(8):
                launch()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends, strict=True):
            s.record()
            torch.mm(a, b)
            e.record()
        torch.cuda.synchronize()
        with_ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
        out[name] = {"copy_alone_ms": copy_ms, "copy_GBps": 4 * n / copy_ms / 1e6, "gemm_beside_ms": with_ms,
                     "gemm_slowdown": with_ms / alone}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sustain-s", type=float, default=150.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_truth: no CUDA GPU here; this benchmark measures one")
        return 2
    dev = torch.device("cuda")
    name, mem = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
    cat = catalog.match_device(name, mem)
    if cat is None:
        print(f"gpu_truth: {name!r} is not in the catalog")
        return 2
    spec = catalog.device(cat)
    burst_model = ComputeModel(dataclasses.replace(spec, sustained_fraction=1.0))
    nvml = Nvml()
    print(f"{name} (catalog {cat}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs), torch "
          f"{torch.__version__}; NVML {nvml.read()}")
    gemms = layer_gemms()
    rows = burst(gemms, burst_model, dev)
    print(f"\n{'GEMM':34} {'m':>6} {'n':>6} {'k':>6} {'ms':>7} {'TFLOP/s':>8} {'model ms':>9} {'meas/model':>10}")
    for r in rows:
        print(f"{r['gemm']:34} {r['m']:6} {r['n']:6} {r['k']:6} {r['measured_ms']:7.3f} {r['tflops']:8.1f} "
              f"{r['model_burst_ms']:9.3f} {r['measured_ms'] / r['model_burst_ms']:10.3f}")
    total_meas = sum(r["measured_ms"] for r in rows)
    total_model = sum(r["model_burst_ms"] for r in rows)
    flops = sum(g.flops for g in gemms)
    burst_tflops = flops / total_meas / 1e9
    peak = spec.peak_flops_for("bfloat16") / 1e12
    print(f"all layer GEMMs: measured {burst_tflops:.1f} TFLOP/s ({burst_tflops / peak:.1%} of {peak:.0f}); "
          f"model burst {flops / total_model / 1e9:.1f} (MAMF fraction {gemm_eff_max(spec):.3f}); "
          f"measured/model time {total_meas / total_model:.3f}")

    print(f"\nsustained, {args.sustain_s:.0f} s of back-to-back layer GEMMs:")
    windows = sustain(gemms, args.sustain_s, dev, nvml)
    first, last = windows[0]["tflops"], statistics.median(w["tflops"] for w in windows[len(windows) // 2:])
    fitted = sustained_fraction(spec)
    print(f"first window {first:.1f} TFLOP/s, median of the second half {last:.1f} ({last / burst_tflops:.3f} of "
          f"the burst rate; the model's fitted sustained_fraction is {fitted:.3f})")

    print("\nGEMM beside communication-shaped copies on another stream:")
    besides = [beside(g, dev) for g in (Gemm("8192^3", 8192, 8192, 8192), gemms[2])]
    for b in besides:
        for k in ("nccl_ctas_copy", "full_copy"):
            if k in b:
                v = b[k]
                print(f"  {b['gemm']:30} beside {k:15}: {b['alone_ms']:.3f} -> {v['gemm_beside_ms']:.3f} ms "
                      f"(x{v['gemm_slowdown']:.3f}); the copy alone {v['copy_GBps']:.0f} GB/s")
    f = overlap_interference(spec)
    print(f"  model: compute beside a collective runs at 1 - {NCCL_COLLECTIVE_CTAS}/SMs = {1 - f:.3f} of its "
          f"speed (x{1 / (1 - f):.3f} time)")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": name, "catalog": cat, "torch": torch.__version__,
                                              "burst": rows, "burst_tflops": burst_tflops, "sustained": windows,
                                              "fitted_sustained_fraction": fitted, "beside": besides,
                                              "model_interference": f}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
