"""Which CPU this is: vendor, model name and the instruction sets that change kernel speed (`CpuKind`).

Two hosts with the same `platform.processor()` ("x86_64") can differ ×10 in a bf16 GEMM (AMX or
AVX-512-BF16 against AVX2 emulation) and ×5 in the per-op cost of an eager step, so a profile names the
CPU it measured and `autopar profile` / `autopar report` show it. Read from /proc/cpuinfo (Linux); other
systems give what `platform` knows and no flags.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from cost_models.profile import ISA_FLAGS, CpuKind

__all__ = ["cpu_kind", "parse_cpuinfo"]


def parse_cpuinfo(text: str) -> tuple[str, str, tuple[str, ...]]:
    """(vendor_id, model name, the ISA_FLAGS present) of the first processor in /proc/cpuinfo's text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: a VM's vCPUs are alike
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return fields.get("vendor_id", ""), fields.get("model name", ""), tuple(f for f in ISA_FLAGS if f in flags)


def cpu_kind(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuKind:
    """This machine's CPU; torch_isa is the vector ISA torch's CPU kernels dispatch to."""
    try:
        vendor, model, flags = parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        vendor, model, flags = "", "", ()
    return CpuKind(vendor=vendor or platform.machine(), model_name=model or platform.processor() or platform.machine(),
                   flags=flags, torch_isa=torch.backends.cpu.get_cpu_capability())
