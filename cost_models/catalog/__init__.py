"""The hardware catalog: device and link specs read from the TOML files beside this module.

    from cost_models.catalog import device, link, devices, links
    device("h100-sxm-80gb").peak_flops_for("bfloat16")   # 989e12

The TOML files hold datasheet units (GiB, GB/s, TFLOP/s, µs) and a `source` per entry; this module
converts them to the SI fields of DeviceSpec / LinkSpec (bytes, B/s, FLOP/s, s).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from cost_models.hardware import DeviceSpec, HostSpec, LinkSpec

try:  # Python ≥ 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["device", "link", "host", "devices", "links", "hosts", "device_from_table", "link_from_table",
           "host_from_table", "match_device", "CATALOG_DIR"]

CATALOG_DIR = Path(__file__).parent
GiB = 1024**3


def device_from_table(name: str, t: dict[str, Any]) -> DeviceSpec:
    """A DeviceSpec from a catalog-style table (memory_GiB, memory_bandwidth_GBps, peak_TFLOPs, source)."""
    required = ("memory_GiB", "memory_bandwidth_GBps", "peak_TFLOPs", "source")
    missing = [k for k in required if k not in t]
    if missing:
        raise ValueError(f"device {name!r} lacks {missing}; a device table needs {list(required)}")
    return DeviceSpec(
        name=name,
        kind=str(t.get("kind", "gpu")),
        memory_bytes=int(float(t["memory_GiB"]) * GiB),
        memory_bandwidth_Bps=float(t["memory_bandwidth_GBps"]) * 1e9,
        peak_flops={str(k): float(v) * 1e12 for k, v in t["peak_TFLOPs"].items()},
        source=str(t["source"]),
        notes=str(t.get("notes", "")),
    )


def link_from_table(name: str, t: dict[str, Any]) -> LinkSpec:
    """A LinkSpec from a catalog-style table (bandwidth_GBps, latency_us, source, optional efficiency)."""
    missing = [k for k in ("bandwidth_GBps", "latency_us") if k not in t]
    if missing:
        raise ValueError(f"link {name!r} lacks {missing}; a link table needs bandwidth_GBps and latency_us")
    extra = {k: t[k] for k in ("efficiency", "efficiency_source") if k in t}
    return LinkSpec(
        name=name,
        bandwidth_Bps=float(t["bandwidth_GBps"]) * 1e9,
        latency_s=float(t["latency_us"]) * 1e-6,
        source=str(t.get("source", "user cluster file")),
        notes=str(t.get("notes", "")),
        extra=extra,
    )


def host_from_table(name: str, t: dict[str, Any]) -> HostSpec:
    """A HostSpec from a catalog-style table (memory_GiB, memory_bandwidth_GBps, cpu_cores, device_link, source);
    device_link is a catalog link name or an inline link table."""
    required = ("memory_GiB", "memory_bandwidth_GBps", "cpu_cores", "device_link", "source")
    missing = [k for k in required if k not in t]
    if missing:
        raise ValueError(f"host {name!r} lacks {missing}; a host table needs {list(required)}")
    dl = t["device_link"]
    device_link = link(dl) if isinstance(dl, str) else link_from_table(f"{name}-device-link", dl)
    return HostSpec(name=name, memory_bytes=int(float(t["memory_GiB"]) * GiB),
                    memory_bandwidth_Bps=float(t["memory_bandwidth_GBps"]) * 1e9, cpu_cores=int(t["cpu_cores"]),
                    device_link=device_link, source=str(t["source"]))


@functools.cache
def _load(kind: str) -> dict[str, Any]:
    with open(CATALOG_DIR / f"{kind}.toml", "rb") as f:
        return tomllib.load(f)


def devices() -> list[str]:
    """Names of the catalogued devices."""
    return list(_load("devices"))


def links() -> list[str]:
    """Names of the catalogued links."""
    return list(_load("links"))


def hosts() -> list[str]:
    """Names of the catalogued hosts (the cluster presets' nodes)."""
    return list(_load("hosts"))


def host(name: str) -> HostSpec:
    table = _load("hosts")
    if name not in table:
        raise KeyError(f"unknown host {name!r}; the catalog has {', '.join(table)}")
    return host_from_table(name, table[name])


def device(name: str) -> DeviceSpec:
    table = _load("devices")
    if name not in table:
        raise KeyError(f"unknown device {name!r}; the catalog has {', '.join(table)}")
    return device_from_table(name, table[name])


def link(name: str) -> LinkSpec:
    table = _load("links")
    if name not in table:
        raise KeyError(f"unknown link {name!r}; the catalog has {', '.join(table)}")
    return link_from_table(name, table[name])


def match_device(gpu_name: str, memory_bytes: int | None = None) -> str | None:
    """The catalog name for a CUDA device name such as "NVIDIA A100-SXM4-80GB" (torch.cuda.get_device_name),
    or None when the catalog has no such part."""
    n = gpu_name.lower().replace(" ", "-")
    big = memory_bytes is not None and memory_bytes > 50 * GiB
    pcie = "pcie" in n or "nvl" in n
    if "h200" in n:
        return "h200-sxm-141gb"
    if "b200" in n:
        return "b200-sxm-180gb"
    if "h100" in n:
        return "h100-pcie-80gb" if pcie else "h100-sxm-80gb"
    if "a100" in n:
        size = "80gb" if ("80gb" in n or big) else "40gb"
        return f"a100-{'pcie' if pcie else 'sxm'}-{size}"
    if "v100" in n:
        return "v100-sxm2-32gb"
    if "l40s" in n:
        return "l40s-48gb"
    return None
