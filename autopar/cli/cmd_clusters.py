"""`autopar clusters`: the cluster presets, with their device and link numbers and sources."""

from __future__ import annotations

import argparse
import json

from autopar.cluster import PRESETS, Cluster


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("clusters", help="list the cluster presets",
                              description="List the presets accepted by --cluster and Cluster.preset().")
    p.add_argument("--json", action="store_true", help="print the presets as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = []
    for name in Cluster.presets():
        c = Cluster.preset(name)
        rows.append({
            "name": name,
            "device": c.device.name,
            "devices_per_node": c.devices_per_node,
            "bf16_TFLOPs": c.device.peak_flops.get("bfloat16", c.device.peak_flops.get("float16", 0.0)) / 1e12,
            "memory_GiB": c.device.memory_bytes / 2**30,
            "intra_node": c.intra_node.name,
            "intra_GBps": c.intra_node.bandwidth_Bps / 1e9,
            "inter_node": c.inter_node.name,
            "inter_GBps": c.inter_node.bandwidth_Bps / 1e9,
            "fp8_TFLOPs": c.device.peak_flops.get("fp8", 0.0) / 1e12,
            "host_memory_GiB": c.host.memory_bytes / 2**30 if c.host else None,
            "host_link": c.host.device_link.name if c.host else None,
            "source": PRESETS[name][4],
            "host_source": c.host.source if c.host else None,
        })
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    header = f"{'preset':<15}{'device':<17}{'/node':>6}{'bf16 TF/s':>10}{'fp8 TF/s':>9}{'mem GiB':>9}  " \
             f"{'intra-node (GB/s/dir)':<24}{'inter-node (GB/s/dir)':<22}{'host GiB, link':<20}"
    print(header)
    for r in rows:
        intra = f"{r['intra_node']} {r['intra_GBps']:.0f}"
        inter = f"{r['inter_node']} {r['inter_GBps']:.1f}"
        fp8 = f"{r['fp8_TFLOPs']:.0f}" if r["fp8_TFLOPs"] else "-"
        host = f"{r['host_memory_GiB']:.0f}, {r['host_link']}" if r["host_memory_GiB"] else "-"
        print(f"{r['name']:<15}{r['device']:<17}{r['devices_per_node']:>6}{r['bf16_TFLOPs']:>10.0f}{fp8:>9}"
              f"{r['memory_GiB']:>9.0f}  {intra:<24}{inter:<22}{host:<20}")
    print("\nUse: autopar plan MODEL --cluster NAME --nodes N; numbers and sources: cost_models/catalog/*.toml")
    return 0
