"""`autopar report plan.json run.json` and `autopar calibrate run.json --profile P --out P`.

report: the plan's predicted step and breakdown beside what the run measured, the error of each
component, and the components off by more than 25% flagged (autopar.report.run_report).
calibrate: fold measured runs into the profile the next `autopar plan --profile` starts from
(autopar.calibrate says what it adjusts and why that is sound).
"""

from __future__ import annotations

import argparse
import json
import math

from autopar.cli.checks import check_output_path
from autopar.errors import AutoparError, ProfileMismatchError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    r = subparsers.add_parser("report", help="a plan's prediction beside a recorded run",
                              description="Compare a plan's predicted step time and breakdown with a run recorded "
                                          "by `examples/train_gpt.py --plan plan.json --record run.json`.")
    r.add_argument("plan", help="plan.json the run was launched with")
    r.add_argument("run", help="run.json written by --record")
    r.add_argument("--threshold", type=float, default=0.25, help="flag components off by more than this (0.25)")
    r.add_argument("--json", action="store_true", help="print the comparison as JSON")
    r.set_defaults(func=_report)

    c = subparsers.add_parser("calibrate", help="fold recorded runs into a profile",
                              description="Scale the profile's compute and collective tables so that the plans "
                                          "of the given runs would have predicted what the runs measured.")
    c.add_argument("runs", nargs="+", help="run.json files (plans priced with --profile)")
    c.add_argument("--profile", required=True, help="the profile the runs' plans were made with")
    c.add_argument("--out", required=True, help="where to write the calibrated profile (may be --profile)")
    c.add_argument("--json", action="store_true", help="print the fitted factors as JSON")
    c.set_defaults(func=_calibrate)


def _report(args: argparse.Namespace) -> int:
    from autopar.plan import Plan
    from autopar.record import RunRecord
    from autopar.report.run_report import compare, render_text

    if not (math.isfinite(args.threshold) and args.threshold > 0):
        raise AutoparError(f"--threshold {args.threshold}: give a positive fraction, e.g. 0.25 for 25%")
    comparison = compare(Plan.load(args.plan), RunRecord.load(args.run), threshold=args.threshold)
    print(json.dumps(comparison.to_dict(), indent=1) if args.json else render_text(comparison))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import dataclasses

    from autopar.calibrate import calibrate
    from autopar.record import RunRecord
    from cost_models.profile import Profile, ProfileMismatch

    check_output_path(args.out, "--out")
    try:
        profile = Profile.load(args.profile)
    except ProfileMismatch as e:
        raise ProfileMismatchError(str(e)) from e
    records = [RunRecord.load(p) for p in args.runs]
    calibrated, cal = calibrate(records, profile, names=args.runs)
    calibrated.save(args.out)
    if args.json:
        print(json.dumps({**dataclasses.asdict(cal), "out": args.out}, indent=1))
    else:
        print(f"{cal.describe()}\nwritten to {args.out}")
    return 0
