"""The error band of a layout: how far the cost model has been off on published runs like it.

Bands come from published GPU runs priced on datasheet numbers (cost_models.error_band), so a layout priced
from a measured profile, or on a device that is not a GPU, has none: its uncertainty is that of the profile,
which `autopar report` and `autopar calibrate` measure on the machine itself.
"""

from __future__ import annotations

from autopar.planner.costs import CostModel
from cost_models.error_band import ErrorBand, device_family, error_band, layout_kind

__all__ = ["layout_band", "pessimism"]


def layout_band(costs: CostModel, *, tp: int, pp: int, zero_stage: int) -> ErrorBand | None:
    if costs.compute.model.profile is not None or costs.device.kind != "gpu":
        return None
    return error_band(kind=layout_kind(tp=tp, pp=pp, zero_stage=zero_stage), hardware=device_family(costs.device.name))


def pessimism(costs: CostModel, *, tp: int, pp: int, zero_stage: int) -> float:
    """The factor from a layout's modelled step time to the slow end of its band (1 without a band)."""
    band = layout_band(costs, tp=tp, pp=pp, zero_stage=zero_stage)
    return 1.0 if band is None else 1.0 + band.hi
