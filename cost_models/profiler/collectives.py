"""Collective bandwidth and latency over N local processes (gloo on CPU, NCCL on GPU).

One set of N processes is spawned; groups of 2, 4, ... N ranks are sub-groups of it. For each size a
trial runs the op `iters` times between barriers; the time of a trial is the slowest rank's mean (the
collective is done when the last rank is), and a sample is the mean over trials, which interleave the
sizes so that each size is timed across the whole sweep — the quantity nccl-tests reports as "time"
(its average over iterations), from which it derives algbw = size / time and busbw (profile.py).

Within a time budget (budget.py): each op gets an equal share of what is left when it starts; its sizes
are warmed up in increasing order until the next would overrun half that share, the trials shrink to fit
the rest, and the sizes left out are extrapolated on the α-β line of the largest measured ones
(CollectiveSample.extrapolated).
The same processes first time the kernel mix of contention.py, 2, 4 ... N at once.

Given that mix (CPU profiles), every timed call is reached from compute, as in training: each rank runs
one mix, untimed, before each call, and a sample is the ranks' mean time blocked in the call (`_timed`).
On a CPU whose cores the ranks share with each other and with other work, a collective in a training
step costs the op plus the wait for a peer that arrives later or was descheduled; back-to-back calls,
with every rank already waiting in the op, do not see that wait (measured here: tensor-parallel steps
blocked ~6 ms per 2-rank all-reduce against ~1.5 ms in a back-to-back table, at load 9).
"""

from __future__ import annotations

import math
import queue as queue_mod
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cost_models.profile import CollectiveSample
from cost_models.profiler.budget import alpha_beta_time_s
from cost_models.profiler.contention import concurrent_mix_s, kernel_mix, training_threads

__all__ = ["collective_sizes", "collective_plan", "measure_collectives", "CollectiveSweep"]


# Seconds kept for tearing the processes down: gloo's destroy_process_group and interpreter exit take
# 0.5-3 s for 4 processes on this loaded 2-vCPU VM (a quick profile ran 6 s over its budget waiting on them).
TEARDOWN_S = 2.0


def collective_sizes(quick: bool) -> list[int]:
    """1 KiB to 16 MiB (quick) or 256 MiB, ×2 apart. gloo's time is not smooth in size (it switches
    algorithms and chunking, and caches spill): measured here, points ×4 apart left log-size
    interpolation 20-30% off at the midpoints for 2 processes, where ×2 apart stays within the noise."""
    return [2**e for e in range(10, 25)] if quick else [2**e for e in range(10, 29)]


def group_sizes(nproc: int) -> list[int]:
    sizes = [g for g in (2, 4, 8, 16, 32, 64) if g < nproc]
    return sizes + [nproc] if nproc >= 2 else []


def collective_plan(nproc: int, quick: bool) -> list[tuple[str, int]]:
    """(op, group size) pairs: all-reduce for every group size, the others over all N processes."""
    plan = [("all_reduce", g) for g in group_sizes(nproc)]
    if nproc >= 2:
        plan += [("p2p", 2), ("all_gather", nproc), ("reduce_scatter", nproc)]
        if not quick:
            plan += [("broadcast", nproc), ("all_to_all", nproc)]
    return plan


