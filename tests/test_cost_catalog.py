"""The hardware catalog: complete, sourced, and equal to the datasheet figures docs/design.md §4 quotes."""

import pytest

from cost_models import catalog

REQUIRED_DEVICES = ["v100-sxm2-32gb", "a100-sxm-40gb", "a100-sxm-80gb", "a100-pcie-40gb", "a100-pcie-80gb",
                    "h100-sxm-80gb", "h100-pcie-80gb", "h200-sxm-141gb", "b200-sxm-180gb", "l40s-48gb", "cpu"]
REQUIRED_LINKS = ["pcie4-x16", "pcie5-x16", "nvlink3-nvswitch", "nvlink4-nvswitch", "nvlink5-nvswitch", "ib-hdr",
                  "ib-ndr", "roce-100g", "roce-200g", "roce-400g"]


def test_catalog_has_every_required_part_with_a_source():
    assert set(REQUIRED_DEVICES) <= set(catalog.devices())
    assert set(REQUIRED_LINKS) <= set(catalog.links())
    for name in catalog.devices():
        d = catalog.device(name)
        assert d.source and d.memory_bytes > 0 and d.memory_bandwidth_Bps > 0
    for name in catalog.links():
        link = catalog.link(name)
        assert link.source and "efficiency_source" in link.extra
        assert 0 < link.effective_bandwidth_Bps <= link.bandwidth_Bps


def test_datasheet_numbers_of_design_md():
    assert catalog.device("a100-sxm-80gb").peak_flops_for("bfloat16") == pytest.approx(312e12)
    assert catalog.device("h100-sxm-80gb").peak_flops_for("bf16") == pytest.approx(989e12)
    # NVLink 3/4: 600/900 GB/s bidirectional per GPU → 300/450 GB/s per direction
    assert catalog.link("nvlink3-nvswitch").bandwidth_Bps == pytest.approx(300e9)
    assert catalog.link("nvlink4-nvswitch").bandwidth_Bps == pytest.approx(450e9)
    # IB HDR/NDR: 200/400 Gb/s per port
    assert catalog.link("ib-hdr").bandwidth_Bps == pytest.approx(200e9 / 8)
    assert catalog.link("ib-ndr").bandwidth_Bps == pytest.approx(400e9 / 8)
    assert catalog.device("h200-sxm-141gb").memory_bandwidth_Bps == pytest.approx(4.8e12)


def test_unknown_names_list_the_catalog():
    with pytest.raises(KeyError, match="h100-sxm-80gb"):
        catalog.device("h100")
    with pytest.raises(KeyError, match="ib-ndr"):
        catalog.link("infiniband")


@pytest.mark.parametrize("gpu,mem_gib,expected", [
    ("NVIDIA A100-SXM4-40GB", 40, "a100-sxm-40gb"), ("NVIDIA A100-SXM4-80GB", 80, "a100-sxm-80gb"),
    ("NVIDIA A100 80GB PCIe", 80, "a100-pcie-80gb"), ("NVIDIA H100 80GB HBM3", 80, "h100-sxm-80gb"),
    ("NVIDIA H100 PCIe", 80, "h100-pcie-80gb"), ("NVIDIA H200", 141, "h200-sxm-141gb"),
    ("NVIDIA GeForce RTX 4090", 24, None),
])
def test_match_device(gpu, mem_gib, expected):
    assert catalog.match_device(gpu, mem_gib * 2**30) == expected
