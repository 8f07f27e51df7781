"""Measure this machine: GEMM and elementwise throughput, the eager-op floor, collectives over N local
processes and, when given, model layers — into a `Profile` the compute and comm models consume.

    from cost_models.profiler import profile_machine
    prof = profile_machine(nproc=2, quick=True, progress=print)
    prof.save("profile.json")
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
from collections.abc import Callable, Sequence

import torch

from cost_models.profile import CollectiveSample, MachineInfo, Profile
from cost_models.profiler.budget import FULL_BUDGET_S, QUICK_BUDGET_S, QUICK_LAYERS_BUDGET_S, PhaseClock
from cost_models.profiler.collectives import measure_collectives
from cost_models.profiler.contention import reference_s, training_threads
from cost_models.profiler.cpu import cpu_kind
from cost_models.profiler.kernels import (
    measure_attention_matmuls,
    measure_elementwise,
    measure_gemm,
    measure_launch_s,
)
from cost_models.profiler.layers import LayerCase, measure_layer, training_step
from cost_models.profiler.optimizer import measure_optimizer
from cost_models.profiler.timing import time_callable

__all__ = ["profile_machine", "machine_info", "local_device_name", "default_dtypes", "LayerCase", "QUICK_BUDGET_S",
           "FULL_BUDGET_S"]


def machine_info() -> MachineInfo:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        ram = 0
    return MachineInfo(hostname=socket.gethostname(), platform=platform.platform(),
                       processor=platform.processor() or platform.machine(), cpu_count=os.cpu_count() or 1,
                       ram_bytes=int(ram))


def local_device_name() -> str:
    """What a profile records as its device: the CUDA device name, else "cpu"."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def default_dtypes(cuda: bool) -> list[str]:
    """The dtype local training uses: float32 on a CPU (autopar.models.training_dtype), bfloat16 on GPUs.
    Other dtypes are measured only when asked: on a CPU without AVX-512-BF16/AMX a bfloat16 GEMM runs at
    1–20 GFLOP/s, and its table would cost most of the budget for a dtype the run never uses."""
    return ["bfloat16"] if cuda else ["float32"]


# How the budget is shared among the phases that run (budget.PhaseClock); each weight is roughly that
# phase's share of a quick profile's time on this 2-vCPU VM with no budget (its progress log).
# The optimizer loops (profiler.optimizer) took 1.0–2.0 s of it under load 2–7 here.
PHASE_WEIGHTS = {"gemm": 3.0, "bmm": 2.0, "elementwise": 2.0, "optimizer": 0.5, "layers": 3.0, "collectives": 4.0}


