"""Predicted vs measured step time of a small GPT over several real layouts on this machine (gloo, CPU).

    python benchmarks/predict_vs_measure.py [--profile profile.json] [--rounds 2] [--steps 8] [--max-nproc 4]

Each layout (DP, ZeRO-3, TP, PP 1F1B, DP4 ZeRO-1, PP + TP over 2–4 processes; pp × dp × tp on 8 with
--max-nproc 8) is priced by the planner with every field pinned (autopar.plan with PlannerOptions) and
run for real under torchrun (examples/train_gpt.py --record). The layouts run interleaved, round after
round (A B C … A B C …), so that load from other work on a shared machine falls on all of them alike;
the load average is printed beside every run. Round 1 is the calibration set: one pass of
autopar.calibrate is fitted on it alone, and every prediction, raw and calibrated, is compared with the
median of the later rounds (out-of-sample; with --rounds 1 the comparison is in-sample and says so).
Then the Spearman rank correlation, and the planner's own choice: given Cluster.local() and the
calibrated profile, unpinned, for the process count of the fastest measured layout; it is run
alternately with that layout (ABAB).

Without --profile the machine is profiled first, as `autopar profile gpt-tiny --seq-len 128 --quick
--nproc N` does for the largest process count N of the layouts (kernels with the training processes'
threads, the model's layers and their slowdown with 2..N processes at once, collectives reached from
compute; under two minutes). The uncalibrated errors are that profile's
own prediction of this machine; the calibrated ones after one pass of `autopar calibrate` on round 1.
The CPU model (lscpu) and the load average are printed with the figures.
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


def load_avg() -> str:
    return "load {:.1f}/{:.1f}".format(*os.getloadavg()[:2])


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


def cpu_model() -> str:
    """The CPU's model name as lscpu prints it (the README quotes figures with it)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', 'unknown CPU').strip()}, {os.cpu_count()} vCPUs"


