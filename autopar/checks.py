"""The primitives every input check uses, and autopar's global bounds; imports nothing of autopar.

Each object is checked where it is defined (a plan by `Plan.load`, a cluster by `Cluster.from_file`,
planner options by `check_options`, a run record by `RunRecord.load`); checks that relate two objects
live where the two meet (codegen's entry, the CLI command). What they share is here: the bounds, the
type tests that keep `True` from passing as `1`, and one form of message, `where: name = value must be
…; how to fix`, raised as the caller's exception type.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

__all__ = [
    "MAX_DEVICES",
    "MAX_GLOBAL_BATCH",
    "MAX_TOP_K",
    "REL_TOL",
    "is_int",
    "is_real",
    "close",
    "check_number",
    "check_positive_int",
    "check_flags",
]

# The largest world size autopar plans for. The biggest published training runs use ~10^5 GPUs
# (Llama 3 405B: 16,384 H100, Dubey et al. 2024, §3.3); 2^20 leaves room above that and keeps the
# outer search (divisor enumeration over the world size) within seconds.
MAX_DEVICES = 2**20
# The largest global batch, in samples: Llama 3 405B trained on 16M tokens per step (Dubey et al. 2024,
# §3.4.1), 8,192 samples of 2,048 tokens; 2^24 samples is far beyond any published run and keeps the outer
# search's enumeration of micro-batch divisors at ~3 s (1e8 samples took 15 s on this repository's machine).
MAX_GLOBAL_BATCH = 2**24
# Runner-ups a plan keeps; each one can cost the search one more ILP, and a report shows a handful.
MAX_TOP_K = 100
# JSON keeps 17 significant digits; a figure recomputed from a file's others agrees to far better than this
REL_TOL = 1e-6


def is_int(v: Any) -> bool:
    """An integer, not a bool (JSON `true` would otherwise pass as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    """A real number (int or float), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def close(a: float, b: float, rel_tol: float = REL_TOL) -> bool:
    """a and b agree to `rel_tol` of the larger (1e-12 absolute near zero)."""
    return abs(a - b) <= rel_tol * max(abs(a), abs(b), 1e-12)


def _message(where: str, text: str, fix: str) -> str:
    return (f"{where}: " if where else "") + text + (f"; {fix}" if fix else "")


def check_number(name: str, value: Any, *, positive: bool = False, integer: bool = False, high: float | None = None,
                 error: type[Exception] = ValueError, where: str = "", fix: str = "") -> None:
    """`value` is a finite, non-negative (or positive) number (or integer) of at most `high`; otherwise
    `error("where: name = value must be a finite positive integer ≤ high; fix")`."""
    kind = f"finite {'positive' if positive else 'non-negative'} {'integer' if integer else 'number'}"
    ok = is_int(value) if integer else is_real(value) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise error(_message(where, f"{name} = {value!r} must be a {kind}", fix))
    if high is not None and value > high:
        raise error(_message(where, f"{name} = {value:,} exceeds autopar's bound of {high:,}", fix))


def check_positive_int(name: str, value: Any, *, bound: int | None = None,
                       error: type[Exception] = ValueError) -> int:
    """`value` as a positive integer of at most `bound`, or `error` naming `name`, the value and its type."""
    if not is_int(value):
        raise error(f"{name}={value!r} ({type(value).__name__}); it must be a positive integer")
    if value < 1:
        raise error(f"{name}={value}; it must be a positive integer")
    if bound is not None and value > bound:
        raise error(f"{name}={value:,} exceeds autopar's bound of {bound:,}")
    return value


def check_flags(obj: Any, *, error: type[Exception] = ValueError, where: str = "", fix: str = "") -> None:
    """Every field of dataclass `obj` whose default is a bool holds a bool (fields added later too)."""
    for f in dataclasses.fields(obj):
        if isinstance(f.default, bool) and not isinstance(getattr(obj, f.name), bool):
            raise error(_message(where, f"{f.name} = {getattr(obj, f.name)!r} must be true or false", fix))