def profile_machine(*, nproc: int | None = None, quick: bool = False, layers: Sequence[LayerCase] = (),
                    dtypes: Sequence[str] | None = None, progress: Callable[[str], None] | None = None,
                    model_name: str | None = None, collectives: bool = True, clock: str = "wall",
                    budget_s: float | None = None, param_shapes: Sequence[tuple[int, ...]] = ()) -> Profile:
    """Measure the local device (CUDA when present, else CPU) and `nproc` local processes, within budget_s.

    nproc defaults to the GPU count, or to the CPU count (at least 2) on a CPU machine.
    dtypes defaults to the local training dtype (`default_dtypes`).
    On a CPU, kernels are timed with the threads one of the nproc training processes will run
    (`contention.training_threads`), and the same work in 2, 4 ... nproc processes at once (the model's
    layers forward and backward when given and the workers fork, else contention.kernel_mix) gives
    Profile.process_slowdown. clock "thread" times kernels by single-threaded CPU time (CPU only);
    layers, collectives and the concurrent mix are always timed by the wall clock.
    budget_s (wall seconds for the measurements) defaults to QUICK_BUDGET_S with quick, else
    FULL_BUDGET_S, plus QUICK_LAYERS_BUDGET_S when layers are timed; see budget.py for what gives.
    param_shapes: the model's parameter shapes, on which the optimizer's loops are timed too (optimizer.py).
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if nproc is None:
        nproc = torch.cuda.device_count() if cuda else max(2, os.cpu_count() or 1)
    if nproc < 1 or (cuda and nproc > torch.cuda.device_count()):
        raise ValueError(f"nproc={nproc}: use 1..{torch.cuda.device_count() if cuda else 'N'} processes")
    if budget_s is None:
        budget_s = (QUICK_BUDGET_S if quick else FULL_BUDGET_S) + (QUICK_LAYERS_BUDGET_S if layers else 0.0)
    dtypes = list(dtypes or default_dtypes(cuda))
    run_collectives = collectives and nproc >= 2
    weights = {k: w for k, w in PHASE_WEIGHTS.items()
               if (k != "layers" or layers) and (k != "collectives" or run_collectives)}
    budget = PhaseClock(budget_s, weights)
    log = progress or (lambda _msg: None)
    step = [0]
    phase_end = [budget.start]

    def note(msg: str, phase_left_s: float | None = None) -> None:
        """A progress line with the time spent and the expected time left: this phase's estimate (its
        sweep's prediction, else what its share has left) plus the shares of the phases to come."""
        step[0] += 1
        now = budget.clock()
        share_left = max(0.0, phase_end[0] - now)
        later = max(0.0, budget.left_s() - share_left)
        this = share_left if phase_left_s is None else min(phase_left_s, share_left)
        log(f"[{step[0]}] {msg}  [{now - budget.start:.0f} s, ~{this + later:.0f} s left]")

    def begin(phase: str) -> float:
        share = budget.begin(phase)
        phase_end[0] = budget.clock() + share
        return share

    threads = torch.get_num_threads()
    run_threads = 1 if clock == "thread" else (threads if cuda else training_threads(nproc))
    torch.set_num_threads(run_threads)
    try:
        launch_s = measure_launch_s(device, clock)
        note(f"eager op floor on {device.type}: {launch_s * 1e6:.1f} us ({run_threads} thread(s), as each of "
             f"{nproc} training processes)")
        gemm = measure_gemm(device, dtypes, quick, note, clock, begin("gemm"))
        gemm += measure_attention_matmuls(device, dtypes, quick, note, clock, begin("bmm"))
        per_dtype = begin("elementwise") / len(dtypes)
        elementwise = [e for dtype in dtypes for e in measure_elementwise(device, dtype, quick, note, clock, per_dtype)]
        optimizer = measure_optimizer(device, note, clock, begin("optimizer"), param_shapes)
        layer_times: dict[str, float] = {}
        if layers:
            begin("layers")
        for i, case in enumerate(layers):
            share = (phase_end[0] - budget.clock()) / (len(layers) - i)
            if share <= 0:
                note(f"layer {case.label or case.signature}: over the time budget, not timed")
                continue
            times = measure_layer(case, device, quick=quick, budget_s=share)
            layer_times.update(times)
            note(f"layer {case.label or case.signature} b={case.micro_batch}: "
                 + ", ".join(f"{k.split(':')[1]} {v * 1e3:.2f} ms" for k, v in times.items()))
        mix_dtype = None if cuda else dtypes[0]
        # the model's layers, when given, are the kernels whose slowdown the run will see (contention.py)
        model_step = training_step(list(layers)) if layers and mix_dtype else None
        ref_s = 0.0
        if mix_dtype and run_collectives:
            ref_s = (time_callable(model_step, device, trials=5, trial_s=0.05, clock=clock, budget_s=2.0)
                     if model_step else reference_s(device, mix_dtype, clock, budget_s=1.0))
    finally:
        torch.set_num_threads(threads)
    backend = "nccl" if cuda else "gloo"
    colls: list[CollectiveSample] = []
    slowdown: dict[int, float] = {}
    if run_collectives:
        sweep = measure_collectives(nproc, backend=backend, quick=quick, progress=note,
                                    budget_s=begin("collectives"), mix_dtype=mix_dtype, step=model_step,
                                    threads=run_threads)
        colls = sweep.samples
        slowdown = {n: s / ref_s for n, s in sweep.mix_s.items() if ref_s > 0}
        for n, f in sorted(slowdown.items()):
            note(f"kernels in {n} processes at once run {f:.2f}x their table times")
    return Profile(
        machine=machine_info(),
        device_name=local_device_name(),
        device_kind="cuda" if cuda else "cpu",
        device_count=nproc,
        torch_version=torch.__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        backend=backend,
        threads_per_process=run_threads,
        launch_overhead_s=launch_s,
        gemm=tuple(gemm),
        elementwise=tuple(elementwise),
        collectives=tuple(colls),
        layer_times=layer_times,
        model_name=model_name,
        notes=("quick sweep" if quick else "") + f"; budget {budget_s:.0f} s, took {budget.elapsed_s():.0f} s",
        clock=clock,
        process_slowdown=slowdown,
        cpu=cpu_kind(),
        optimizer=tuple(optimizer),
    )
