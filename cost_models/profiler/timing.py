"""Timing one callable on CPU (perf_counter) or CUDA (torch.cuda.Event), as a median of trials.

A trial runs the callable `reps` times back to back and divides; the repetition count is chosen so a
trial lasts about `trial_s`, which keeps timer resolution and launch jitter out of short ops.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from cost_models.profiler.budget import trials_within

__all__ = ["time_callable", "synchronize", "CLOCKS"]

CLOCKS = ("wall", "thread")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_trial(fn: Callable[[], object], reps: int, device: torch.device, clock: str = "wall") -> float:
    if clock == "thread":  # CPU time of the calling thread: immune to other processes on the cores
        t0 = time.thread_time()
        for _ in range(reps):
            fn()
        return (time.thread_time() - t0) / reps
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def time_callable(fn: Callable[[], object], device: torch.device, *, trial_s: float = 0.02, trials: int = 5,
                  max_reps: int = 1000, clock: str = "wall", budget_s: float | None = None) -> float:
    """Median seconds per call of `fn` over `trials` trials, after a warm-up call.

    clock "wall" is elapsed time (CUDA events on GPU); "thread" is the calling thread's CPU time, for
    single-threaded CPU runs on a machine shared with other work (it equals wall time when idle).
    budget_s bounds the whole measurement (wall clock): fewer trials and repetitions when calls are slow,
    down to the single timed call after the warm-up (`budget.SizeSweep` decides whether to start at all).
    """
    if clock not in CLOCKS or (clock == "thread" and device.type != "cpu"):
        raise ValueError(f"clock={clock!r} on {device.type}; expected 'wall', or 'thread' on CPU")
    start = time.perf_counter()
    fn()
    synchronize(device)
    first = _one_trial(fn, 1, device, clock)
    reps = max(1, min(max_reps, int(trial_s / max(first, 1e-9))))
    if budget_s is not None:
        left = budget_s - (time.perf_counter() - start)
        if left < 2 * first:
            return first
        trials = trials_within(left, first * reps, trial_s=0.0, most=trials)
    return statistics.median(_one_trial(fn, reps, device, clock) for _ in range(trials))
