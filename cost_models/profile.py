"""`Profile`: what the profiler measured on one machine, as a versioned JSON file.

The compute and communication models read it in preference to datasheet numbers. A profile
describes one machine, one device type and one torch version; `check_matches` refuses to let
it price another (`ProfileMismatch`), rather than silently using foreign timings.

Units: bytes, seconds, FLOP/s. Collective sizes follow nccl-tests: all_reduce / broadcast the
buffer, all_gather the gathered output, reduce_scatter the input, all_to_all one rank's send buffer.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "PROFILE_SCHEMA_VERSION",
    "ProfileMismatch",
    "scale_profile",
    "MachineInfo",
    "CpuKind",
    "ISA_FLAGS",
    "GemmSample",
    "OptimizerSample",
    "OPTIMIZER_LOOPS",
    "ElementwiseSample",
    "CollectiveSample",
    "Profile",
    "layer_key",
    "bus_bandwidth_factor",
]

PROFILE_SCHEMA_VERSION = 1
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")


class ProfileMismatch(ValueError):
    """A profile describes another machine, device or torch version than the one being priced."""


def layer_key(signature: str, phase: str, micro_batch: int, tp: int = 1) -> str:
    """Key of a measured layer time: "<signature>:<fwd|bwd>:b<micro_batch>:t<tp>"."""
    if phase not in ("fwd", "bwd"):
        raise ValueError(f"phase={phase!r}; expected 'fwd' or 'bwd'")
    return f"{signature}:{phase}:b{micro_batch}:t{tp}"


def bus_bandwidth_factor(op: str, group_size: int) -> float:
    """busbw / algbw as nccl-tests defines it (doc/PERFORMANCE.md): the fraction of the buffer each rank
    sends on its busiest link, so that busbw is comparable to the link bandwidth for any group size."""
    k = group_size
    if op == "all_reduce":
        return 2.0 * (k - 1) / k
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (k - 1) / k
    if op in ("broadcast", "p2p"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}; expected one of {COLLECTIVE_OPS}")


@dataclass(frozen=True, kw_only=True)
class MachineInfo:
    hostname: str
    platform: str
    processor: str
    cpu_count: int
    ram_bytes: int


# The /proc/cpuinfo flags that change what a CPU kernel costs: AVX-512 (torch's widest CPU kernels),
# AVX-512-BF16 and AMX (oneDNN's bf16 GEMMs in hardware instead of emulated: `default_dtypes` says by how much).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True, kw_only=True)
class CpuKind:
    """The host CPU a profile was measured on (profiler.cpu.cpu_kind)."""

    vendor: str  # /proc/cpuinfo vendor_id, e.g. "GenuineIntel", "AuthenticAMD"
    model_name: str  # e.g. "Intel(R) Xeon(R) Platinum 8480+", "AMD EPYC"
    flags: tuple[str, ...] = ()  # the ISA_FLAGS it has
    torch_isa: str = ""  # torch.backends.cpu.get_cpu_capability(): what torch's CPU kernels dispatch to

    def describe(self) -> str:
        isa = " ".join(self.flags) or "no AVX-512/AMX flags"
        return f"{self.model_name} ({self.vendor}; {isa}; torch {self.torch_isa or '?'} kernels)"


@dataclass(frozen=True, kw_only=True)
class GemmSample:
    """One timed (m×k)·(k×n) matmul; layout says which operands are transposed views ("nn", "nt", "tn"),
    as a linear layer's forward (x·Wᵀ), input-gradient (g·W) and weight-gradient (gᵀ·x) GEMMs are.

    batch > 1 is a batched matmul (torch.bmm of `batch` independent products, as eager attention runs
    QKᵀ and PV per head); time_s is for the whole batch. Files without the field are plain GEMMs.
    """

    m: int
    n: int
    k: int
    dtype: str
    time_s: float
    layout: str = "nn"
    batch: int = 1
    extrapolated: bool = False  # not measured: the sweep's fitted curve, past its time budget (profiler.budget)

    def __post_init__(self) -> None:
        if min(self.m, self.n, self.k, self.batch) < 1 or not self.time_s > 0:
            raise ValueError(f"GemmSample {self.batch}x{self.m}x{self.n}x{self.k}: sizes must be ≥ 1 and "
                             f"time_s={self.time_s} positive")

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.time_s


@dataclass(frozen=True, kw_only=True)
class ElementwiseSample:
    """One timed elementwise op; n_bytes counts every byte read and written, tensor_bytes is the size of
    its largest tensor (0 in files written before it was recorded), which sets the cache and allocator
    regime the op runs in."""

    op: str
    dtype: str
    n_bytes: int
    time_s: float
    tensor_bytes: int = 0
    extrapolated: bool = False  # not measured: the sweep's fitted curve, past its time budget (profiler.budget)

    @property
    def bytes_per_s(self) -> float:
        return self.n_bytes / self.time_s


OPTIMIZER_LOOPS = ("adamw", "grad_norm", "scale")


@dataclass(frozen=True, kw_only=True)
class OptimizerSample:
    """One timed per-tensor loop of the optimizer phase over `tensors` tensors of params/tensors elements
    each (fp32), as the runtime runs it (profiler.optimizer): "adamw" torch.optim.AdamW.step with torch's
    default implementation on the device (`implementation`), "grad_norm" the global norm's per-tensor
    reads, "scale" an in-place multiply of every gradient (fp16 unscaling, clipping)."""

    kind: str
    tensors: int
    params: int  # elements over all tensors
    time_s: float
    implementation: str = ""  # "for-loop", "foreach" or "fused" (adamw)
    model_shapes: bool = False  # the profiled model's own parameter shapes, not a uniform sweep point

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZER_LOOPS:
            raise ValueError(f"OptimizerSample.kind={self.kind!r}; expected one of {OPTIMIZER_LOOPS}")
        if min(self.tensors, self.params) < 1 or not self.time_s > 0:
            raise ValueError(f"OptimizerSample {self.kind}: tensors={self.tensors}, params={self.params} must be "
                             f"≥ 1 and time_s={self.time_s} positive")


@dataclass(frozen=True, kw_only=True)
class CollectiveSample:
    op: str
    group_size: int
    n_bytes: int
    time_s: float  # mean over trials of the slowest rank's mean time per op (profiler.collectives)
    extrapolated: bool = False  # not measured: the α-β line of the largest measured sizes, past the budget

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVE_OPS:
            raise ValueError(f"CollectiveSample.op={self.op!r}; expected one of {COLLECTIVE_OPS}")
        if self.time_s <= 0 or self.n_bytes <= 0 or self.group_size < 2:
            raise ValueError(f"CollectiveSample {self.op}: needs time_s > 0, n_bytes > 0, group_size ≥ 2")

    @property
    def algbw_Bps(self) -> float:
        return self.n_bytes / self.time_s

    @property
    def busbw_Bps(self) -> float:
        return self.algbw_Bps * bus_bandwidth_factor(self.op, self.group_size)


@dataclass(frozen=True, kw_only=True)
class Profile:
    machine: MachineInfo
    device_name: str  # "cpu" or torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3"
    device_kind: str  # "cpu" | "cuda"
    device_count: int  # GPUs on the machine, or CPU processes used for collectives
    torch_version: str
    created: str  # ISO 8601 date and time
    backend: str  # "gloo" | "nccl"
    threads_per_process: int
    launch_overhead_s: float  # per-op floor: an empty kernel launch (CUDA) or eager dispatch (CPU)
    gemm: tuple[GemmSample, ...] = ()
    elementwise: tuple[ElementwiseSample, ...] = ()
    collectives: tuple[CollectiveSample, ...] = ()
    layer_times: dict[str, float] = field(default_factory=dict)  # layer_key(...) → seconds
    model_name: str | None = None
    notes: str = ""
    clock: str = "wall"  # how kernels were timed: "wall", or "thread" (single-threaded CPU time)
    # The floor framework host overheads (DTensor dispatch) are priced in: launch_overhead_s as measured,
    # before core sharing and the kernel calibration scale that (autopar.calibrate fits its own factor).
    # None: launch_overhead_s.
    host_floor_s: float | None = None
    # n → how much longer a kernel takes in each of n training processes running at once (their thread
    # count, the cores and memory they share, the machine's other load) than in the tables above; measured
    # by the profiler (profiler.contention). Empty in files written before it: Cluster.local's core share.
    process_slowdown: dict[int, float] = field(default_factory=dict)
    # the host CPU (None in files written before it was recorded)
    cpu: CpuKind | None = None
    # the optimizer phase's per-tensor loops, timed as the kernel tables are (cost_models.optimizer_step
    # fits its law); empty in older files: the planner then streams ADAM_BYTES_PER_PARAM at the table rate
    optimizer: tuple[OptimizerSample, ...] = ()
    schema_version: int = PROFILE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.device_kind not in ("cpu", "cuda"):
            raise ValueError(f"Profile.device_kind={self.device_kind!r}; expected 'cpu' or 'cuda'")
        if self.launch_overhead_s < 0:
            raise ValueError("Profile.launch_overhead_s is negative")
        if self.host_floor_s is not None and not (self.host_floor_s >= 0 and math.isfinite(self.host_floor_s)):
            raise ValueError(f"Profile.host_floor_s={self.host_floor_s}; it must be a non-negative time")
        bad = {k: v for k, v in self.layer_times.items() if not (v > 0 and math.isfinite(v))}
        bad |= {f"process_slowdown[{n}]": v for n, v in self.process_slowdown.items()
                if not (v > 0 and math.isfinite(v))}
        if bad:
            raise ValueError(f"Profile.layer_times or process_slowdown has non-positive values: {bad}")

    # ---- queries used by the cost models ----
    @property
    def host_overhead_floor_s(self) -> float:
        return self.launch_overhead_s if self.host_floor_s is None else self.host_floor_s

    def gemm_samples(self, dtype: str, layout: str | None = None, *, batched: bool = False) -> list[GemmSample]:
        """Plain GEMM samples (batched ones with batched=True) of `dtype`; of `layout` too when given and
        measured (else every layout)."""
        rows = [g for g in self.gemm if g.dtype == dtype and (g.batch > 1) == batched]
        if layout is not None:
            rows = [g for g in rows if g.layout == layout] or rows
        return rows

    def peak_gemm_flops(self, dtype: str) -> float | None:
        """The best GEMM throughput measured in `dtype`, or None when that dtype was not measured."""
        rates = [g.flops_per_s for g in self.gemm_samples(dtype)]
        return max(rates) if rates else None

    def memory_bandwidth_Bps(self) -> float | None:
        """The best elementwise traffic rate measured (bytes read + written per second)."""
        rates = [e.bytes_per_s for e in self.elementwise]
        return max(rates) if rates else None

    def collective_table(self, op: str, group_size: int) -> list[tuple[int, float]]:
        """(n_bytes, time_s) for `op` over `group_size` local processes, sorted by size."""
        rows = [(c.n_bytes, c.time_s) for c in self.collectives if c.op == op and c.group_size == group_size]
        return sorted(rows)

    @property
    def fingerprint(self) -> str:
        import hashlib

        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def check_matches(self, *, device_name: str | None = None, torch_version: str | None = None,
                      hostname: str | None = None, processor: str | None = None,
                      cpu_count: int | None = None, cpu_model: str | None = None) -> None:
        """Raise ProfileMismatch when this profile was measured elsewhere (any given field differs):
        a hostname alone does not identify a machine (cloud VMs reuse names), so CPU model and count count too
        (`cpu_model`: CpuKind.model_name, compared when the profile recorded it)."""
        wrong = []
        if cpu_model is not None and self.cpu is not None and cpu_model != self.cpu.model_name:
            wrong.append(f"CPU {self.cpu.model_name!r} (here: {cpu_model!r})")
        if processor is not None and processor != self.machine.processor:
            wrong.append(f"processor {self.machine.processor!r} (here: {processor!r})")
        if cpu_count is not None and cpu_count != self.machine.cpu_count:
            wrong.append(f"{self.machine.cpu_count} CPUs (here: {cpu_count})")
        if device_name is not None and device_name != self.device_name:
            wrong.append(f"device {self.device_name!r} (here: {device_name!r})")
        if torch_version is not None and torch_version != self.torch_version:
            wrong.append(f"torch {self.torch_version} (here: {torch_version})")
        if hostname is not None and hostname != self.machine.hostname:
            wrong.append(f"machine {self.machine.hostname!r} (here: {hostname!r})")
        if wrong:
            raise ProfileMismatch(
                f"profile from {self.created} was measured on {', '.join(wrong)}; its timings do not describe "
                "this machine. Re-measure here with `autopar profile --out profile.json` or drop the profile."
            )

    # ---- serialization ----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        version = d.get("schema_version")
        if version != PROFILE_SCHEMA_VERSION:
            raise ProfileMismatch(
                f"profile schema version {version!r}; this cost_models reads version {PROFILE_SCHEMA_VERSION}. "
                "Re-measure with `autopar profile --out profile.json`."
            )
        d = dict(d)
        if d.pop("compute_scale_by_nproc", None):  # written by an earlier autopar's calibration
            raise ProfileMismatch("this profile holds per-process-count compute factors from an earlier "
                                  "`autopar calibrate`, which now fits kernels and host overhead instead; "
                                  "calibrate the uncalibrated profile again with your run records")
        d["machine"] = MachineInfo(**d["machine"])
        if d.get("cpu") is not None:
            d["cpu"] = CpuKind(**{**d["cpu"], "flags": tuple(d["cpu"].get("flags", ()))})
        d["optimizer"] = tuple(OptimizerSample(**o) for o in d.get("optimizer", ()))
        d["gemm"] = tuple(GemmSample(**g) for g in d.get("gemm", ()))
        d["elementwise"] = tuple(ElementwiseSample(**e) for e in d.get("elementwise", ()))
        d["collectives"] = tuple(CollectiveSample(**c) for c in d.get("collectives", ()))
        d["layer_times"] = {str(k): float(v) for k, v in d.get("layer_times", {}).items()}
        d["process_slowdown"] = {int(k): float(v) for k, v in d.get("process_slowdown", {}).items()}
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """A profile file, every field of the expected type and every number finite and in a sane range."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProfileMismatch(f"cannot read profile {path}: {e}; write one with `autopar profile --out {path}`") \
                from e
        if not isinstance(data, dict):
            raise ProfileMismatch(f"profile {path} holds a JSON {type(data).__name__}, not the object `autopar "
                                  "profile` writes; re-measure with `autopar profile --out profile.json`")
        try:
            prof = cls.from_dict(data)
            check_loaded(prof)
        except ProfileMismatch as e:
            raise ProfileMismatch(f"profile {path}: {e}") from e
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileMismatch(f"profile {path} is malformed ({type(e).__name__}: {e}); re-measure with "
                                  "`autopar profile --out profile.json`") from e
        return prof


