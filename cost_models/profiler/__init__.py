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

from cost_models.profile import MachineInfo, Profile
from cost_models.profiler.collectives import measure_collectives
from cost_models.profiler.kernels import (
    measure_attention_matmuls,
    measure_elementwise,
    measure_gemm,
    measure_launch_s,
)
from cost_models.profiler.layers import LayerCase, measure_layer

__all__ = ["profile_machine", "machine_info", "local_device_name", "LayerCase"]


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


def profile_machine(*, nproc: int | None = None, quick: bool = False, layers: Sequence[LayerCase] = (),
                    dtypes: Sequence[str] | None = None, progress: Callable[[str], None] | None = None,
                    model_name: str | None = None, collectives: bool = True, clock: str = "wall") -> Profile:
    """Measure the local device (CUDA when present, else CPU) and `nproc` local processes.

    nproc defaults to the GPU count, or to the CPU count (at least 2) on a CPU machine.
    dtypes defaults to bfloat16 and float32 (the GEMM sweep runs once per dtype).
    clock "thread" times kernels by single-threaded CPU time (CPU only), for machines shared with other
    work; layers and collectives are always timed by the wall clock.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if nproc is None:
        nproc = torch.cuda.device_count() if cuda else max(2, os.cpu_count() or 1)
    if nproc < 1 or (cuda and nproc > torch.cuda.device_count()):
        raise ValueError(f"nproc={nproc}: use 1..{torch.cuda.device_count() if cuda else 'N'} processes")
    dtypes = list(dtypes or ["bfloat16", "float32"])
    log = progress or (lambda _msg: None)
    step = [0]

    def note(msg: str) -> None:
        step[0] += 1
        log(f"[{step[0]}] {msg}")

    launch_s = measure_launch_s(device, clock)
    note(f"eager op floor on {device.type}: {launch_s * 1e6:.1f} us")
    gemm = measure_gemm(device, dtypes, quick, note, clock) + measure_attention_matmuls(device, dtypes, quick, note,
                                                                                       clock)
    elementwise = [e for dtype in dtypes for e in measure_elementwise(device, dtype, quick, note, clock)]
    layer_times: dict[str, float] = {}
    for case in layers:
        times = measure_layer(case, device, quick=quick)
        layer_times.update(times)
        note(f"layer {case.label or case.signature} b={case.micro_batch}: "
             + ", ".join(f"{k.split(':')[1]} {v * 1e3:.2f} ms" for k, v in times.items()))
    backend = "nccl" if cuda else "gloo"
    colls = measure_collectives(nproc, backend=backend, quick=quick, progress=note) if collectives else []
    return Profile(
        machine=machine_info(),
        device_name=local_device_name(),
        device_kind="cuda" if cuda else "cpu",
        device_count=nproc,
        torch_version=torch.__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        backend=backend,
        threads_per_process=torch.get_num_threads(),
        launch_overhead_s=launch_s,
        gemm=tuple(gemm),
        elementwise=tuple(elementwise),
        collectives=tuple(colls),
        layer_times=layer_times,
        model_name=model_name,
        notes="quick sweep" if quick else "",
        clock=clock,
    )
