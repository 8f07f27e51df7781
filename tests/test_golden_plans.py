"""Golden plans: the whole Plan JSON of gpt3-175b on 1,024 A100, llama3-70b on 512 H100 and llama3-405b on
16,384 H100 is identical, character for character, to the files in tests/golden/ (the solver's wall-clock
fields zeroed). A refactor that moves one bit of one predicted figure fails here. When a change is meant to
move plans, regenerate with `python tests/golden/regen.py` and say why in the commit message.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

_spec = importlib.util.spec_from_file_location("golden_regen", Path(__file__).parent / "golden" / "regen.py")
regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen)


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two JSON values first differ, as a path, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'golden' if k in a else 'new plan'}"
            if a[k] != b[k]:
                return _first_difference(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items in golden, {len(b)} in the new plan"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path}: golden {a!r}, new plan {b!r}"


@pytest.mark.parametrize("name", list(regen.CASES))
def test_plan_matches_golden(name: str) -> None:
    golden = regen.golden_path(name).read_text()
    new = regen.plan_text(name)
    if new != golden:
        where = _first_difference(json.loads(golden), json.loads(new)) if json.loads(golden) != json.loads(new) \
            else "same values, different text"
        pytest.fail(f"the plan of {name} differs from tests/golden/{name}.json at {where}; if the change is meant "
                    "to move plans, run `python tests/golden/regen.py` and say why in the commit message")


def test_golden_solver_timing_fields_are_the_only_ones_zeroed() -> None:
    """The golden files zero wall-clock fields only, so every figure of the answer is compared."""
    d = json.loads(regen.golden_path("llama3-405b").read_text())
    assert {k for k, v in d["solver"].items() if v == 0.0 and k != "gap"} == set(regen.TIMING_FIELDS)
    assert d["solver"]["ilps_solved"] >= 1 and d["estimate"]["step_time_s"] > 0
