"""Offload pricing: where model states live and what moving them costs (autopar.codegen.offload, FSDP2 offload).

  optimizer  the device keeps the weights and gradients (ZeRO-sharded as without offload, in the precision
             policy's dtypes: fp32 masters and fp32 gradients under every policy); the host keeps fp32
             masters and Adam's two moments (12 bytes per parameter the rank steps) plus an fp32 copy of
             its gradients (4 bytes). Each step, after backward, every rank copies its gradients to the
             host (converting them to fp32 if they are not), steps Adam there, and copies the masters
             back in the weights' dtype (codegen/offload.py does these in sequence: all exposed)
  params     FSDP2's CPUOffloadPolicy under ZeRO-3: the device keeps only the gathered layers (the ZeRO-3
             buffer), the host the shards of weights, gradients and optimizer states; every all-gather
             first copies the layer's shard to the device (in FSDP's copy-in, beside compute like the
             gather), every reduce-scatter's shard goes back, and Adam steps on the CPU
Copies run at the node's host link per device and share the node's DRAM (cost_models.offload.host_copy_s);
the step is the user's optimizer run on the host, priced as on the device (PyTorch's AdamW streaming
compute_costs.ADAM_BYTES_PER_PARAM per parameter) at the host's DRAM bandwidth, all ranks of the node at
once (cost_models.offload.host_adam_s).
Host memory per node must hold every rank's host states: candidates that do not fit are not planned.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import InfeasiblePlanError
from cost_models import memory, offload
from cost_models.hardware import HostSpec
from cost_models.precision import DTYPE_BYTES, Precision

__all__ = ["OffloadCosts", "OffloadSummary", "HOST_RESERVE_FRACTION"]

_HOST_DTYPE = "float32"  # codegen/offload.py HostOptimizer: masters, their moments and gradients in fp32
# Host memory an offload plan may not fill: the OS, the data loader's workers and pinned staging buffers
# (assumption: a tenth of a 1–2 TB DGX host, ~100–200 GiB, leaves them room; raise it in PlannerOptions if not)
HOST_RESERVE_FRACTION = 0.10


class OffloadCosts:
    """Device and host bytes and host time of one layer's parameters under an offload mode."""

    def __init__(self, host: HostSpec | None, *, devices_per_node: int, precision: Precision,
                 adam_bytes_per_param: float) -> None:
        self.host = host
        self.devices_per_node = devices_per_node
        self.elem = precision.weight_bytes  # bytes of one weight element on the device (gradients alike)
        self.host_elem = DTYPE_BYTES[_HOST_DTYPE]
        # offload="optimizer" on the host per parameter a rank steps: an fp32 master, Adam's two moments (ZeRO-
        # Offload's 12 bytes) and the fp32 gradient copy the step reads (HostOptimizer: masters[i].grad)
        self.host_optimizer_bytes = 2 * self.host_elem + precision.optimizer_bytes
        self.adam_bytes = adam_bytes_per_param  # what the optimizer step streams per parameter

    def check(self, mode: str) -> None:
        if mode != "none" and self.host is None:
            raise InfeasiblePlanError(
                f"offload={mode!r} needs the node's host memory and links, which this cluster does not describe; "
                "use a preset (dgx-h100, ...), add a [host] table to the cluster file (memory_GiB, "
                "memory_bandwidth_GBps, cpu_cores, device_link), or use --offload none")

    @property
    def host_capacity_bytes(self) -> float:
        return 0.0 if self.host is None else self.host.memory_bytes * (1.0 - HOST_RESERVE_FRACTION)

    def device_states(self, states: memory.ModelStateBytes, mode: str) -> memory.ModelStateBytes:
        """The part of a layer's model states (as priced without offload) that stays on the device."""
        if mode == "optimizer":
            return memory.ModelStateBytes(weights_bytes=states.weights_bytes, grads_bytes=states.grads_bytes,
                                          optimizer_bytes=0.0, compute_copy_bytes=states.compute_copy_bytes)
        if mode == "params":
            return memory.ModelStateBytes(weights_bytes=0.0, grads_bytes=0.0, optimizer_bytes=0.0)
        return states

    def host_bytes(self, states: memory.ModelStateBytes, stepped_params: float, mode: str) -> float:
        """Host bytes one rank keeps: its optimizer states and an fp32 gradient copy per parameter it steps
        (optimizer), or all its sharded states (params)."""
        if mode == "optimizer":  # fp32 master, two fp32 moments and an fp32 gradient per parameter it steps
            return self.host_optimizer_bytes * stepped_params
        if mode == "params":
            return states.total_bytes
        return 0.0

    def step_s(self, stepped_params: float, mode: str) -> float:
        """Host part of one step for `stepped_params` parameters of each rank of a node: gradients down, the
        fp32 conversion, Adam, the weights back (optimizer); Adam only under params, whose copies ride the
        gathers and reduce-scatters (`gather_copy_s`)."""
        if mode == "none" or stepped_params <= 0:
            return 0.0
        host = self._host()
        node_params = stepped_params * self.devices_per_node
        adam = offload.host_adam_s(node_params, host, self.adam_bytes)
        if mode == "params":
            return adam
        copies = 2 * offload.host_copy_s(stepped_params * self.elem, self.devices_per_node, host)
        # gradients to fp32 and masters to the weights' dtype on the CPU; none when the device holds fp32
        casts = (2 * offload.host_cast_s(node_params, self.elem, self.host_elem, host)
                 if self.elem != self.host_elem else 0.0)
        return copies + casts + adam

    def gather_copy_s(self, shard_bytes: float) -> float:
        """Under params: the copy of one layer's shard to the device before its all-gather (or of its gradient
        shard back after the reduce-scatter)."""
        return offload.host_copy_s(shard_bytes, self.devices_per_node, self._host())

    def summary(self, *, mode: str, device_state_bytes: float, host_bytes_per_node: float, stepped_params: float,
                shard_bytes: float, copies_per_step: int, overlapped: bool) -> OffloadSummary:
        """The per-step picture of one device (`stepped_params`: parameters it steps; `shard_bytes`: its
        parameter shards' bytes, copied in before each all-gather and back after each reduce-scatter under
        params: `copies_per_step` of them)."""
        host = self._host()
        if mode == "optimizer":
            copy = 2 * offload.host_copy_s(stepped_params * self.elem, self.devices_per_node, host)
        else:
            copy = copies_per_step * offload.host_copy_s(shard_bytes, self.devices_per_node, host)
        return OffloadSummary(mode=mode, device_state_bytes=device_state_bytes, host_bytes_per_node=host_bytes_per_node,
                              host_capacity_bytes=self.host_capacity_bytes, copy_s=copy,
                              adam_s=offload.host_adam_s(stepped_params * self.devices_per_node, host,
                                                         self.adam_bytes),
                              overlapped=overlapped and mode == "params")

    def _host(self) -> HostSpec:
        if self.host is None:
            raise InfeasiblePlanError("offload priced without a host; Cluster.host is None")
        return self.host