def _op_fn(op: str, n_bytes: int, g: int, rank: int, group: dist.ProcessGroup,
           device: torch.device) -> Callable[[], None]:
    elems = max(g, (n_bytes // 4) // g * g)  # float32, divisible by the group size
    x = torch.ones(elems, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        part = torch.ones(elems // g, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
        return lambda: gather(x, part, group=group)
    if op == "reduce_scatter":
        part = torch.empty(elems // g, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, x, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(x, src=0, group=group)
    if op == "all_to_all":
        y = torch.empty_like(x)
        return lambda: dist.all_to_all_single(y, x, group=group)
    if op == "p2p":  # ping-pong; one call is two one-way transfers, halved by the caller
        peer = 1 - rank

        def pingpong() -> None:
            if rank == 0:
                dist.send(x, dst=peer, group=group)
                dist.recv(x, src=peer, group=group)
            else:
                dist.recv(x, src=peer, group=group)
                dist.send(x, dst=peer, group=group)
        return pingpong
    raise ValueError(f"unknown collective {op!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], iters: int, group: dist.ProcessGroup, device: torch.device,
           between: Callable[[], None] | None = None) -> float:
    """Seconds per call of fn. Back to back: the slowest rank's mean, nccl-tests' "time". With `between`, a
    compute segment each rank runs (untimed) before each call: the ranks' mean time blocked in the call,
    what a training step pays for a collective it reaches from compute — the op plus waiting for peers
    that arrive later or were descheduled (contention.py's processes sharing the cores)."""
    dist.barrier(group=group)
    _sync(device)
    if between is None:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        local = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return float(local.item())
    blocked = 0.0
    for _ in range(iters):
        between()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        blocked += time.perf_counter() - t0
    local = torch.tensor([blocked / iters], dtype=torch.float64, device=device)
    dist.all_reduce(local, group=group)
    return float(local.item()) / dist.get_world_size(group)


def _agreed(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """Global rank 0's value on every rank of `group` (which holds rank 0): decisions that steer
    collectives must be the same on every rank."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0, group=group)
    return float(t.item())


def _sweep_op(op: str, g: int, rank: int, group: dist.ProcessGroup, device: torch.device, sizes: list[int],
              trials: int, trial_s: float, budget_s: float,
              between: Callable[[], None] | None = None) -> dict[int, float]:
    """{n_bytes: mean seconds per op} for the sizes that fit in budget_s, measured in increasing size,
    each call after a compute segment when `between` is given (`_timed`).

    Every decision uses rank 0's clock or all-reduced times, so all ranks of the group take the same one."""
    start = time.monotonic()

    def elapsed() -> float:
        return _agreed(time.monotonic() - start, device, group)

    firsts: dict[int, float] = {}
    fns = {}
    for n_bytes in sizes:  # warm-up pass, ascending: stop the range where the next size would overrun half
        if firsts:
            # one point is latency: the next size (×2) is taken to cost the same until a second shows the slope
            pts = list(firsts.items())
            predicted = pts[-1][1] if len(pts) == 1 else alpha_beta_time_s(pts, n_bytes)
            if elapsed() + 2 * predicted > budget_s / 2:
                break
        fns[n_bytes] = _op_fn(op, n_bytes, g, rank, group, device)
        firsts[n_bytes] = _timed(fns[n_bytes], 1, group, device, between)
    # after compute, two calls a trial: the compute segment, not the op, sets a trial's length
    most = 2 if between is not None else 200
    iters = {n: max(1, min(most, int(trial_s / max(t, 1e-7)))) for n, t in firsts.items()}
    # trials interleave the sizes, so each size's trials spread over the whole sweep of this op: on a
    # shared machine the load changes over seconds, and a median over trials taken back to back would
    # describe one moment, not the machine. As many as fit: at least one, no more than `trials`
    times: dict[int, list[float]] = {n: [] for n in firsts}
    for _ in range(trials):
        t0 = elapsed()
        for n, fn in fns.items():
            times[n].append(_timed(fn, iters[n], group, device, between))
        t1 = elapsed()
        if t1 + (t1 - t0) > budget_s:
            break
    # the mean over every timed op, as nccl-tests reports: what a training loop pays. Per-op times here are
    # heavy-tailed and often bimodal (ranks waking on another vCPU or not), so a median of trials jumps
    # between modes; the mean does not
    return {n: statistics.fmean(ts) / (2.0 if op == "p2p" else 1.0) for n, ts in times.items()}


_INHERITED: list[object] = []  # process-group state a forked worker inherited and set aside (_worker)


def _worker(rank: int, nproc: int, store_path: str, backend: str, plan: list[tuple[str, int]], sizes: list[int],
            trials: int, trial_s: float, threads: int, deadline: float, mix_dtype: str | None,
            step: Callable[[], object] | None, results: mp.Queue) -> None:
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        # forked from a process holding a process group (a one-process `parallelize` before the profile): the
        # child inherits its Python objects but not the threads behind them. Set them aside, never destroyed
        # (a forked multiprocessing child ends with os._exit), and start this job's group afresh.
        _INHERITED.append(dist.distributed_c10d._world)  # held: destroying them joins threads this process lacks
        dist.distributed_c10d._world = dist.distributed_c10d._World()
    # a file store: no port to probe free (another process can take a probed port before it is bound)
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=nproc)
    groups = {g: dist.new_group(list(range(g))) for g in sorted({g for _, g in plan} | set(group_sizes(nproc)))}
    try:
        mix = None
        if mix_dtype is not None:  # contention.py: the mix in g processes at once, g = 2, 4, ... nproc
            mix = kernel_mix(device, mix_dtype)
            timed = step or mix
            # windows of a fiftieth of the time left, 0.05-0.3 s: long beside the OS's time slices (a few ms)
            window = _agreed(min(0.3, max(0.05, (deadline - time.monotonic()) / 50)), device)
            for g in group_sizes(nproc):
                dist.barrier()
                if rank < g:
                    t = torch.tensor([concurrent_mix_s(timed, device, window_s=window, trials=3)], dtype=torch.float64)
                    dist.all_reduce(t, group=groups[g])
                    if rank == 0:
                        results.put(("mix", g, float(t.item()) / g))
            dist.barrier()
        for i, (op, g) in enumerate(plan):
            # this op's share of what is left of the budget, decided by rank 0 for all
            budget_s = _agreed((deadline - time.monotonic()) / (len(plan) - i), device)
            if rank < g:  # past the deadline still the smallest size, one trial: a table needs a point
                for n_bytes, t in _sweep_op(op, g, rank, groups[g], device, sizes, trials, trial_s,
                                            budget_s, mix).items():
                    if rank == 0:
                        results.put(("sample", op, g, n_bytes, t))
            dist.barrier()
        if rank == 0:  # before the teardown, which the profile need not wait for
            results.put(("done",))
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True, kw_only=True)
class CollectiveSweep:
    """What the spawned processes measured: collective samples (measured, then extrapolated past the
    budget) and, per process count, the wall seconds per kernel mix with that many running at once."""

    samples: list[CollectiveSample]
    mix_s: dict[int, float]


def measure_collectives(nproc: int, *, backend: str, quick: bool, progress: Callable[[str], None],
                        sizes: list[int] | None = None, plan: list[tuple[str, int]] | None = None,
                        budget_s: float = math.inf, mix_dtype: str | None = None,
                        step: Callable[[], object] | None = None, threads: int | None = None) -> CollectiveSweep:
    """Spawn `nproc` processes and time each (op, group size) of `plan` at each of `sizes` bytes, in
    increasing size within `budget_s` (spawning included); with mix_dtype, first the kernel mix in 2, 4 ...
    nproc of them at once (contention.py), or `step` instead when given (a callable the forked workers
    inherit: the model's own layers, forward and backward). threads: torch threads per process (default:
    a training process's, `training_threads`)."""
    if nproc < 2:
        return CollectiveSweep(samples=[], mix_s={})
    sizes = sorted(sizes or collective_sizes(quick))
    plan = plan or collective_plan(nproc, quick)
    threads = threads or training_threads(nproc)
    # fork on a CPU: the workers inherit the imported torch instead of importing it again, which took
    # 10-12 s for two spawned workers on this 2-vCPU VM at load 10, most of a quick profile's share for
    # collectives (they set one thread before any kernel, as DataLoader workers do). CUDA needs spawn.
    fork = backend == "gloo" and sys.platform.startswith("linux")  # macOS forks unsafely past its frameworks
    ctx = mp.get_context("fork" if fork else "spawn")
    step = step if fork else None  # a closure crosses into the workers only by fork
    results = ctx.Queue()
    start = time.monotonic()
    # the workers stop measuring TEARDOWN_S early: the parent then collects them (join, else terminate)
    deadline = start + (budget_s - TEARDOWN_S if math.isfinite(budget_s) else 3600.0)
    # small messages are cheap and the noisiest (OS scheduling of oversubscribed ranks): 7-9 trials
    store_dir = tempfile.TemporaryDirectory(prefix="autopar-profile-")
    args = (nproc, f"{store_dir.name}/store", backend, plan, sizes, 7 if quick else 9, 0.02 if quick else 0.05, threads,
            deadline, mix_dtype, step, results)
    procs = [ctx.Process(target=_worker, args=(r, *args), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    samples: list[CollectiveSample] = []
    mix_s: dict[int, float] = {}
    items = len(plan) * len(sizes)
    # a hung collective must not hang the profile: well past the budget, give up
    timeout_at = deadline + 60.0
    try:
        while True:
            try:
                msg = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"collective profiling failed: workers exited with codes {dead} (their "
                                       "traceback is above); rerun with fewer processes (--nproc)") from None
                if time.monotonic() > timeout_at:
                    raise RuntimeError(f"collective profiling ran over its budget ({budget_s:.0f} s) by a minute; "
                                       "rerun with fewer processes (--nproc)") from None
                continue
            if msg[0] == "done":
                break
            if msg[0] == "mix":
                mix_s[msg[1]] = msg[2]
                progress(f"{'model step' if step else 'kernel mix'} in {msg[1]} processes at once: "
                         f"{msg[2] * 1e3:.2f} ms per call")
                continue
            _, op, g, n_bytes, t = msg
            s = CollectiveSample(op=op, group_size=g, n_bytes=n_bytes, time_s=t)
            samples.append(s)
            now = time.monotonic()
            left = min(deadline - now, (now - start) / len(samples) * max(0, items - len(samples)))
            progress(f"{op} x{g} {n_bytes / 2**10:.0f} KiB: {t * 1e6:.0f} us, algbw {s.algbw_Bps / 1e9:.2f} GB/s, "
                     f"busbw {s.busbw_Bps / 1e9:.2f} GB/s  (collectives: ~{max(0.0, left):.0f} s left)")
    finally:
        for p in procs:
            p.join(timeout=TEARDOWN_S)
            if p.is_alive():
                p.terminate()
        store_dir.cleanup()
    return CollectiveSweep(samples=samples + _extrapolate(samples, plan, sizes, progress), mix_s=mix_s)


def _extrapolate(samples: list[CollectiveSample], plan: list[tuple[str, int]], sizes: list[int],
                 progress: Callable[[str], None]) -> list[CollectiveSample]:
    """The sizes the budget left unmeasured, on the α-β line of the largest measured ones (budget.py)."""
    out = []
    for op, g in plan:
        measured = [(float(s.n_bytes), s.time_s) for s in samples if (s.op, s.group_size) == (op, g)]
        missing = [n for n in sizes if n > max((w for w, _ in measured), default=math.inf)]
        if len(measured) >= 2 and missing:  # one point has no slope to extrapolate along
            progress(f"{op} x{g}: {len(missing)} sizes from {missing[0] / 2**10:.0f} KiB over the time budget, "
                     "extrapolated on the α-β line of the largest measured")
            out += [CollectiveSample(op=op, group_size=g, n_bytes=n, time_s=alpha_beta_time_s(measured, n),
                                     extrapolated=True) for n in missing]
    return out
