"""Offload to host memory: host↔device copies and the optimizer step on the CPU (ZeRO-Offload).

Sources:
- The split and its traffic: Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training",
  USENIX ATC 2021, §4: gradients go to the host once per step, updated 16-bit parameters come back once;
  fp32 master weights and Adam moments (12 bytes per parameter) live in host memory.
- An Adam step is memory-bound (~1 FLOP per byte): host memory bandwidth bounds it, as it bounds the casts
  between 16-bit device copies and fp32 host copies. Its bytes per parameter are the caller's: PyTorch's
  AdamW streams ~80 (autopar.planner.compute_costs.ADAM_BYTES_PER_PARAM), a fused step (ZeRO-Offload
  §4.3's CPU-Adam, `torch.optim.AdamW(fused=True)` on CPU) reads each fp32 parameter, gradient and both
  moments once and writes the parameter and the moments once: FUSED_ADAM_BYTES_PER_PARAM = 16 + 12 = 28.
- HOST_STREAM_EFFICIENCY: the fraction of a server's theoretical DRAM bandwidth a streaming kernel reaches.
Every function returns seconds or bytes; bandwidths are bytes per second.
"""

from __future__ import annotations

from cost_models.hardware import HostSpec

__all__ = ["FUSED_ADAM_BYTES_PER_PARAM", "HOST_STREAM_EFFICIENCY", "host_adam_s", "host_copy_s", "host_cast_s"]

FUSED_ADAM_BYTES_PER_PARAM = 28.0  # fp32 param, grad, m, v read (16 B); param, m, v written (12 B)
# assumption: STREAM Triad on two-socket servers reaches ~70–80% of the DRAM channels' theoretical rate
# (McCalpin, "STREAM: Sustainable Memory Bandwidth in High Performance Computers", published results);
# a profile measured on the host would refine it
HOST_STREAM_EFFICIENCY = 0.75


def _stream_Bps(host: HostSpec) -> float:
    return host.memory_bandwidth_Bps * HOST_STREAM_EFFICIENCY


def host_adam_s(params_per_node: float, host: HostSpec, bytes_per_param: float) -> float:
    """One Adam step over the fp32 states of `params_per_node` parameters, streaming `bytes_per_param` each
    (every rank's share on the node steps at once, so they share its DRAM bandwidth)."""
    if params_per_node < 0 or bytes_per_param <= 0:
        raise ValueError(f"params_per_node={params_per_node} must be ≥ 0 and bytes_per_param={bytes_per_param} > 0")
    return params_per_node * bytes_per_param / _stream_Bps(host)


def host_cast_s(elements_per_node: float, from_bytes: float, to_bytes: float, host: HostSpec) -> float:
    """Converting `elements_per_node` values on the CPU (16-bit gradients to fp32, fp32 masters to 16 bits)."""
    return elements_per_node * (from_bytes + to_bytes) / _stream_Bps(host)


def host_copy_s(bytes_per_device: float, devices_per_node: int, host: HostSpec) -> float:
    """Every device of a node copying `bytes_per_device` to or from host memory at once: each over its own
    link (PCIe x16 at the link's achieved efficiency), all through the node's DRAM."""
    if bytes_per_device < 0 or devices_per_node < 1:
        raise ValueError(f"bytes_per_device={bytes_per_device} must be ≥ 0 and devices_per_node ≥ 1")
    link = bytes_per_device / host.device_link.effective_bandwidth_Bps + host.device_link.latency_s
    dram = bytes_per_device * devices_per_node / _stream_Bps(host)
    return max(link, dram) if bytes_per_device > 0 else 0.0
