"""How far the cost model's step time has been off on published runs like a given layout: an error band.

The bands are data (`catalog/error_bands.toml`), derived by `python benchmarks/published_runs.py
--write-bands` from the model's residuals on the published runs in `benchmarks/data/published_runs.toml`,
grouped by parallelism kind and device family. Leave-one-source-out validation (benchmarks/loso.py) checks
that a band derived without a source covers that source's runs. A band is a ratio: the published step time
fell within predicted · [1 + lo, 1 + hi] on (most of) the runs of its kind.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["ErrorBand", "KINDS", "layout_kind", "device_family", "error_band", "BANDS_FILE"]

BANDS_FILE = Path(__file__).parent / "catalog" / "error_bands.toml"
KINDS = ("pipeline", "fsdp", "tensor", "data")
ANY = "*"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ErrorBand:
    """Published step time ∈ predicted · [1 + lo, 1 + hi] on `runs` published runs matched at `basis`."""

    lo: float
    hi: float
    runs: int
    basis: str  # what the runs have in common with the layout, e.g. "fsdp on a100"

    def __post_init__(self) -> None:
        if not (-1.0 < self.lo <= self.hi) or self.runs < 1:
            raise ValueError(f"error band lo={self.lo}, hi={self.hi}, runs={self.runs}: need −1 < lo ≤ hi, runs ≥ 1")


def layout_kind(*, tp: int, pp: int, zero_stage: int) -> str:
    """The kind of parallelism that dominates a layout's step: pipelines (their bubble and p2p), fully
    sharded data parallelism (its per-layer gathers and reduce-scatters), tensor parallelism (its per-layer
    all-reduces), or plain data parallelism."""
    if pp > 1:
        return "pipeline"
    if zero_stage == 3:
        return "fsdp"
    if tp > 1:
        return "tensor"
    return "data"


def device_family(device_name: str) -> str:
    """"a100" for "a100-sxm-80gb": runs on one family share clocks, power limits and kernels."""
    return device_name.split("-", 1)[0].lower()


@functools.cache
def _bands(path: Path = BANDS_FILE) -> dict[tuple[str, str], ErrorBand]:
    if not path.exists():
        return {}
    doc = tomllib.loads(path.read_text())
    return {(b["kind"], b["hardware"]): ErrorBand(lo=float(b["lo"]), hi=float(b["hi"]), runs=int(b["runs"]),
                                                 basis=str(b["basis"])) for b in doc.get("band", [])}


def error_band(*, kind: str, hardware: str) -> ErrorBand | None:
    """The band of the runs most like the layout: of its kind on its device family, else of its kind on any
    hardware, else of every run; None when no bands were derived."""
    if kind not in KINDS:
        raise ValueError(f"unknown layout kind {kind!r}; expected one of {KINDS}")
    bands = _bands()
    for key in ((kind, hardware), (kind, ANY), (ANY, ANY)):
        if key in bands:
            return bands[key]
    return None