@dataclass(frozen=True, kw_only=True)
class OffloadSummary:
    """Where one device's model states live under an offload plan and what moving them costs per step."""

    mode: str
    device_state_bytes: float  # model states left on one device (its share of the layers, stages even)
    host_bytes_per_node: float
    host_capacity_bytes: float
    copy_s: float  # host↔device copies per step on one device
    adam_s: float  # the CPU optimizer step per step
    overlapped: bool  # whether the runtime runs the copies beside compute (FSDP2's copy-in on NCCL)

    def lines(self) -> list[str]:
        gib = float(1 << 30)
        where = {"optimizer": "weights and gradients on the device; fp32 masters, Adam moments and an fp32 gradient "
                              "copy on the host",
                 "params": "weights, gradients and optimizer states on the host (FSDP2 CPU offload); the device "
                           "holds the gathered layers only"}[self.mode]
        how = "beside compute, in FSDP's copy-in" if self.overlapped else "after backward, in the step"
        return [f"offload         {self.mode}: {where}",
                f"                device {self.device_state_bytes / gib:.1f} GiB of model states per device; host "
                f"{self.host_bytes_per_node / gib:,.0f} GiB per node of {self.host_capacity_bytes / gib:,.0f} usable",
                f"                host↔device copies {self.copy_s:.3f} s per step ({how}); CPU Adam "
                f"{self.adam_s:.3f} s per step"]
