"""Collective bandwidth and latency over N local processes (gloo on CPU, NCCL on GPU).

One set of N processes is spawned; groups of 2, 4, ... N ranks are sub-groups of it. For each size a
trial runs the op `iters` times between barriers; the time of a trial is the slowest rank's mean (the
collective is done when the last rank is), and a sample is the mean over trials, which interleave the
sizes so that each size is timed across the whole sweep — the quantity nccl-tests reports as "time"
(its average over iterations), from which it derives algbw = size / time and busbw (profile.py).
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cost_models.profile import CollectiveSample

__all__ = ["collective_sizes", "collective_plan", "measure_collectives"]


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _timed(fn: Callable[[], None], iters: int, group: dist.ProcessGroup, device: torch.device) -> float:
    dist.barrier(group=group)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    local = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return float(local.item())


def _worker(rank: int, nproc: int, port: int, backend: str, plan: list[tuple[str, int]], sizes: list[int],
            trials: int, trial_s: float, threads: int, results: mp.Queue) -> None:
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
    groups = {g: dist.new_group(list(range(g))) for g in sorted({g for _, g in plan})}
    try:
        for op, g in plan:
            if rank < g:
                # trials interleave the sizes, so each size's trials spread over the whole sweep of this op:
                # on a shared machine the load changes over seconds, and a median over trials taken
                # back to back would describe one moment, not the machine
                fns = [_op_fn(op, n_bytes, g, rank, groups[g], device) for n_bytes in sizes]
                iters = []
                for fn in fns:
                    first = _timed(fn, 1, groups[g], device)  # also the warm-up
                    iters.append(max(1, min(200, int(trial_s / max(first, 1e-7)))))
                times: list[list[float]] = [[] for _ in sizes]
                for _ in range(trials):
                    for i, fn in enumerate(fns):
                        times[i].append(_timed(fn, iters[i], groups[g], device))
                if rank == 0:
                    for n_bytes, ts in zip(sizes, times, strict=True):
                        # the mean over every timed op, as nccl-tests reports: what a training loop pays.
                        # Per-op times here are heavy-tailed and often bimodal (ranks waking on another
                        # vCPU or not), so a median of trials jumps between modes; the mean does not
                        t = statistics.fmean(ts) / (2.0 if op == "p2p" else 1.0)
                        results.put(("sample", op, g, n_bytes, t))
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.put(("done",))


def measure_collectives(nproc: int, *, backend: str, quick: bool, progress: Callable[[str], None],
                        sizes: list[int] | None = None, plan: list[tuple[str, int]] | None = None,
                        timeout_s: float = 900.0) -> list[CollectiveSample]:
    """Spawn `nproc` processes and time each (op, group size) of `plan` at each of `sizes` bytes."""
    if nproc < 2:
        return []
    sizes = sizes or collective_sizes(quick)
    plan = plan or collective_plan(nproc, quick)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # small messages are cheap and the noisiest (OS scheduling of oversubscribed ranks): 7-9 trials
    args = (nproc, _free_port(), backend, plan, sizes, 7 if quick else 9, 0.02 if quick else 0.05, threads, results)
    procs = [ctx.Process(target=_worker, args=(r, *args), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    samples: list[CollectiveSample] = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                msg = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"collective profiling failed: workers exited with codes {dead} (their "
                                       "traceback is above); rerun with fewer processes (--nproc)") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"collective profiling took over {timeout_s:.0f} s; rerun with --quick "
                                       "or fewer processes (--nproc)") from None
                continue
            if msg[0] == "done":
                break
            _, op, g, n_bytes, t = msg
            s = CollectiveSample(op=op, group_size=g, n_bytes=n_bytes, time_s=t)
            samples.append(s)
            progress(f"{op} x{g} {n_bytes / 2**10:.0f} KiB: {t * 1e6:.0f} us, "
                     f"algbw {s.algbw_Bps / 1e9:.2f} GB/s, busbw {s.busbw_Bps / 1e9:.2f} GB/s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return samples
