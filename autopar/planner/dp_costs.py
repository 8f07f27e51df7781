"""The data-parallel part of a step, priced as autopar's runtime issues it: which collectives, how many.

On gloo every collective pays a latency of 0.1 to several ms (more when processes outnumber cores), so
a step's data-parallel time is a count of collectives times their latency plus bytes over bandwidth,
not one collective of the whole gradient. Per step on one rank, with dp ranks, m micro-batches, the
rank's gradient bytes G and a layer's parameter bytes P (autopar/codegen/data_parallel.py, runtime.py):

  ZeRO-0  ⌈G / 25 MiB⌉ all-reduces of G in flat buckets (DDP's bucket size), each launched in the
          last micro-batch's backward once its parameters have their gradients (autopar.codegen.grad_overlap;
          the experts' after backward); the bucket is packed, divided and unpacked: 6·G bytes of memory
          traffic (read + write, 3 passes)
  ZeRO-1  the same, then the updated parameters sent from their owners, B = G · `broadcast_ratio` (their
          dtype's bytes ÷ reduce bytes: ½ under bf16, whose ZeRO-1 holds 16-bit parameters,
          autopar.codegen.dist_optimizer): each owner's ≈ B/dp share in ⌈B / (dp · 25 MiB)⌉ buckets of its own,
          one broadcast each packed flat (2·G·ratio more bytes: the owner packs its share, the others unpack
          theirs): dp · ⌈B / (dp · 25 MiB)⌉ ≤ ⌈B / 25 MiB⌉ + dp broadcasts, issued asynchronously after the step
          and waited for in the next step's forward (autopar.codegen.param_prefetch)
  ZeRO-2  FSDP2 per layer: an all-gather of P in every micro-batch's forward, a reduce-scatter of
          its gradient in every micro-batch's backward (the gradient shards summed over the step, as
          torchtitan, Composer and Megatron-FSDP run gradient accumulation), or under a pipeline
          (pp > 1) only in the last micro-batch's (torch.distributed.pipelining's stage backward
          accumulates unsharded gradients until then); each copies in and out (2·P bytes)
  ZeRO-3  as ZeRO-2 plus the all-gather again in every micro-batch's backward
  every   the loss all-reduce over all ranks (one 4-byte all-reduce, `ParallelModel._global_mean`), and the
          global gradient norm (clipping; fp16's overflow check): one pass reading the rank's gradient
          shards and one 8-byte all-reduce over all ranks (autopar.codegen.clipping)
Gradients travel in the precision's reduce dtype (G, P above: fp32 bytes); FSDP2's all-gathers move the
parameters in its compute dtype (`gather_ratio` = compute bytes ÷ reduce bytes: ½ under bf16).

On CPU, FSDP2 also costs CPU time that is not communication: its hooks around every layer in every
micro-batch (unshard / reshard bookkeeping, copy-in and copy-out) and an optimizer step on DTensor
shards (DTensor dispatch per parameter). Measured per FSDP unit with `python benchmarks/host_overhead.py`
(gpt-tiny, one thread, thread CPU time, this repository's 2-vCPU development machine, whose profiled
eager-op floor is 0.90 µs): hooks 1.44 ms (ZeRO-2) and 1.76 ms (ZeRO-3) per unit per micro-batch,
optimizer 1.30 ms per unit per step. Both are Python and dispatch work, so they are kept as multiples of
the eager-op floor (~1600, ~1950 and ~1440 floors of the profile's host floor, Profile.host_overhead_floor_s,
the floor DTensor's tensor-parallel overheads are priced in too), which makes them follow the CPU's speed
and the host-overhead calibration (autopar.calibrate). They are charged where the runtime spends them —
the hooks with each layer's compute in every micro-batch (`hooks_s`), the optimizer part with the
optimizer step (`optimizer_host_s`) — not in γ, and not on GPUs, where the host runs ahead.

ZeRO-0/1 collectives span the rank's whole gradient, so they are linearised around the average
rank's G (γ per byte plus a fixed γ0, exact where the measured time is affine in size); FSDP2's are
per layer and priced exactly per layer. On gloo nothing here overlaps compute: ProcessGroupGloo's threads
run on the cores the passes use, so a collective issued in backward takes its time from them; all of it is
exposed. On NCCL the collectives run beside compute, less the compute NCCL's CTAs take from the passes
while they run (cost_models.fleet: the SMs an overlapped collective occupies), and hide as follows
(`hidden_s`, the planner's β):

  ZeRO-0/1  each layer's share of the dense all-reduce (its bytes at the all-reduce's per-byte time) behind
            that layer's backward of the last micro-batch (each stage's last, under a pipeline), as the
            runtime launches the buckets while backward runs — less the last bucket (up to BUCKET_BYTES: the
            first layers' gradients, complete only as backward ends), whose all-reduce follows backward; the
            per-bucket latency (γ0), the packing and unpacking and the experts' all-reduce stay exposed
  ZeRO-1    and each layer's share of the parameter broadcast (its bytes at the broadcast's per-byte time,
            plus its share of the latencies of the buckets after the first wave) behind one micro-batch's
            forward of a layer: the runtime waits for a layer's buckets when that layer's forward starts in
            the next step's first micro-batch (each stage's first), while the buckets behind them travel. The
            owners' parameters are spread over the model (size-balanced: Zero1Partition), so the first layer
            waits for every owner's first bucket: that wave (min(B, dp·BUCKET_BYTES) bytes, dp latencies), the
            packing and unpacking stay exposed. Dense and expert parameters alike (the runtime prefetches both)
  ZeRO-2/3  each micro-batch's passes hide as much of that micro-batch's gathers and reduce-scatter as
            they last
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cost_models.fleet import hidden_beside_s

__all__ = ["BUCKET_BYTES", "LOSS_BYTES", "FSDP_HOOKS_FLOORS", "DTENSOR_OPTIMIZER_FLOORS", "DPTail", "affine"]

BUCKET_BYTES = 25 * 2**20  # autopar.codegen.data_parallel.BUCKET_BYTES (DDP's bucket_cap_mb=25)
LOSS_BYTES = 4  # one float32 loss value per rank
NORM_BYTES = 8  # the float64 sum of squared gradients (autopar.codegen.clipping.global_grad_norm)
FLAT_PASSES_ZERO0 = 6  # bytes moved per gradient byte packing, dividing and unpacking a bucket
FLAT_PASSES_ZERO1 = 2  # bytes moved per parameter byte packing / unpacking the owners' broadcasts
FSDP_COPY_PASSES = 2  # bytes moved per parameter byte by FSDP2's copy-in / copy-out of one collective
FLOOR_S = 0.90e-6  # the eager-op floor of the machine the constants below were measured on
FSDP_HOOKS_FLOORS = {2: 1.44e-3 / FLOOR_S, 3: 1.76e-3 / FLOOR_S}  # per FSDP unit per micro-batch
DTENSOR_OPTIMIZER_FLOORS = 1.30e-3 / FLOOR_S  # per FSDP unit per optimizer step


class DPTail:
    """γ of one layer (`layer_s`) and the fixed γ0 (`fixed_s`) of one rank's data-parallel tail.

    collective_s(op, n_bytes, group_size) prices one collective; memory_s(n_bytes) one memory-bound pass
    over n_bytes (read + written); rank_grad_bytes is the average pipeline rank's gradient bytes G.
    """

    def __init__(self, *, zero_stage: int, dp: int, world: int, microbatches: int, rank_grad_bytes: float,
                 collective_s: Callable[[str, float, int], float], memory_s: Callable[[float], float],
                 host_floor_s: float = 0.0, interference: float = 0.0, gather_ratio: float = 1.0,
                 loss_and_norm: bool = True, pipelined: bool = False, broadcast_ratio: float = 1.0,
                 reduce_in_backward: bool = False, broadcast_in_forward: bool = False) -> None:
        """host_floor_s: the floor FSDP2's host overheads are counted in (module docstring); 0 on GPUs,
        where they are not charged. interference: the share of compute an overlapped collective takes
        (cost_models.fleet.overlap_interference). gather_ratio: bytes an all-gather moves per gradient byte.
        loss_and_norm: False for a tail over part of the gradients (the experts' over the ranks holding
        them), the step's loss and norm all-reduces being counted in the dense tail. pipelined: the layers run in
        pipeline stages (pp > 1), whose FSDP reduce-scatters once per step rather than every micro-batch.
        broadcast_ratio: bytes ZeRO-1's broadcast moves per gradient byte. reduce_in_backward: ZeRO-0/1's
        all-reduce runs in the last micro-batch's backward (the dense gradients, autopar.codegen.grad_overlap;
        the experts' reduce after backward), so NCCL can hide it (`hidden_s`). broadcast_in_forward: ZeRO-1's
        parameter broadcast runs in flight into the next step's forward (autopar.codegen.param_prefetch), so NCCL
        can hide it (`hidden_s`)."""
        self.interference = interference
        self.pipelined = pipelined
        self.gather_ratio = gather_ratio
        self.zero_stage, self.dp, self.microbatches = zero_stage, dp, microbatches
        self.host_floor_s = host_floor_s
        self._coll, self._mem = collective_s, memory_s
        g = rank_grad_bytes
        self._mem_per_byte = memory_s(g) / g if g > 0 else 0.0
        world = world if loss_and_norm else 1
        self.fixed_s = (collective_s("all_reduce", LOSS_BYTES, world) + collective_s("all_reduce", NORM_BYTES, world)
                        if world > 1 else 0.0)  # the loss and the gradient norm
        self.fixed_s += memory_s(g / dp if zero_stage >= 2 else g) if g > 0 else 0.0  # the norm reads them once
        self.per_byte_s = 0.0
        self._reduce_per_byte_s = 0.0  # ZeRO-0/1's all-reduce per byte, where it runs inside backward
        self._broadcast_per_byte_s = 0.0  # ZeRO-1's broadcast per gradient byte, where it runs inside forward
        self.flat_collectives = 2 if world > 1 else 0  # the loss and the gradient-norm all-reduces
        if dp == 1 or zero_stage >= 2 or g <= 0:
            return
        buckets = max(1, math.ceil(g / BUCKET_BYTES))
        slope, lat = affine(lambda n: collective_s("all_reduce", n, dp), min(g, BUCKET_BYTES))
        self.per_byte_s = slope + FLAT_PASSES_ZERO0 * self._mem_per_byte
        # the last bucket (the first layers' gradients, up to BUCKET_BYTES) completes as backward ends: its
        # all-reduce runs after it, exposed; the layers' shares of the rest hide (`hidden_s`)
        self._reduce_per_byte_s = slope * (1.0 - min(g, BUCKET_BYTES) / g) if reduce_in_backward else 0.0
        self.fixed_s += buckets * lat
        self.flat_collectives += buckets
        if zero_stage == 1:  # per owner, its share of B in buckets of its own, one broadcast each
            share = g * broadcast_ratio / dp
            b_buckets = dp * max(1, math.ceil(share / BUCKET_BYTES))
            b_slope, b_lat = affine(lambda n: collective_s("broadcast", n, dp), min(share, BUCKET_BYTES))
            # the first wave — every owner's first bucket, dp of them, the whole broadcast where a share fits one
            # bucket — is what the first layer's forward waits for (owners hold parameters spread over the model:
            # Zero1Partition), so its bytes and latencies stay exposed; the later buckets' latencies spread over
            # the bytes, and the layers' shares of what follows the wave hide (`hidden_s`)
            wave = min(share, BUCKET_BYTES) * dp / broadcast_ratio  # in gradient bytes
            later_lat_per_byte = (b_buckets - dp) * b_lat / g
            self.per_byte_s += (b_slope + FLAT_PASSES_ZERO1 * self._mem_per_byte) * broadcast_ratio + later_lat_per_byte
            self._broadcast_per_byte_s = (b_slope * broadcast_ratio * (1.0 - wave / g) + later_lat_per_byte
                                          if broadcast_in_forward else 0.0)
            self.fixed_s += dp * b_lat
            self.flat_collectives += b_buckets

    @property
    def gathers_per_step(self) -> int:
        """FSDP2 all-gathers of each layer per step (0 without FSDP)."""
        if self.dp == 1 or self.zero_stage < 2:
            return 0
        return self.microbatches * (2 if self.zero_stage == 3 else 1)

    @property
    def reduce_scatters_per_step(self) -> int:
        """FSDP2 reduce-scatters of each layer's gradient per step (0 without FSDP; module docstring)."""
        if self.gathers_per_step == 0:
            return 0
        return 1 if self.pipelined else self.microbatches

    @property
    def hooks_s(self) -> float:
        """FSDP2's hook CPU time around one layer with parameters, per micro-batch (0 without FSDP)."""
        return self.host_floor_s * FSDP_HOOKS_FLOORS[self.zero_stage] if self.gathers_per_step else 0.0

    @property
    def optimizer_host_s(self) -> float:
        """The optimizer's DTensor dispatch over one FSDP unit's shards, per step (0 without FSDP)."""
        return self.host_floor_s * DTENSOR_OPTIMIZER_FLOORS if self.gathers_per_step else 0.0

    def layer_s(self, grad_bytes: float, gather_bytes: float | None = None, host_copy_s: float = 0.0) -> float:
        """γ of a layer whose parameters (= gradients) take grad_bytes on this rank. gather_bytes: what its
        all-gathers carry when not grad_bytes (FP8 weights gathered in 1 byte); host_copy_s: a copy from or to
        host memory before each all-gather and after the reduce-scatter (FSDP2's CPU offload)."""
        if grad_bytes <= 0:
            return 0.0
        if self.gathers_per_step == 0:
            return self.per_byte_s * grad_bytes
        k, r = self.gathers_per_step, self.reduce_scatters_per_step
        gather_bytes = grad_bytes * self.gather_ratio if gather_bytes is None else gather_bytes
        base = (k * self._coll("all_gather", gather_bytes, self.dp)
                + r * self._coll("reduce_scatter", grad_bytes, self.dp)
                + FSDP_COPY_PASSES * self._mem_per_byte * (k * gather_bytes + r * grad_bytes))
        return base + (k + r) * host_copy_s if host_copy_s else base

    def hidden_s(self, grad_bytes: float, forward_s: float, backward_s: float, gather_bytes: float | None = None,
                 host_copy_s: float = 0.0) -> float:
        """Of `layer_s(grad_bytes)`, the time NCCL hides behind one layer's passes over all micro-batches (β).
        FSDP2 gathers a layer while the previous one computes, so in each micro-batch its forward hides up to
        `forward_s` of its all-gather and its backward up to `backward_s` of the backward all-gather (ZeRO-3)
        and of the reduce-scatter (in every micro-batch, or under a pipeline in the last): a pass longer than
        its collective hides all of it, a shorter one only its own length (the rest waits in the critical
        path, exposed in the tail).
        While a collective runs beside a pass, NCCL's CTAs slow the pass by `interference` of the collective's
        time (cost_models.fleet.hidden_beside_s), so even a fully hidden collective costs that much."""
        if grad_bytes <= 0:
            return 0.0
        if self.gathers_per_step == 0:  # ZeRO-0/1: the all-reduce beside the last micro-batch's backward, and
            # ZeRO-1's broadcast beside the next step's first micro-batch's forward
            bcast, _, reduce = self.overlapped_s(grad_bytes)
            return (hidden_beside_s(bcast, forward_s, self.interference)
                    + hidden_beside_s(reduce, backward_s, self.interference))
        m, f = self.microbatches, self.interference
        ag, ag_b, rs = self.overlapped_s(grad_bytes, gather_bytes, host_copy_s)
        r = self.reduce_scatters_per_step  # the last r micro-batches' backwards each run a reduce-scatter
        return (m * hidden_beside_s(ag, forward_s, f) + (m - r) * hidden_beside_s(ag_b, backward_s, f)
                + r * hidden_beside_s(ag_b + rs, backward_s, f))

    def overlapped_s(self, grad_bytes: float, gather_bytes: float | None = None,
                     host_copy_s: float = 0.0) -> tuple[float, float, float]:
        """The collectives of one layer that run beside its passes: (the forward all-gather, the backward
        all-gather (ZeRO-3, else 0), the reduce-scatter), each with its host copy, under FSDP2; under ZeRO-0/1
        (the layer's share of ZeRO-1's parameter broadcast where it runs in forward (`broadcast_in_forward`), 0,
        the layer's share of the bucketed all-reduce: its bytes at the all-reduce's per-byte time, where it runs
        in backward (`reduce_in_backward`)), zeros for what runs in neither."""
        if grad_bytes <= 0:
            return 0.0, 0.0, 0.0
        if self.gathers_per_step == 0:
            return self._broadcast_per_byte_s * grad_bytes, 0.0, self._reduce_per_byte_s * grad_bytes
        ag = self._coll("all_gather", grad_bytes * self.gather_ratio if gather_bytes is None else gather_bytes,
                        self.dp)
        rs = self._coll("reduce_scatter", grad_bytes, self.dp)
        if host_copy_s:
            ag, rs = ag + host_copy_s, rs + host_copy_s
        return ag, ag if self.zero_stage == 3 else 0.0, rs

    def collectives_per_step(self, layers_with_params: int) -> int:
        """Collectives one rank issues per step for data parallelism and the loss."""
        return self.flat_collectives + layers_with_params * (self.gathers_per_step + self.reduce_scatters_per_step)


def affine(f: Callable[[float], float], n: float) -> tuple[float, float]:
    """(slope ≥ 0, intercept ≥ 0) of the chord of f between n/2 and n: f ≈ intercept + slope·x near n."""
    if n <= 0:
        return 0.0, 0.0
    slope = max(0.0, (f(n) - f(n / 2)) / (n / 2))
    return slope, max(0.0, f(n) - slope * n)
