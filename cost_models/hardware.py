"""Device and link specifications: the numbers every cost model starts from.

Bandwidths are unidirectional bytes per second per device; FLOP/s are dense (no sparsity);
every spec carries the `source` its numbers come from (datasheet, paper, or a measurement
command in this repo).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeviceSpec", "LinkSpec", "HostSpec"]


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    name: str
    kind: str  # "gpu" | "cpu"
    memory_bytes: int
    memory_bandwidth_Bps: float
    peak_flops: dict[str, float]  # dtype name ("bfloat16", "float16", "float32", "tf32", "fp8") → FLOP/s
    source: str
    notes: str = ""
    # the fraction of its short-benchmark tensor-core rate a GPU sustains inside a training step
    # (cost_models.compute.sustained_fraction); None: the value fitted on published runs
    sustained_fraction: float | None = None
    # the fused attention kernel training runs on it (cost_models.compute.ATTENTION_KERNELS): "flash2", as
    # PyTorch's scaled_dot_product_attention dispatches on CUDA, or "flash3" (Hopper's asynchronous kernels:
    # FlashAttention-3, cuDNN's fused attention that Transformer Engine runs)
    attention_kernel: str = "flash2"

    def __post_init__(self) -> None:
        if not (0 < self.memory_bytes < math.inf and 0 < self.memory_bandwidth_Bps < math.inf):
            raise ValueError(f"DeviceSpec {self.name}: memory_bytes and memory_bandwidth_Bps must be positive, finite")
        if self.sustained_fraction is not None and not 0.0 < self.sustained_fraction <= 1.0:
            raise ValueError(f"DeviceSpec {self.name}: sustained_fraction={self.sustained_fraction} must be in (0, 1]")
        if self.attention_kernel not in ("flash2", "flash3"):
            raise ValueError(f"DeviceSpec {self.name}: attention_kernel={self.attention_kernel!r} must be 'flash2' or "
                             "'flash3'")
        if not self.peak_flops or not all(0 < v < math.inf for v in self.peak_flops.values()):
            raise ValueError(f"DeviceSpec {self.name}: peak_flops needs positive FLOP/s for at least one dtype")
        if not self.source:
            raise ValueError(f"DeviceSpec {self.name}: every spec needs a source")

    def peak_flops_for(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; float32 math on GPUs with tensor cores uses tf32 when listed."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
        if aliases.get(dtype) in self.peak_flops:
            return self.peak_flops[aliases[dtype]]
        raise KeyError(f"device {self.name} has no peak FLOP/s for dtype {dtype!r}; it lists {sorted(self.peak_flops)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceSpec:
        return cls(**{**d, "peak_flops": {str(k): float(v) for k, v in d["peak_flops"].items()}})


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    name: str
    bandwidth_Bps: float  # unidirectional, per device
    latency_s: float
    source: str
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (0 < self.bandwidth_Bps < math.inf and 0 <= self.latency_s < math.inf):
            raise ValueError(f"LinkSpec {self.name}: bandwidth_Bps must be positive and latency_s non-negative, "
                             "both finite")
        if not self.source:
            raise ValueError(f"LinkSpec {self.name}: every spec needs a source")
        eff = self.extra.get("efficiency", 1.0)
        if not 0.0 < eff <= 1.0:
            raise ValueError(f"LinkSpec {self.name}: extra['efficiency']={eff} must be in (0, 1]")

    @property
    def effective_bandwidth_Bps(self) -> float:
        """What collectives achieve at large messages: bandwidth × extra['efficiency'] (1.0 when absent)."""
        return self.bandwidth_Bps * float(self.extra.get("efficiency", 1.0))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkSpec:
        return cls(**{**d, "extra": dict(d.get("extra", {}))})


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """The CPU side of one node, what offload uses: its memory, its DRAM bandwidth, and the link each device
    reaches host memory over (one per device). Numbers are per node unless named otherwise."""

    name: str
    memory_bytes: int  # per node
    memory_bandwidth_Bps: float  # per node, all sockets (DRAM channels × transfer rate × 8 B)
    cpu_cores: int  # per node
    device_link: LinkSpec  # host ↔ one device, unidirectional (PCIe x16)
    source: str

    def __post_init__(self) -> None:
        if not (0 < self.memory_bytes < math.inf and 0 < self.memory_bandwidth_Bps < math.inf):
            raise ValueError(f"HostSpec {self.name}: memory_bytes and memory_bandwidth_Bps must be positive, finite")
        if not isinstance(self.cpu_cores, int) or isinstance(self.cpu_cores, bool) or self.cpu_cores < 1:
            raise ValueError(f"HostSpec {self.name}: cpu_cores={self.cpu_cores!r} must be a positive integer")
        if not self.source:
            raise ValueError(f"HostSpec {self.name}: every spec needs a source")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "device_link": self.device_link.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostSpec:
        return cls(**{**d, "device_link": LinkSpec.from_dict(d["device_link"])})
