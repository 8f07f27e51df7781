"""`Cluster`: nodes × devices, the device spec and the links inside and between nodes.

    Cluster.preset("dgx-h100", nodes=16)     # 128 GPUs; Cluster.presets() lists the names
    Cluster.from_file("cluster.toml")         # TOML or JSON, docs/design.md §6
    Cluster.local(nproc=None, profile=None)   # this machine: its GPUs, else CPU processes

Every number comes from the cost_models catalog (each with its source) or from a measured `Profile`
of this machine. The cluster hands the cost models what they need: `topology()`, `compute_model()`,
`comm_model()`; `fingerprint` hashes everything that changes a cost, so plans can detect a mismatch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.checks import MAX_DEVICES
from autopar.errors import ClusterSpecError, ProfileMismatchError
from autopar.host import host_from_file, local_host, preset_host

try:  # Python ≥ 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from cost_models import catalog
from cost_models.comm import CommModel, Topology, fit_link
from cost_models.compute import ComputeModel
from cost_models.hardware import DeviceSpec, HostSpec, LinkSpec
from cost_models.profile import Profile, ProfileMismatch, scale_profile

__all__ = ["Cluster", "PRESETS", "BACKENDS"]

BACKENDS = ("nccl", "gloo")

# name → (device, intra-node link, inter-node link, devices per node, source)
PRESETS: dict[str, tuple[str, str, str, int, str]] = {
    "dgx-a100-40gb": ("a100-sxm-40gb", "nvlink3-nvswitch", "ib-hdr", 8,
                      "NVIDIA DGX A100 datasheet: 8x A100 40GB, 6 NVSwitches, 8x ConnectX-6 HDR 200 Gb/s"),
    "dgx-a100-80gb": ("a100-sxm-80gb", "nvlink3-nvswitch", "ib-hdr", 8,
                      "NVIDIA DGX A100 datasheet: 8x A100 80GB, 6 NVSwitches, 8x ConnectX-6 HDR 200 Gb/s"),
    "dgx-h100": ("h100-sxm-80gb", "nvlink4-nvswitch", "ib-ndr", 8,
                 "NVIDIA DGX H100 datasheet: 8x H100 SXM, 4 NVSwitches, 8x ConnectX-7 NDR 400 Gb/s"),
    "hgx-h800": ("h800-sxm-80gb", "nvlink4-h800", "ib-ndr", 8,
                 "DeepSeek-V3 technical report (arXiv 2412.19437) §3.1: nodes of 8 H800 on NVLink/NVSwitch, one "
                 "400 Gb/s InfiniBand NIC per GPU across nodes"),
    "dgx-h200": ("h200-sxm-141gb", "nvlink4-nvswitch", "ib-ndr", 8,
                 "NVIDIA DGX H200 datasheet: 8x H200 SXM, 4 NVSwitches, 8x ConnectX-7 NDR 400 Gb/s"),
    "hgx-b200": ("b200-sxm-180gb", "nvlink5-nvswitch", "ib-ndr", 8,
                 "NVIDIA HGX B200 datasheet: 8x B200, NVLink 5 switch, 400 Gb/s networking per GPU"),
    "pcie-a100-8x": ("a100-pcie-80gb", "pcie4-x16", "roce-100g", 8,
                     "a typical cloud/on-prem server: 8x A100 80GB PCIe Gen4, no NVLink, 100 GbE RoCE per GPU"),
    "pcie-h100-8x": ("h100-pcie-80gb", "pcie5-x16", "roce-200g", 8,
                     "a typical server: 8x H100 PCIe Gen5, no NVLink bridges, 200 GbE RoCE per GPU"),
}

# price_per_gpu_hour: read by `autopar budget` only (autopar.budget); it changes no cost of a plan
_FILE_KEYS = ("name", "nodes", "devices_per_node", "device", "intra_node", "inter_node", "backend", "host",
              "price_per_gpu_hour")
_LINK_KEYS = ("bandwidth_GBps", "latency_us", "efficiency", "efficiency_source", "source", "notes")
_DEVICE_KEYS = ("name", "kind", "memory_GiB", "memory_bandwidth_GBps", "peak_TFLOPs", "source", "notes")


def _local_device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _check_profile(profile: Profile, *, device: DeviceSpec, here: bool) -> None:
    """Refuse a profile measured on another device (or, for Cluster.local, another machine/torch)."""
    import torch

    try:
        if here:
            from cost_models.profiler import machine_info
            from cost_models.profiler.cpu import cpu_kind

            here = machine_info()
            profile.check_matches(device_name=_local_device_name(), torch_version=torch.__version__,
                                  hostname=socket.gethostname(), processor=here.processor, cpu_count=here.cpu_count,
                                  cpu_model=cpu_kind().model_name)
        else:
            measured = "cpu" if profile.device_kind == "cpu" else catalog.match_device(profile.device_name)
            if measured != device.name:
                raise ProfileMismatch(
                    f"profile measured on {profile.device_name!r} cannot price {device.name!r}; pass a profile "
                    f"measured on that device, or none"
                )
    except ProfileMismatch as e:
        raise ProfileMismatchError(str(e)) from e


@dataclass(frozen=True, kw_only=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    backend: str = "nccl"
    profile: Profile | None = None
    host: HostSpec | None = None  # each node's host (autopar.host): what offload plans use; None: offload refused

    def __post_init__(self) -> None:
        for f in ("nodes", "devices_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ClusterSpecError(f"Cluster.{f}={v!r}; it must be a positive integer")
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise ClusterSpecError(f"cluster {self.name!r} has {self.nodes:,} nodes × {self.devices_per_node:,} "
                                   f"devices = {self.nodes * self.devices_per_node:,}; autopar plans for at most "
                                   f"{MAX_DEVICES:,} devices")
        if self.backend not in BACKENDS:
            raise ClusterSpecError(f"Cluster.backend={self.backend!r}; expected one of {BACKENDS}")

    # ---- derived ----
    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def fingerprint(self) -> str:
        payload = self.to_dict()
        payload["profile"] = self.profile.fingerprint if self.profile else None
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def topology(self) -> Topology:
        return Topology(devices_per_node=self.devices_per_node, intra=self.intra_node, inter=self.inter_node)

    def compute_model(self) -> ComputeModel:
        return ComputeModel(self.device, self.profile)

    def comm_model(self) -> CommModel:
        return CommModel(self.topology(), self.profile)

    def check_trains(self, dtype: Any) -> None:
        """Refuse a training dtype (a torch.dtype or its name) the device lists no throughput for, which
        could not be priced; the message names the dtypes it can train in."""
        name = str(dtype).removeprefix("torch.")
        try:
            self.device.peak_flops_for(name)
        except KeyError:
            runs = [d for d in ("float32", "bfloat16", "float16") if d in self.device.peak_flops]
            raise ClusterSpecError(f"the model trains in {name} but device {self.device.name} of cluster "
                                   f"{self.name!r} has no {name} throughput in the catalog; train in "
                                   f"{' or '.join(runs)} (CLI: --dtype)") from None

    def check_precision(self, precision: str) -> None:
        """Refuse a precision policy whose compute dtype the device lists no throughput for (V100: no bf16)."""
        from cost_models.precision import PRECISIONS, policy

        name = policy(precision).compute_dtype
        if name not in self.device.peak_flops:
            ok = [p for p in PRECISIONS if policy(p).compute_dtype in self.device.peak_flops]
            raise ClusterSpecError(f"precision {precision} computes in {name}, but device {self.device.name} of "
                                   f"cluster {self.name!r} has no {name} throughput in the catalog; use precision "
                                   f"{' or '.join(ok)} (CLI: --precision)")

    def __repr__(self) -> str:
        prof = ", profiled" if self.profile else ""
        return (f"Cluster({self.name}: {self.nodes}x{self.devices_per_node} {self.device.name}, "
                f"{self.intra_node.name} | {self.inter_node.name}, {self.backend}{prof})")

    # ---- serialization ----
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["device"] = self.device.to_dict()
        d["intra_node"] = self.intra_node.to_dict()
        d["inter_node"] = self.inter_node.to_dict()
        d["profile"] = self.profile.to_dict() if self.profile else None
        if self.host is None:
            d.pop("host")
        else:
            d["host"] = self.host.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        d = dict(d)
        d["device"] = DeviceSpec.from_dict(d["device"])
        d["intra_node"] = LinkSpec.from_dict(d["intra_node"])
        d["inter_node"] = LinkSpec.from_dict(d["inter_node"])
        d["profile"] = Profile.from_dict(d["profile"]) if d.get("profile") else None
        d["host"] = HostSpec.from_dict(d["host"]) if d.get("host") else None
        return cls(**d)

    # ---- constructors ----
    @staticmethod
    def presets() -> list[str]:
        """Names accepted by Cluster.preset."""
        return list(PRESETS)

    @classmethod
    def preset(cls, name: str, nodes: int = 1, profile: Profile | str | Path | None = None) -> Cluster:
        """A catalogued system; `profile` (measured on that device type) refines its compute and comm."""
        if name not in PRESETS:
            raise ClusterSpecError(f"unknown cluster preset {name!r}; Cluster.presets() lists {', '.join(PRESETS)}")
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise ClusterSpecError(f"nodes={nodes!r} for preset {name!r}; it must be a positive integer")
        dev, intra, inter, per_node, _source = PRESETS[name]
        prof = _load_profile(profile)
        device = catalog.device(dev)
        if prof is not None:
            _check_profile(prof, device=device, here=False)
        return cls(name=name, nodes=nodes, devices_per_node=per_node, device=device,
                   intra_node=catalog.link(intra), inter_node=catalog.link(inter), backend="nccl", profile=prof,
                   host=preset_host(name))

    @classmethod
    def from_file(cls, path: str | Path) -> Cluster:
        """A cluster described in TOML or JSON (docs/design.md §6)."""
        path = Path(path)
        try:
            text = path.read_bytes()
        except OSError as e:
            raise ClusterSpecError(f"cannot read cluster file {path}: {e.strerror}") from e
        try:
            data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text.decode())
        except (ValueError, UnicodeDecodeError) as e:
            raise ClusterSpecError(f"cluster file {path} is not valid {path.suffix.lstrip('.') or 'TOML'}: {e}") \
                from e
        return _cluster_from_mapping(data, where=str(path))

    @classmethod
    def local(cls, nproc: int | None = None, profile: Profile | str | Path | None = None) -> Cluster:
        """This machine: its GPUs (NCCL), else `nproc` CPU processes (gloo).

        nproc defaults to WORLD_SIZE under torchrun, else the GPU count, else 1. On CPU the device is the
        catalog's `cpu` refined by the profile (measured GEMM peak per dtype and memory traffic rate) with
        a fair share of RAM per process, and both links are the α-β fitted to the profiled collectives.
        """
        import torch

        prof = _load_profile(profile)
        cuda = torch.cuda.is_available()
        env_world = os.environ.get("WORLD_SIZE")
        if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
            raise ClusterSpecError(f"nproc={nproc!r}: pass a positive number of processes (or None for the default)")
        n = nproc or (int(env_world) if env_world else (torch.cuda.device_count() if cuda else 1))
        if cuda and n > torch.cuda.device_count():
            raise ClusterSpecError(f"nproc={n}: this machine has {torch.cuda.device_count()} GPUs; pass 1..that")
        if cuda:
            device, intra = _local_gpu_device(torch)
        else:
            device, intra = _local_cpu_device(n, prof), catalog.link("cpu-loopback")
        if prof is not None:
            _check_profile(prof, device=device, here=True)
            if not cuda:
                prof = _cpu_share(prof, n)
            device = _refine_device(device, prof)
            if len(prof.collectives) >= 2:
                intra = fit_link(list(prof.collectives), name=f"{intra.name}-measured",
                                 source=f"α-β fitted to the profiled {prof.backend} all-reduces of {prof.created}")
        return cls(name="local", nodes=1, devices_per_node=n, device=device, intra_node=intra, inter_node=intra,
                   backend="nccl" if cuda else "gloo", profile=prof,
                   host=None if cuda else local_host(device, prof.machine.ram_bytes if prof else None))


def _load_profile(profile: Profile | str | Path | None) -> Profile | None:
    if profile is None or isinstance(profile, Profile):
        return profile
    try:
        return Profile.load(profile)
    except ProfileMismatch as e:
        raise ProfileMismatchError(str(e)) from e


def cpu_slowdown(*, nproc: int, cpu_count: int, profiled_threads: int, run_threads: int) -> float:
    """How much slower a CPU kernel runs in one of `nproc` training processes than in the profiler.

    The profiler ran alone with `profiled_threads` threads; a training process runs `run_threads`
    threads (torchrun sets OMP_NUM_THREADS=1 when nproc > 1) and, when processes outnumber cores, the
    OS time-slices the cores among them. Kernel time is taken as inversely proportional to the cores a
    process gets, min(threads, cores / nproc) (compute-bound GEMMs scale with cores; the rest is left to
    calibration, autopar.calibrate).
    """
    profiled = max(1.0, min(profiled_threads, cpu_count))
    share = min(float(run_threads), cpu_count / nproc)
    return profiled / share


def _run_threads(n: int) -> int:
    """Threads each training process will use: OMP_NUM_THREADS, else torchrun's default (1 when n > 1)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return 1 if n > 1 else (os.cpu_count() or 1)


