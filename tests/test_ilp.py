"""The stage-cut ILP against brute force over every cut vector and every per-layer recompute assignment."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.planner.ilp import MODES, InnerProblem, Run, evaluate, solve


def random_problem(seed: int) -> InnerProblem:
    rng = random.Random(seed)
    p = rng.choice([1, 2, 2, 3])
    v = rng.choice([1, 1, 2]) if p > 1 else 1
    S = p * v
    nruns = rng.randint(1, 3)
    counts = [rng.randint(1, 2) for _ in range(nruns)]
    while sum(counts) < S:
        counts[rng.randrange(nruns)] += 1
    if sum(counts) < 5:  # a run of several identical layers, whose layers may take different modes
        counts[rng.randrange(nruns)] += 5 - sum(counts)
    runs = []
    for i, n in enumerate(counts):
        comp = rng.uniform(1.0, 5.0)
        # none, selective, op_sac, full: more recompute, fewer bytes
        rec = (0.0, rng.uniform(0.05, 0.4) * comp, rng.uniform(0.2, 0.5) * comp, rng.uniform(0.5, 1.0) * comp)
        tp = rng.uniform(0.0, 0.5)
        act_none = rng.uniform(1.0, 10.0)
        act = (act_none, act_none * rng.uniform(0.5, 0.9), act_none * rng.uniform(0.2, 0.5),
               act_none * rng.uniform(0.05, 0.2))
        runs.append(Run(name=f"r{i}", count=n, layer_names=tuple(f"r{i}.{j}" for j in range(n)),
                        time_s=tuple(comp + tp + x for x in rec), compute_s=(comp,) * 4, recompute_s=rec,
                        tp_comm_s=(tp,) * 4, act_bytes=act, state_bytes=rng.uniform(1.0, 20.0),
                        backward_s=comp * 0.6, grad_sync_s=rng.uniform(0.0, 3.0), optimizer_s=rng.uniform(0, 0.3),
                        send_s=(rng.uniform(0, 0.2), rng.uniform(0.2, 1.0))))
    m = rng.choice([1, 2, 4, 8]) * (p if v > 1 else 1)
    inflight = tuple(float(min(m, p - q) + rng.choice([0, 0.5])) for q in range(p))
    # Capacity from a random layout's memory, so that memory binds in some cases and not in others.
    total = sum(r.count * (r.state_bytes + r.act_bytes[0] * max(inflight)) for r in runs)
    cap = tuple(total / p * rng.uniform(0.5, 1.6) for _ in range(p))
    modes = rng.choice([MODES, MODES, ("none", "full"), ("none", "op_sac"), ("selective",)])
    return InnerProblem(runs=tuple(runs), num_ranks=p, virtual_stages=v, num_microbatches=m, inflight=inflight,
                        capacity_bytes=cap, inter_node=tuple(rng.random() < 0.5 for _ in range(S - 1)),
                        modes=modes, grad_sync_latency_s=rng.uniform(0, 0.5), per_layer=rng.random() < 0.75)


def compositions(n: int, k: int):
    for bars in itertools.combinations(range(1, n), k - 1):
        edges = (0, *bars, n)
        yield tuple(edges[i + 1] - edges[i] for i in range(k))


def brute_objective(pr: InnerProblem, cuts: tuple[int, ...], layer_modes: tuple[str, ...]) -> float | None:
    """Independent re-statement of the objective: step = (m − 1/v)·max rank time + Σ t / v + tail; a
    rank's memory holds the largest recompute workspace of the modes its layers use."""
    layers = [r for r in pr.runs for _ in range(r.count)]
    p, v, S = pr.num_ranks, pr.virtual_stages, pr.num_stages
    rank_t, rank_mem, opt, dp = [0.0] * p, [0.0] * p, [0.0] * p, [pr.grad_sync_latency_s] * p
    rank_modes = [set() for _ in range(p)]
    pos, stage_ts = 0, []
    for s, n in enumerate(cuts):
        q = s % p
        mine = layers[pos:pos + n]
        ks = [MODES.index(k) for k in layer_modes[pos:pos + n]]
        t = sum(r.time_s[k] for r, k in zip(mine, ks, strict=True))
        if s + 1 < S:  # activations forward
            t += mine[-1].send_s[int(pr.inter_node[s])]
        if s > 0:  # gradients backward, same size as the tensor that came in
            t += layers[pos - 1].send_s[int(pr.inter_node[s - 1])]
        stage_ts.append(t)
        rank_t[q] += t
        rank_mem[q] += sum(r.state_bytes + pr.inflight[q] * r.act_bytes[k] for r, k in zip(mine, ks, strict=True))
        rank_modes[q].update(ks)
        opt[q] += sum(r.optimizer_s for r in mine)
        dp[q] += sum(r.grad_sync_s - r.backward_s for r in mine)
        pos += n
    for q in range(p):
        rank_mem[q] += max(max(r.act_bytes[0] - r.act_bytes[k] for r in pr.runs) for k in rank_modes[q])
        if rank_mem[q] > pr.capacity_bytes[q] * (1 + 1e-9):
            return None
    tail = max(max(opt[q], opt[q] + dp[q]) for q in range(p))
    m = pr.num_microbatches
    return (m - 1 / v) * max(rank_t) + sum(stage_ts) / v + tail