def scale_profile(profile: Profile, *, compute: float = 1.0, host: float = 1.0,
                  comm: dict[int, float] | None = None, p2p: float = 1.0, note: str = "") -> Profile:
    """`profile` with kernel table times (and the eager-op floor) × `compute`, the host floor × `host`,
    K-rank collective times × comm[K] and point-to-point times × `p2p`. Every prediction is linear in
    these tables, so a factor moves exactly the components priced from them (autopar.calibrate fits the
    factors to runs; Cluster.local applies the measured slowdown of n processes sharing a CPU)."""
    factors = [compute, host, p2p, *(comm or {}).values()]
    if any(not f > 0 for f in factors):
        raise ValueError(f"scale factors must be positive; got compute={compute}, host={host}, p2p={p2p}, "
                         f"comm={comm}")
    comm = comm or {}
    notes = "; ".join(n for n in (profile.notes, note) if n)
    return dataclasses.replace(
        profile,
        gemm=tuple(dataclasses.replace(g, time_s=g.time_s * compute) for g in profile.gemm),
        elementwise=tuple(dataclasses.replace(e, time_s=e.time_s * compute) for e in profile.elementwise),
        launch_overhead_s=profile.launch_overhead_s * compute,
        host_floor_s=profile.host_overhead_floor_s * host,
        layer_times={k: v * compute for k, v in profile.layer_times.items()},
        optimizer=tuple(dataclasses.replace(o, time_s=o.time_s * compute) for o in profile.optimizer),
        collectives=tuple(dataclasses.replace(c, time_s=c.time_s * (p2p if c.op == "p2p" else
                                                                    comm.get(c.group_size, 1.0)))
                          for c in profile.collectives),
        notes=notes)