def measure_profile(out: Path, nproc: int) -> Profile:
    from autopar.profiling import profile_model

    print(f"profiling this machine as `autopar profile {MODEL} --seq-len {SEQ_LEN} --nproc {nproc} --quick` ...",
          flush=True)
    profile = profile_model(MODEL, seq_len=SEQ_LEN, nproc=nproc, quick=True)
    profile.save(out / "profile.json")
    print(f"  {profile.notes}; kernels with n processes at once: "
          + ", ".join(f"{n}: x{f:.2f}" for n, f in sorted(profile.process_slowdown.items())), flush=True)
    return profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="profile.json of this machine (default: measure one)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every layout; round 1 calibrates (default 2)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out-dir", default="bench_runs")
    ap.add_argument("--only", default=None, help="comma-separated layout names (default: all)")
    ap.add_argument("--max-nproc", type=int, default=4,
                    help="leave out layouts on more processes (default 4; the 8-process layout needs --max-nproc 8)")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    layouts = [lay for lay in LAYOUTS if (not args.only or lay.name in args.only.split(","))
               and lay.nproc <= args.max_nproc]
    print(f"CPU: {cpu_model()}; {load_avg()}", flush=True)
    profile = Profile.load(args.profile) if args.profile else measure_profile(out, max(lay.nproc for lay in layouts))
    from train_gpt import build_model

    model, example = build_model(MODEL, SEQ_LEN, "meta")
    graph = autopar.capture(model, example)

    plans = {}
    for lay in layouts:
        cluster = Cluster.local(nproc=lay.nproc, profile=profile)
        plans[lay.name] = autopar.plan(graph, cluster, global_batch_size=BATCH,
                                       options=PlannerOptions(**lay.options, top_k=0))
        plans[lay.name].save(out / f"plan_{lay.name}.json")

    runs: dict[str, list[RunRecord]] = {lay.name: [] for lay in layouts}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}" + (" (calibration set)" if r == 0 and args.rounds > 1 else ""),
              flush=True)
        for lay in layouts:
            before = load_avg()
            rec = run_plan(out / f"plan_{lay.name}.json", out / f"run_{lay.name}_r{r}.json", lay.nproc, args.steps,
                           args.warmup)
            runs[lay.name].append(rec)
            print(f"  {lay.name:<10} n={lay.nproc} {rec.measured_step_time_s * 1e3:7.1f} ms  ({before} → "
                  f"{load_avg()})", flush=True)

    fit = [runs[lay.name][0] for lay in layouts]
    held_out = args.rounds > 1
    calibrated, cal = calibrate(fit, profile)
    calibrated.save(out / "profile.calibrated.json")
    print(f"\n{cal.describe()}")
    print("evaluated on " + ("rounds 2.." if held_out else "the same runs (in-sample)") + f"; {load_avg()}\n")

    def measured(name: str) -> float:
        recs = runs[name][1:] if held_out else runs[name]
        return statistics.median(x.measured_step_time_s for x in recs)

    print(f"{'layout':<11}{'n':>2}  {'predicted':>10}{'calibrated':>11}{'measured':>10}{'error':>9}{'cal. error':>11}"
          "   (error: (predicted - measured) / measured)")
    raw, cal_pred, meas = [], [], []
    for lay in layouts:
        est = autopar.estimate(graph, Cluster.local(nproc=lay.nproc, profile=calibrated), plans[lay.name].config,
                               global_batch_size=BATCH)
        p0, p1, m = plans[lay.name].estimate.step_time_s, est.step_time_s, measured(lay.name)
        raw.append(p0)
        cal_pred.append(p1)
        meas.append(m)
        flags = [f for f, bad in (("uncalibrated off by more than 25%", abs(p0 - m) > 0.25 * m),
                                  ("calibrated off by more than 10%", abs(p1 - m) > 0.10 * m)) if bad]
        print(f"{lay.name:<11}{lay.nproc:>2}  {p0 * 1e3:8.1f}ms{p1 * 1e3:9.1f}ms{m * 1e3:8.1f}ms"
              f"{(p0 - m) / m * 100:+8.1f}%{(p1 - m) / m * 100:+10.1f}%"
              + (f"   <-- {'; '.join(flags)}" if flags else ""))
    worst_raw = max(abs(p - m) / m for p, m in zip(raw, meas, strict=True))
    worst = max(abs(p - m) / m for p, m in zip(cal_pred, meas, strict=True))
    within_raw = sum(abs(p - m) <= 0.25 * m for p, m in zip(raw, meas, strict=True))
    within = sum(abs(p - m) <= 0.10 * m for p, m in zip(cal_pred, meas, strict=True))
    print(f"\nuncalibrated: {within_raw} of {len(layouts)} within 25% (worst {worst_raw * 100:.1f}%); calibrated: "
          f"{within} of {len(layouts)} within 10% (worst {worst * 100:.1f}%); on {cpu_model()}, {load_avg()}")
    print(f"Spearman rank correlation predicted vs measured: {spearman(raw, meas):.3f} before calibration, "
          f"{spearman(cal_pred, meas):.3f} after")

    fastest = min(layouts, key=lambda lay: measured(lay.name))
    n = fastest.nproc
    chosen = autopar.plan(graph, Cluster.local(nproc=n, profile=calibrated), global_batch_size=BATCH,
                          options=PlannerOptions(top_k=0))
    chosen.save(out / "plan_chosen.json")
    mine, theirs = [], []
    for i in range(2):  # ABAB: the planner's choice and the fastest measured layout, alternately
        mine.append(run_plan(out / "plan_chosen.json", out / f"run_chosen_{i}.json", n, args.steps,
                             args.warmup).measured_step_time_s)
        theirs.append(run_plan(out / f"plan_{fastest.name}.json", out / f"run_fastest_{i}.json", n, args.steps,
                               args.warmup).measured_step_time_s)
    a, b = statistics.median(mine), statistics.median(theirs)
    print(f"planner's choice on {n} processes: {chosen.config}, predicted {chosen.estimate.step_time_s * 1e3:.1f} ms, "
          f"measured {a * 1e3:.1f} ms; fastest measured layout {fastest.name} {b * 1e3:.1f} ms in the same ABAB "
          f"runs (ratio {a / b:.2f}); {load_avg()}")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