def brute_force(pr: InnerProblem) -> float | None:
    """Every cut vector (interleaved: chunks differ by ≤ 1 layer), every recompute mode per layer. Within a
    stage, identical layers (one run) are interchangeable, so their modes are enumerated as multisets; and
    as the objective grows with every rank's time while each rank's memory depends on its layers only, each
    rank takes its quickest assignment that fits."""
    best, p, S = None, pr.num_ranks, pr.num_stages
    of = [ri for ri, r in enumerate(pr.runs) for _ in range(r.count)]
    workspace = {k: max(r.act_bytes[0] - r.act_bytes[MODES.index(k)] for r in pr.runs) for k in pr.modes}
    for cuts in compositions(pr.num_layers, S):
        if pr.virtual_stages > 1 and max(cuts) - min(cuts) > 1:
            continue
        edges = [0, *itertools.accumulate(cuts)]
        modes: list[str | None] = [None] * pr.num_layers
        for q in range(p):
            segs = []  # (first layer, length) of each run's layers in each of the rank's stages
            for s in range(q, S, p):
                i = edges[s]
                for _, g in itertools.groupby(of[edges[s]:edges[s + 1]]):
                    n = len(list(g))
                    segs.append((i, n))
                    i += n
            quickest = None
            for parts in itertools.product(*(itertools.combinations_with_replacement(pr.modes, n) for _, n in segs)):
                ks = [(pr.runs[of[i + j]], MODES.index(k)) for (i, _), part in zip(segs, parts, strict=True)
                      for j, k in enumerate(part)]
                used = {k for part in parts for k in part}
                if not pr.per_layer and len(used) > 1:
                    continue  # one mode per rank asked
                mem = sum(r.state_bytes + pr.inflight[q] * r.act_bytes[k] for r, k in ks) + \
                    max(workspace[k] for k in used)
                t = sum(r.time_s[k] for r, k in ks)
                if mem <= pr.capacity_bytes[q] * (1 + 1e-9) and (quickest is None or t < quickest[0]):
                    quickest = (t, parts)
            if quickest is None:
                break
            for (i, _), part in zip(segs, quickest[1], strict=True):
                modes[i:i + len(part)] = part
        else:
            val = brute_objective(pr, cuts, tuple(modes))
            if val is not None and (best is None or val < best):
                best = val
    return best


@pytest.mark.parametrize("seed", range(30))
def test_ilp_matches_brute_force(seed: int) -> None:
    pr = random_problem(seed)
    best = brute_force(pr)
    sol = solve(pr, time_limit_s=30)
    if best is None:
        assert sol is None
        return
    assert sol is not None and sol.status == "optimal" and sol.gap == 0.0
    assert sol.objective_s == pytest.approx(best, rel=1e-7)
    assert brute_objective(pr, sol.layers_per_stage, sol.layer_modes) == pytest.approx(sol.objective_s, rel=1e-9)


def test_random_optima_mix_modes_within_a_rank() -> None:
    """The brute-force cases above exercise the per-layer space: some optima give one rank's layers
    different modes, which one mode per rank could not express."""
    mixed = 0
    for seed in range(30):
        sol = solve(random_problem(seed))
        if sol is not None:
            ranks = [{sol.layer_modes[i] for st in sol.stages if st.rank == q
                      for i in range(st.first_layer, st.first_layer + st.num_layers)} for q in range(len(sol.stages))]
            mixed += any(len(r) > 1 for r in ranks)
    assert mixed >= 3