# Bounds on what a measurement can be, far beyond any device (B200: 2.25 PFLOP/s dense BF16, 8 TB/s HBM;
# NVIDIA HGX B200 datasheet, 2024); a number outside them is a corrupted or hand-edited file, not a machine.
_MAX_FLOP_PER_S = 1e17
_MAX_BYTES_PER_S = 1e14
_MAX_TIME_S = 3600.0


def _positive_time(what: str, t: Any) -> None:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t <= _MAX_TIME_S:
        raise ProfileMismatch(f"{what} = {t!r}; a measured time must be a number of seconds in (0, {_MAX_TIME_S:g}]")


_MAX_COUNT = 2**60  # bytes, CPUs, processes, threads: anything larger is not a machine


def _count(what: str, n: Any, low: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= _MAX_COUNT:
        raise ProfileMismatch(f"{what} = {n!r}; it must be an integer from {low} to 2^60")


def _text(what: str, v: Any, choices: tuple[str, ...] | None = None) -> None:
    if not isinstance(v, str) or (choices is not None and v not in choices):
        raise ProfileMismatch(f"{what} = {v!r}; it must be {'one of ' + str(choices) if choices else 'a string'}")


def _flags(what: str, obj: Any) -> None:
    """Every field whose default is a bool holds a bool (flags added after these checks were written too)."""
    for f in dataclasses.fields(obj):
        if isinstance(f.default, bool) and not isinstance(getattr(obj, f.name), bool):
            raise ProfileMismatch(f"{what}.{f.name} = {getattr(obj, f.name)!r}; it must be true or false")


def check_loaded(p: Profile) -> None:
    """Refuse a profile read from a file whose numbers no measurement could give (ProfileMismatch)."""
    for kind in ("gemm", "elementwise", "collectives", "optimizer"):
        for i, sample in enumerate(getattr(p, kind)):
            _flags(f"{kind}[{i}]", sample)
    m = p.machine
    _count("machine.cpu_count", m.cpu_count, 1)
    _count("machine.ram_bytes", m.ram_bytes, 0)
    for name in ("hostname", "platform", "processor"):
        _text(f"machine.{name}", getattr(m, name))
    for name in ("device_name", "torch_version", "created", "notes"):
        _text(name, getattr(p, name))
    _text("backend", p.backend, ("gloo", "nccl"))
    _text("clock", p.clock, ("wall", "thread"))
    if p.model_name is not None:
        _text("model_name", p.model_name)
    _count("device_count", p.device_count, 1)
    _count("threads_per_process", p.threads_per_process, 1)
    for name in ("launch_overhead_s", "host_floor_s"):
        v = getattr(p, name)
        if v is None and name == "host_floor_s":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1.0:
            raise ProfileMismatch(f"{name} = {v!r}; a per-op floor is a number of seconds in [0, 1]")
    for i, g in enumerate(p.gemm):
        for dim in ("m", "n", "k", "batch"):
            _count(f"gemm[{i}].{dim}", getattr(g, dim), 1)
        _text(f"gemm[{i}].dtype", g.dtype)
        _text(f"gemm[{i}].layout", g.layout, ("nn", "nt", "tn"))
        _positive_time(f"gemm[{i}].time_s", g.time_s)
        if g.flops_per_s > _MAX_FLOP_PER_S:
            raise ProfileMismatch(f"gemm[{i}] ({g.m}x{g.n}x{g.k} {g.dtype} in {g.time_s:g} s) runs at "
                                  f"{g.flops_per_s:.3g} FLOP/s, beyond any device ({_MAX_FLOP_PER_S:g})")
    for i, e in enumerate(p.elementwise):
        _text(f"elementwise[{i}].op", e.op)
        _text(f"elementwise[{i}].dtype", e.dtype)
        _count(f"elementwise[{i}].n_bytes", e.n_bytes, 1)
        _count(f"elementwise[{i}].tensor_bytes", e.tensor_bytes, 0)
        _positive_time(f"elementwise[{i}].time_s", e.time_s)
        if e.bytes_per_s > _MAX_BYTES_PER_S:
            raise ProfileMismatch(f"elementwise[{i}] moves {e.bytes_per_s:.3g} B/s, beyond any memory "
                                  f"({_MAX_BYTES_PER_S:g})")
    for i, c in enumerate(p.collectives):
        _count(f"collectives[{i}].group_size", c.group_size, 2)
        _count(f"collectives[{i}].n_bytes", c.n_bytes, 1)
        _positive_time(f"collectives[{i}].time_s", c.time_s)
        if c.algbw_Bps > _MAX_BYTES_PER_S:
            raise ProfileMismatch(f"collectives[{i}] ({c.op}) moves {c.algbw_Bps:.3g} B/s, beyond any link "
                                  f"({_MAX_BYTES_PER_S:g})")
    for key, t in p.layer_times.items():
        _positive_time(f"layer_times[{key!r}]", t)
    for i, o in enumerate(p.optimizer):
        _text(f"optimizer[{i}].kind", o.kind, OPTIMIZER_LOOPS)
        _text(f"optimizer[{i}].implementation", o.implementation)
        _count(f"optimizer[{i}].tensors", o.tensors, 1)
        _count(f"optimizer[{i}].params", o.params, 1)
        _positive_time(f"optimizer[{i}].time_s", o.time_s)
    if p.cpu is not None:
        for name in ("vendor", "model_name", "torch_isa"):
            _text(f"cpu.{name}", getattr(p.cpu, name))
        for f in p.cpu.flags:
            _text("cpu.flags[]", f)