def _cpu_share(prof: Profile, n: int) -> Profile:
    """The profile as one of n training processes on this CPU sees it (compute tables slowed down): by the
    slowdown the profiler measured with n processes at once (Profile.process_slowdown), else the core
    share `cpu_slowdown`, relative to the largest smaller process count measured when there is one."""
    def share(k: int) -> float:
        return cpu_slowdown(nproc=k, cpu_count=prof.machine.cpu_count or 1,
                            profiled_threads=prof.threads_per_process, run_threads=_run_threads(k))

    measured = prof.process_slowdown
    below = [k for k in measured if k < n]
    if n in measured:
        factor, how = measured[n], "measured with"
    elif below and n > 1:
        factor, how = measured[max(below)] * share(n) / share(max(below)), "measured and core share of"
    else:
        factor, how = share(n), "core share of"
    if factor == 1.0:
        return prof
    return scale_profile(prof, compute=factor, note=f"compute x{factor:.3g}: {how} {n} process(es) on "
                                                    f"{prof.machine.cpu_count} cores")


def _local_gpu_device(torch: Any) -> tuple[DeviceSpec, LinkSpec]:
    name = torch.cuda.get_device_name(0)
    mem = torch.cuda.get_device_properties(0).total_memory
    cat = catalog.match_device(name, mem)
    if cat is None:
        raise ClusterSpecError(f"GPU {name!r} is not in the catalog ({', '.join(catalog.devices())}); describe it "
                               "in a cluster file with an inline [device] table, or refine with a profile")
    device = dataclasses.replace(catalog.device(cat), memory_bytes=int(mem))
    nvlink = {"a100-sxm-40gb": "nvlink3-nvswitch", "a100-sxm-80gb": "nvlink3-nvswitch",
              "h100-sxm-80gb": "nvlink4-nvswitch", "h200-sxm-141gb": "nvlink4-nvswitch",
              "b200-sxm-180gb": "nvlink5-nvswitch"}
    return device, catalog.link(nvlink.get(cat, "pcie4-x16"))


