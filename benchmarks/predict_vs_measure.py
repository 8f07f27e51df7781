"""Predicted vs measured step time of a small GPT over several real layouts on this machine (gloo, CPU).

    python benchmarks/predict_vs_measure.py [--profile profile.json] [--steps 6] [--out-dir bench_runs]

For each layout (DP, ZeRO-3, TP, PP 1F1B, PP + TP, pp × dp × tp, over 2–8 processes) the planner prices
it with every field pinned (autopar.plan with PlannerOptions), the plan runs for real under torchrun
(examples/train_gpt.py --record), and the script prints the predicted step time, the measured median
and the error. Then one calibration pass (autopar.calibrate, fitted on these same runs) re-prices
every layout, and the Spearman rank correlation of predicted and measured is printed before and after.
Finally the unpinned planner, given Cluster.local() and the calibrated profile, picks a layout for the
world size of the fastest measured one; its measured time is compared with the fastest.

Without --profile the machine is profiled first (quick sweep, collectives over 8 processes, ~1 min).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import autopar  # noqa: E402
from autopar.calibrate import calibrate  # noqa: E402
from autopar.cluster import Cluster  # noqa: E402
from autopar.config import PlannerOptions  # noqa: E402
from autopar.record import RunRecord  # noqa: E402
from cost_models.profile import Profile  # noqa: E402

MODEL, SEQ_LEN, BATCH = "gpt-tiny", 128, 8


@dataclass(frozen=True, kw_only=True)
class Layout:
    name: str
    nproc: int
    options: dict


LAYOUTS = (
    Layout(name="dp", nproc=2, options=dict(tp=1, pp=1, dp=2, zero_stage=0)),
    Layout(name="zero3", nproc=2, options=dict(tp=1, pp=1, dp=2, zero_stage=3)),
    Layout(name="tp", nproc=2, options=dict(tp=2, pp=1, dp=1, sequence_parallel=False)),
    Layout(name="pp-1f1b", nproc=2, options=dict(tp=1, pp=2, dp=1, schedule="1f1b", num_microbatches=4)),
    Layout(name="dp4-zero1", nproc=4, options=dict(tp=1, pp=1, dp=4, zero_stage=1)),
    Layout(name="pp+tp", nproc=4, options=dict(tp=2, pp=2, dp=1, schedule="1f1b", num_microbatches=4,
                                               sequence_parallel=False)),
    Layout(name="pp*dp*tp", nproc=8, options=dict(tp=2, pp=2, dp=2, zero_stage=0, schedule="1f1b",
                                                  num_microbatches=2, sequence_parallel=False)),
)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's ρ: Pearson correlation of the ranks (ties get their average rank)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def run_plan(plan_path: Path, record_path: Path, nproc: int, steps: int, warmup: int) -> RunRecord:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(29600 + nproc), str(ROOT / "examples" / "train_gpt.py"), "--model", MODEL, "--seq-len", str(SEQ_LEN),
           "--global-batch-size", str(BATCH), "--steps", str(steps), "--warmup", str(warmup),
           "--plan", str(plan_path), "--record", str(record_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return RunRecord.load(record_path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="profile.json of this machine (default: measure one)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out-dir", default="bench_runs")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    if args.profile and Path(args.profile).exists():
        profile = Profile.load(args.profile)
    else:
        from cost_models.profiler import profile_machine

        print("profiling this machine (quick sweep, 8 processes) ...", flush=True)
        profile = profile_machine(nproc=8, quick=True)
        profile.save(out / "profile.json")
    from train_gpt import build_model

    model, example = build_model(MODEL, SEQ_LEN, "meta")
    graph = autopar.capture(model, example)

    rows = []
    for lay in LAYOUTS:
        cluster = Cluster.local(nproc=lay.nproc, profile=profile)
        try:
            plan = autopar.plan(graph, cluster, global_batch_size=BATCH,
                                options=PlannerOptions(**lay.options, top_k=0))
        except (RuntimeError, autopar.AutoparError) as e:
            print(f"{lay.name:<10} planner failed: {e}", flush=True)
            continue
        plan_path, rec_path = out / f"plan_{lay.name}.json", out / f"run_{lay.name}.json"
        plan.save(plan_path)
        t0 = time.perf_counter()
        try:
            record = run_plan(plan_path, rec_path, lay.nproc, args.steps, args.warmup)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"{lay.name:<10} run failed: {e}", flush=True)
            continue
        rows.append((lay, plan, record))
        print(f"{lay.name:<10} n={lay.nproc} {plan.config}: predicted {plan.estimate.step_time_s * 1e3:7.1f} ms, "
              f"measured {record.measured_step_time_s * 1e3:7.1f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
    if len(rows) < 2:
        print("fewer than two layouts ran; nothing to compare")
        return 1

    calibrated, cal = calibrate([r for _, _, r in rows], profile)
    calibrated.save(out / "profile.calibrated.json")
    print(f"\n{cal.describe()}\n")
    print(f"{'layout':<11}{'n':>2}  {'predicted':>10}{'calibrated':>11}{'measured':>10}{'error':>9}{'cal. error':>11}")
    raw, cal_pred, meas = [], [], []
    for lay, plan, record in rows:
        est = autopar.estimate(graph, Cluster.local(nproc=lay.nproc, profile=calibrated), plan.config,
                               global_batch_size=BATCH)
        p0, p1, m = plan.estimate.step_time_s, est.step_time_s, record.measured_step_time_s
        raw.append(p0)
        cal_pred.append(p1)
        meas.append(m)
        print(f"{lay.name:<11}{lay.nproc:>2}  {p0 * 1e3:8.1f}ms{p1 * 1e3:9.1f}ms{m * 1e3:8.1f}ms"
              f"{(p0 - m) / m * 100:+8.1f}%{(p1 - m) / m * 100:+10.1f}%")
    worst = max(abs(p - m) / m for p, m in zip(cal_pred, meas, strict=True))
    print(f"\nSpearman rank correlation predicted vs measured: {spearman(raw, meas):.3f} before calibration, "
          f"{spearman(cal_pred, meas):.3f} after; worst calibrated error {worst * 100:.1f}%")

    fastest = min(rows, key=lambda r: r[2].measured_step_time_s)
    n = fastest[0].nproc
    chosen = autopar.plan(graph, Cluster.local(nproc=n, profile=calibrated), global_batch_size=BATCH,
                          options=PlannerOptions(top_k=0))
    chosen_path = out / "plan_chosen.json"
    chosen.save(chosen_path)
    rec = run_plan(chosen_path, out / "run_chosen.json", n, args.steps, args.warmup)
    ratio = rec.measured_step_time_s / fastest[2].measured_step_time_s
    print(f"planner's choice on {n} processes: {chosen.config}, measured {rec.measured_step_time_s * 1e3:.1f} ms; "
          f"fastest measured layout {fastest[0].name} {fastest[2].measured_step_time_s * 1e3:.1f} ms "
          f"(ratio {ratio:.2f})")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