def test_optimum_can_have_uneven_cuts_and_mixed_recompute() -> None:
    """A heavy last layer (an LM head) pushes the cut off centre, and tight memory on the first rank
    (most micro-batches in flight under 1F1B) makes only that stage recompute."""
    def run(name: str, n: int, t: float, act: float, state: float) -> Run:
        return Run(name=name, count=n, layer_names=tuple(f"{name}.{i}" for i in range(n)),
                   time_s=(t, 1.1 * t, 1.3 * t, 1.4 * t), compute_s=(t,) * 4,
                   recompute_s=(0, 0.1 * t, 0.3 * t, 0.4 * t),
                   tp_comm_s=(0,) * 4, act_bytes=(act, 0.5 * act, 0.3 * act, 0.1 * act), state_bytes=state,
                   backward_s=0,
                   grad_sync_s=0, optimizer_s=0, send_s=(0.0, 0.0))

    pr = InnerProblem(runs=(run("block", 6, 1.0, 1.0, 1.0), run("head", 1, 4.0, 1.0, 1.0)), num_ranks=2,
                      virtual_stages=1, num_microbatches=4, inflight=(2.0, 1.0), capacity_bytes=(12.0, 100.0),
                      inter_node=(False,))
    sol = solve(pr)
    assert sol is not None
    assert sol.objective_s == pytest.approx(brute_force(pr), rel=1e-9)
    assert sol.layers_per_stage == (5, 2)
    # 5 blocks fit rank 0 only if 4 of them recompute selectively: 5 + 2·(1 + 4·0.5) + 0.5 = 11.5 ≤ 12
    assert sol.layer_modes[:5] == ("selective",) * 4 + ("none",) and sol.modes == ("selective", "none")


def test_evaluate_names_the_violated_memory_row() -> None:
    pr = random_problem(3)
    S = pr.num_stages
    cuts = next(compositions(pr.num_layers, S))
    tight = InnerProblem(**{**pr.__dict__, "capacity_bytes": (1e-3,) * pr.num_ranks})
    ev = evaluate(tight, cuts, ("none",) * S)
    assert not ev.feasible and ev.violated.startswith("memory_rank")
    assert solve(tight) is None


@pytest.mark.parametrize("seed", range(6))
def test_cbc_fallback_with_bound_rows_and_warm_start_matches_brute_force(seed: int, monkeypatch) -> None:
    """Without HiGHS the solver is CBC, warm-started through pulp's initial values."""
    from autopar.planner import ilp
    from autopar.planner.bound import tight_bound
    from autopar.planner.incumbent import incumbent

    monkeypatch.setattr(ilp, "_has_highs", lambda: False)
    pr = random_problem(seed)
    bnd = tight_bound(pr)
    sol = ilp.solve(pr, time_limit_s=30, bound=bnd, start=incumbent(pr, bnd))
    best = brute_force(pr)
    assert (sol is None) == (best is None)
    if best is not None:
        assert sol.status == "optimal" and sol.objective_s == pytest.approx(best, rel=1e-7)


def test_planning_prints_nothing_to_stdout() -> None:
    """autopar.plan from Python stays quiet: HiGHS's banner, printed by its C++ constructor to the process's
    stdout once per process, is silenced (a fresh process, so its first solver is constructed here). Four
    stages, so the stage cuts need ILPs (with two, the bound already proves the best cut and none runs)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, autopar\nfrom autopar import Cluster, PlannerOptions\n"
            "net, x = autopar.zoo.build('gpt-tiny', seq_len=16)\n"
            "plan = autopar.plan(autopar.capture(net, x), Cluster.preset('pcie-a100-8x', nodes=1), "
            "global_batch_size=8, options=PlannerOptions(pp=4, top_k=0))\n"
            "print(plan.solver.solver, plan.solver.ilps_solved, file=sys.stderr)\n")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    solver, ilps = out.stderr.split()[-2:]
    assert solver == "HiGHS" and int(ilps) >= 1, out.stderr[-500:]  # the solver whose banner it was did run
    assert out.stdout == ""
