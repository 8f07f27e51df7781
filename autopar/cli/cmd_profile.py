"""`autopar profile [MODEL] [--nproc N] [--quick] --out profile.json`: measure this machine.

Progress goes to stderr while measuring; the summary (GEMM peak per dtype, memory traffic rate,
collective bus bandwidth per size as nccl-tests reports it, layer times) to stdout, or JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from autopar.errors import AutoparError
from autopar.profiling import profile_model
from autopar.zoo import parse_overrides
from cost_models.optimizer_step import OptimizerLaws
from cost_models.profile import Profile
from cost_models.profiler.budget import FULL_BUDGET_S, QUICK_BUDGET_S, QUICK_LAYERS_BUDGET_S


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile", help="measure this machine (kernels, collectives, a model's layers)",
        description="Measure GEMM/elementwise throughput, collectives over N local processes (gloo on CPU, "
                    "NCCL on GPU) and, given MODEL, each distinct layer's forward and backward time.")
    p.add_argument("model", nargs="?", default=None,
                   help="zoo name, path/file.py:factory or package.module:factory (optional)")
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes for collectives (default: GPU count, else CPU count, at least 2)")
    p.add_argument("--quick", action="store_true",
                   help=f"a short sweep: a {QUICK_BUDGET_S:.0f} s budget (+{QUICK_LAYERS_BUDGET_S:.0f} s to time "
                        "MODEL's layers)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help=f"seconds the measurements may take (default {QUICK_BUDGET_S:.0f} with --quick, else "
                        f"{FULL_BUDGET_S:.0f}; +{QUICK_LAYERS_BUDGET_S:.0f} with MODEL). Each sweep measures sizes in "
                        "increasing order and extrapolates the ones past its share (marked in the profile)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length of MODEL's example input")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="zoo config field, e.g. dropout=0 (repeatable; as examples/train_gpt.py takes it)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the dtype to measure kernels in and to build a zoo MODEL in (default: the local training "
                        "dtype, float32 on a CPU-only machine, else bfloat16; pass the same to `autopar plan`)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="how CPU kernels are timed: wall clock, or single-threaded CPU time ('thread': immune "
                        "to other processes on a shared machine; the CPU-training processes run one thread each)")
    p.add_argument("--no-collectives", action="store_true", help="skip the multi-process collective sweep")
    p.add_argument("--out", default="profile.json", help="where to write the profile (default: profile.json)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def summary(prof: Profile) -> dict:
    """The figures a reader wants from a profile: peaks, and bus bandwidth per collective and size."""
    colls: dict[str, list[dict]] = {}
    for c in sorted(prof.collectives, key=lambda c: (c.op, c.group_size, c.n_bytes)):
        colls.setdefault(f"{c.op} x{c.group_size}", []).append(
            {"bytes": c.n_bytes, "time_us": c.time_s * 1e6, "algbw_GBps": c.algbw_Bps / 1e9,
             "busbw_GBps": c.busbw_Bps / 1e9})
    laws = OptimizerLaws.from_profile(prof)
    return {
        "device": prof.device_name, "backend": prof.backend, "torch": prof.torch_version, "created": prof.created,
        "cpu": prof.cpu.describe() if prof.cpu is not None else None,
        "optimizer": None if laws is None else {
            "adamw_implementation": laws.implementation,
            **{f"{k}_per_tensor_us": law.per_tensor_s * 1e6 for k, law in laws.laws.items()},
            **{f"{k}_ns_per_element": {f"{size:.0f}": t * 1e9 for size, t in zip(law.sizes, law.per_param_s,
                                                                                    strict=True)}
               for k, law in laws.laws.items()}},
        "gemm_peak_GFLOPs": {d: (prof.peak_gemm_flops(d) or 0) / 1e9 for d in sorted({g.dtype for g in prof.gemm})},
        "elementwise_peak_GBps": (prof.memory_bandwidth_Bps() or 0) / 1e9,
        "launch_overhead_us": prof.launch_overhead_s * 1e6,
        "collectives": colls,
        "layer_times_ms": {k: v * 1e3 for k, v in prof.layer_times.items()},
        "process_slowdown": {str(n): f for n, f in sorted(prof.process_slowdown.items())},
        "extrapolated": {"gemm": sum(g.extrapolated for g in prof.gemm),
                         "elementwise": sum(e.extrapolated for e in prof.elementwise),
                         "collectives": sum(c.extrapolated for c in prof.collectives)},
    }


def run(args: argparse.Namespace) -> int:
    from autopar.cli.checks import check_output_path

    check_output_path(args.out, "--out")  # before minutes of measuring, not after
    t0 = time.perf_counter()
    if args.override and not args.model:
        raise AutoparError("--override sets fields of MODEL's config; name the zoo MODEL to profile, e.g. "
                           "`autopar profile gpt-tiny --override dropout=0`")
    prof = profile_model(args.model, nproc=args.nproc, quick=args.quick, seq_len=args.seq_len,
                         progress=lambda msg: print(msg, file=sys.stderr, flush=True),
                         collectives=not args.no_collectives, dtype=args.dtype, clock=args.clock,
                         budget_s=args.budget, overrides=parse_overrides(args.override))
    prof.save(args.out)
    s = summary(prof)
    s["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    print(f"profile of {s['device']} ({s['backend']}, torch {s['torch']}) written to {args.out} "
          f"in {s['elapsed_s']:.1f} s")
    for dtype, g in s["gemm_peak_GFLOPs"].items():
        print(f"  GEMM peak {dtype:<9} {g:10.1f} GFLOP/s")
    print(f"  elementwise peak   {s['elementwise_peak_GBps']:10.2f} GB/s (read + written)")
    print(f"  eager op floor     {s['launch_overhead_us']:10.1f} us")
    if s["cpu"]:
        print(f"  CPU                {s['cpu']}")
    if s["optimizer"]:
        o = s["optimizer"]
        print(f"  optimizer          AdamW ({o['adamw_implementation']}) {o['adamw_per_tensor_us']:.1f} us per tensor"
              + "".join(f", {float(size):,.0f}-element tensors {ns:.2f} ns/element"
                        for size, ns in o["adamw_ns_per_element"].items())
              + (f"; gradient norm {o['grad_norm_per_tensor_us']:.1f} us per tensor" if "grad_norm_per_tensor_us" in o
                 else ""))
    for name, rows in s["collectives"].items():
        print(f"  {name}: " + ", ".join(f"{r['bytes'] / 2**10:.0f} KiB {r['busbw_GBps']:.2f}" for r in rows)
              + "  (busbw GB/s)")
    if s["process_slowdown"]:
        print("  kernels with n processes at once: "
              + ", ".join(f"{n}: x{f:.2f}" for n, f in s["process_slowdown"].items()) + " their table times")
    ext = s["extrapolated"]
    if any(ext.values()):
        print(f"  past the time budget, extrapolated: {ext['gemm']} GEMM, {ext['elementwise']} elementwise and "
              f"{ext['collectives']} collective entries (marked in the profile)")
    for key, ms in s["layer_times_ms"].items():
        print(f"  layer {key}: {ms:.3f} ms")
    return 0