def _local_cpu_device(n: int, prof: Profile | None) -> DeviceSpec:
    base = catalog.device("cpu")
    ram = prof.machine.ram_bytes if prof and prof.machine.ram_bytes else base.memory_bytes
    return dataclasses.replace(base, memory_bytes=int(ram // n),
                               notes=f"{n} CPU process(es) sharing this machine's RAM")


def _refine_device(device: DeviceSpec, prof: Profile) -> DeviceSpec:
    peaks = dict(device.peak_flops)
    for dtype in {g.dtype for g in prof.gemm}:
        peaks[dtype] = prof.peak_gemm_flops(dtype) or peaks.get(dtype, 0.0)
    bw = prof.memory_bandwidth_Bps() or device.memory_bandwidth_Bps
    return dataclasses.replace(device, peak_flops=peaks, memory_bandwidth_Bps=bw,
                               source=f"{device.source}; refined by profile {prof.created} ({prof.device_name})")


# Sane ranges of the numbers a cluster file gives, in its units: an order of magnitude or more beyond
# today's largest parts (B200: 180 GB HBM3e at 8 TB/s, 2.25 PFLOP/s dense BF16; NVLink 5: 900 GB/s per
# direction; NVIDIA HGX B200 datasheet, 2024), so a typo of a unit (GB for GiB, B/s for GB/s) is caught.
_RANGES: dict[str, tuple[float, float]] = {
    "memory_GiB": (1e-3, 1e5),
    "memory_bandwidth_GBps": (1e-3, 1e5),
    "peak_TFLOPs": (1e-6, 1e5),
    "bandwidth_GBps": (1e-6, 1e4),
    "latency_us": (0.0, 1e6),
    "efficiency": (1e-3, 1.0),
    "price_per_gpu_hour": (1e-9, 1e9),  # any currency; positive
}


def _check_number(where: str, key: str, value: Any) -> None:
    lo, hi = _RANGES[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ClusterSpecError(f"{where}: {key} = {value!r} must be a number in [{lo:g}, {hi:g}]")
    if not math.isfinite(value) or not lo <= value <= hi:
        raise ClusterSpecError(f"{where}: {key} = {value!r} is outside the sane range [{lo:g}, {hi:g}]; "
                               f"check the number and its unit ({key.rsplit('_', 1)[-1]})")


def _check_device_table(dev: dict[str, Any], where: str) -> None:
    for key in ("memory_GiB", "memory_bandwidth_GBps"):
        if key in dev:
            _check_number(f"{where}: [device]", key, dev[key])
    peaks = dev.get("peak_TFLOPs")
    if "peak_TFLOPs" in dev:
        if not isinstance(peaks, dict) or not peaks:
            raise ClusterSpecError(f"{where}: [device] peak_TFLOPs = {peaks!r} must be a table of dtype → TFLOP/s, "
                                   "e.g. {{ bfloat16 = 312, float32 = 19.5 }}")
        for dtype, v in peaks.items():
            _check_number(f"{where}: [device] peak_TFLOPs.{dtype}", "peak_TFLOPs", v)
    if "kind" in dev and dev["kind"] not in ("gpu", "cpu"):
        raise ClusterSpecError(f"{where}: [device] kind = {dev['kind']!r}; expected 'gpu' or 'cpu'")
    for key in ("name", "source", "notes"):
        if key in dev and not isinstance(dev[key], str):
            raise ClusterSpecError(f"{where}: [device] {key} = {dev[key]!r} must be a string")


def _require(data: dict[str, Any], key: str, where: str, kind: type, hint: str) -> Any:
    if key not in data:
        raise ClusterSpecError(f"{where}: missing field {key!r} ({hint})")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ClusterSpecError(f"{where}: field {key!r} = {value!r} must be {hint}")
    return value


def _link_field(data: dict[str, Any], key: str, where: str) -> LinkSpec:
    value = data.get(key)
    hint = f"a catalog link name ({', '.join(catalog.links())}) or a table with bandwidth_GBps and latency_us"
    if isinstance(value, str):
        if value not in catalog.links():
            raise ClusterSpecError(f"{where}: {key} = {value!r} is not a catalog link; use {hint}")
        return catalog.link(value)
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(_LINK_KEYS))
        if unknown:
            raise ClusterSpecError(f"{where}: [{key}] has unknown field(s) {unknown}; accepted: {list(_LINK_KEYS)}")
        for k in ("bandwidth_GBps", "latency_us", "efficiency"):
            if k in value:
                _check_number(f"{where}: [{key}]", k, value[k])
        try:
            return catalog.link_from_table(f"{data.get('name', 'cluster')}-{key}",
                                           {"source": f"cluster file {where}", **value})
        except (ValueError, TypeError) as e:
            raise ClusterSpecError(f"{where}: [{key}] {e}; expected {hint}") from e
    raise ClusterSpecError(f"{where}: missing or invalid {key!r}; expected {hint}")


def _cluster_from_mapping(data: Any, where: str) -> Cluster:
    if not isinstance(data, dict):
        kind = {type(None): "null", list: "a list", str: "a string", bool: "a boolean"}.get(type(data), "a number")
        shown = "" if data is None else f" ({json.dumps(data)[:40]})"
        raise ClusterSpecError(f"{where} holds {kind}{shown}; a cluster file "
                               f"is one table/object with fields {list(_FILE_KEYS)}")
    unknown = sorted(set(data) - set(_FILE_KEYS))
    if unknown:
        raise ClusterSpecError(f"{where}: unknown field(s) {unknown}; accepted fields are {list(_FILE_KEYS)}")
    nodes = _require(data, "nodes", where, int, "a positive integer")
    if "price_per_gpu_hour" in data:
        _check_number(where, "price_per_gpu_hour", data["price_per_gpu_hour"])
    per_node = _require(data, "devices_per_node", where, int, "a positive integer")
    if nodes < 1 or per_node < 1:
        raise ClusterSpecError(f"{where}: nodes={nodes} and devices_per_node={per_node} must be ≥ 1")
    dev = data.get("device")
    if isinstance(dev, str):
        if dev not in catalog.devices():
            raise ClusterSpecError(f"{where}: device = {dev!r} is not in the catalog; accepted names: "
                                   f"{', '.join(catalog.devices())}, or an inline [device] table")
        device = catalog.device(dev)
    elif isinstance(dev, dict):
        unknown = sorted(set(dev) - set(_DEVICE_KEYS))
        if unknown:
            raise ClusterSpecError(f"{where}: [device] has unknown field(s) {unknown}; accepted: {list(_DEVICE_KEYS)}")
        _check_device_table(dev, where)
        try:
            device = catalog.device_from_table(str(dev.get("name", "custom")), {"source": f"cluster file {where}",
                                                                                **dev})
        except (ValueError, TypeError, AttributeError) as e:
            raise ClusterSpecError(f"{where}: [device] {e}") from e
    else:
        raise ClusterSpecError(f"{where}: missing or invalid 'device'; expected a catalog name "
                               f"({', '.join(catalog.devices())}) or a table with memory_GiB, "
                               "memory_bandwidth_GBps, peak_TFLOPs and source")
    if "name" in data and (not isinstance(data["name"], str) or not data["name"]):
        raise ClusterSpecError(f"{where}: name = {data['name']!r} must be a non-empty string")
    if nodes * per_node > MAX_DEVICES:
        raise ClusterSpecError(f"{where}: nodes × devices_per_node = {nodes:,} × {per_node:,} = "
                               f"{nodes * per_node:,} devices; autopar plans for at most {MAX_DEVICES:,}")
    backend = data.get("backend", "gloo" if device.kind == "cpu" else "nccl")
    if backend not in BACKENDS:
        raise ClusterSpecError(f"{where}: backend = {backend!r}; accepted values: {', '.join(BACKENDS)}")
    intra = _link_field(data, "intra_node", where)
    inter = _link_field(data, "inter_node", where) if nodes > 1 or "inter_node" in data else intra
    host = host_from_file(data["host"], where) if "host" in data else None
    return Cluster(name=str(data.get("name", Path(where).stem)), nodes=nodes, devices_per_node=per_node,
                   device=device, intra_node=intra, inter_node=inter, backend=backend, host=host)
