"""The host of each node (`Cluster.host`): the memory and bandwidth offload plans use.

Presets take their node's host from the catalog (cost_models/catalog/hosts.toml, each with its source);
a cluster file describes its own in a `[host]` table; `Cluster.local()` reads this machine (its RAM and
core count; the profile's streaming rate, or the catalog's CPU, for its memory bandwidth; on a CPU-only
machine host and device share that memory, so a host copy is a memcpy; a GPU machine's host is not
measured and needs a cluster file to plan offload).
"""

from __future__ import annotations

import os
from typing import Any

from autopar.errors import ClusterSpecError
from cost_models import catalog
from cost_models.hardware import DeviceSpec, HostSpec, LinkSpec

__all__ = ["HOST_KEYS", "preset_host", "host_from_file", "local_host"]

HOST_KEYS = ("memory_GiB", "memory_bandwidth_GBps", "cpu_cores", "device_link", "source")
_RANGES = {"memory_GiB": (1e-3, 1e6), "memory_bandwidth_GBps": (1e-3, 1e5), "cpu_cores": (1, 1e5)}


def preset_host(preset: str) -> HostSpec | None:
    """The catalog's host of a preset's node, or None where the catalog has none."""
    return catalog.host(preset) if preset in catalog.hosts() else None


def host_from_file(table: Any, where: str) -> HostSpec:
    """A cluster file's `[host]` table, checked field by field."""
    if not isinstance(table, dict):
        raise ClusterSpecError(f"{where}: [host] must be a table with {list(HOST_KEYS)}")
    unknown = sorted(set(table) - set(HOST_KEYS))
    if unknown:
        raise ClusterSpecError(f"{where}: [host] has unknown field(s) {unknown}; accepted: {list(HOST_KEYS)}")
    missing = [k for k in HOST_KEYS[:4] if k not in table]
    if missing:
        raise ClusterSpecError(f"{where}: [host] lacks {missing}; e.g. memory_GiB = 2048, memory_bandwidth_GBps = "
                               "614.4, cpu_cores = 112, device_link = \"pcie5-x16\" (per node; the link per device)")
    for key, (lo, hi) in _RANGES.items():
        v = table[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
            raise ClusterSpecError(f"{where}: [host] {key} = {v!r} must be a number in [{lo:g}, {hi:g}] "
                                   f"(per node; check its unit)")
    link = table["device_link"]
    if isinstance(link, str) and link not in catalog.links():
        raise ClusterSpecError(f"{where}: [host] device_link = {link!r} is not a catalog link "
                               f"({', '.join(catalog.links())}) nor a table with bandwidth_GBps and latency_us")
    try:
        return catalog.host_from_table("host", {"source": f"cluster file {where}", **table,
                                                "cpu_cores": int(table["cpu_cores"])})
    except (ValueError, TypeError) as e:
        raise ClusterSpecError(f"{where}: [host] {e}") from e


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: the catalog CPU's memory
        return catalog.device("cpu").memory_bytes


def local_host(device: DeviceSpec, ram_bytes: int | None = None) -> HostSpec | None:
    """This CPU-only machine as its own host: host and device share one memory, so a copy to the host is a copy
    within it, at the device's memory bandwidth. None on a GPU machine: its host's DRAM bandwidth and links
    are not measured here; describe them in a cluster file's [host] table to plan offload."""
    if device.kind != "cpu":
        return None
    link = LinkSpec(name="host-memcpy", bandwidth_Bps=device.memory_bandwidth_Bps, latency_s=0.0,
                    source="CPU-only: host and device share memory; a copy runs at the device's memory bandwidth")
    return HostSpec(name="local", memory_bytes=ram_bytes or _ram_bytes(),
                    memory_bandwidth_Bps=device.memory_bandwidth_Bps, cpu_cores=os.cpu_count() or 1, device_link=link,
                    source=f"this machine: RAM from sysconf, memory bandwidth of its device ({device.source})")
