"""Where the time of a training step goes, measured on each rank while it trains.

Two clocks, both wall time on the training thread (what the step time is made of):

- `CommClock` counts the time the thread is *blocked* in communication, by mesh axis. It wraps the
  process-group entry points the runtime reaches (c10d all-reduce / broadcast / all-gather /
  reduce-scatter, isend / irecv / batch_isend_irecv, and the `wait_tensor` of functional collectives
  that DTensor's tensor parallelism uses) and times each synchronous call, or the `wait()` of the
  `Work` an asynchronous call returns. Blocked time is the right quantity rather than the duration of
  the collective on the gloo worker thread: what overlaps with compute costs the step nothing, and
  what does not shows up exactly here. Collectives are attributed to an axis by their process group
  (tp, dp, pp); funcol waits are tensor-parallel (only DTensor TP uses them in autopar's codegen).
  Point-to-point waits are split by direction: a send's wait is transfer (`pp_send`), a receive's
  wait is mostly the pipeline's idle time waiting for the neighbour (`pp_recv`).
- `StepTimer` times the phases of `ParallelModel.train_step` (forward+backward, gradient sync,
  optimizer, loss reduction) and, per phase, the blocked time of each axis, one `StepSample` a step.

`StepSample.components()` turns one step into the planner's breakdown keys (plan.BREAKDOWN_KEYS):
compute = forward+backward minus every wait inside it; tp_comm, dp_comm = blocked time on those
axes (dp_comm also the whole gradient-sync phase and the loss all-reduce, which the planner prices
with the data-parallel tail); pp_comm = send waits; optimizer = the optimizer phase minus its waits
(ZeRO-1 broadcasts count as dp_comm); pipeline_bubble = the rest of the step (receive waits, waiting
for the slowest rank). Recompute is not separated from the forward/backward it belongs to and is
reported inside compute (recompute = 0). On gloo a send completes only once the receiver has posted
its receive, so pp_comm also holds time spent waiting for the neighbour: read pp_comm and the bubble
together (autopar.report.run_report does).

The clock also counts the collectives and point-to-point operations issued per axis (`calls`), so a
record shows how many the runtime really issued.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

__all__ = ["AXES", "PHASES", "CommClock", "StepSample", "StepTimer", "rank_timing"]

AXES = ("tp", "dp", "pp_send", "pp_recv", "other")
PHASES = ("forward_backward", "grad_sync", "optimizer", "loss")
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_single", "all_gather_into_tensor",
                "reduce_scatter_single", "reduce_scatter_tensor", "all_gather", "reduce_scatter")


class _TimedWork(dist.Work):
    """A `Work` whose wait() adds the blocked time to the clock (isinstance checks still see a Work)."""

    def __init__(self, inner: dist.Work, clock: CommClock, axis: str) -> None:
        super().__init__()
        self._inner, self._clock, self._axis = inner, clock, axis

    def wait(self, timeout=None) -> bool:  # noqa: ANN001 - c10d's signature
        t0 = time.perf_counter()
        try:
            return self._inner.wait() if timeout is None else self._inner.wait(timeout)
        finally:
            self._clock.add(self._axis, time.perf_counter() - t0)

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def get_future(self):
        return self._inner.get_future()

    def result(self):
        return self._inner.result()

    def exception(self):
        return self._inner.exception()


class CommClock:
    """Blocked communication time by axis while installed (a context manager; patches are undone on exit).

    groups: process group → axis name ("tp", "dp", "pp"); other groups count as "other".
    """

    def __init__(self, groups: dict[dist.ProcessGroup, str]) -> None:
        self.groups = dict(groups)
        self.totals: dict[str, float] = dict.fromkeys(AXES, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(AXES, 0)
        self._saved: list[tuple[object, str, object]] = []

    def add(self, axis: str, seconds: float) -> None:
        self.totals[axis] += seconds

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)

    def count(self, axis: str) -> None:
        self.calls[axis] += 1

    def _axis(self, group: dist.ProcessGroup | None) -> str:
        axis = self.groups.get(group) if group is not None else None
        return "pp_send" if axis == "pp" else (axis or "other")

    # ---- wrappers ----
    def _collective(self, fn: Callable) -> Callable:
        return self._timed(fn, lambda kwargs: self._axis(kwargs.get("group")))

    def _p2p(self, fn: Callable, axis: str) -> Callable:
        return self._timed(fn, lambda kwargs: axis)

    def _timed(self, fn: Callable, axis_of: Callable[[dict], str]) -> Callable:
        """`fn` counted and timed on the axis `axis_of(kwargs)` names; async work is timed at its wait."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            axis = axis_of(kwargs)
            self.count(axis)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.add(axis, time.perf_counter() - t0)
            return _TimedWork(out, self, axis) if isinstance(out, dist.Work) else out
        return timed

    def _wait_tensor(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(tensor):
            self.count("tp")
            t0 = time.perf_counter()
            out = fn(tensor)
            self.add("tp", time.perf_counter() - t0)
            return out
        return timed

    def _patch(self, module: object, name: str, new: object) -> None:
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, new)

    def __enter__(self) -> CommClock:
        wrapped: dict[str, object] = {}
        for name in _COLLECTIVES:
            if hasattr(c10d, name):
                wrapped[name] = self._collective(getattr(c10d, name))
        wrapped["isend"] = self._p2p(c10d.isend, "pp_send")
        wrapped["irecv"] = self._p2p(c10d.irecv, "pp_recv")
        wrapped["send"] = self._p2p(c10d.send, "pp_send")
        wrapped["recv"] = self._p2p(c10d.recv, "pp_recv")
        # c10d's P2POp checks `op in [isend, irecv]` against its own globals: patch both namespaces.
        for name, fn in wrapped.items():
            self._patch(c10d, name, fn)
            if getattr(dist, name, None) is not None:
                self._patch(dist, name, fn)
        self._patch(funcol, "wait_tensor", self._wait_tensor(funcol.wait_tensor))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._saved:
            module, name, old = self._saved.pop()
            setattr(module, name, old)


@dataclass(kw_only=True)
class StepSample:
    """One step on one rank: its wall time, each phase's wall time and each phase's blocked time by axis."""

    step_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    waits_s: dict[str, dict[str, float]] = field(default_factory=lambda: {p: dict.fromkeys(AXES, 0.0)
                                                                          for p in PHASES})
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(AXES, 0))

    def components(self) -> dict[str, float]:
        """The step in plan.BREAKDOWN_KEYS (module docstring); sums to step_s, bubble ≥ 0 up to timer noise."""
        w = self.waits_s
        fb_waits = sum(w["forward_backward"].values())
        opt_waits = sum(w["optimizer"].values())
        tp = sum(w[p]["tp"] for p in PHASES)
        dp = self.phase_s["grad_sync"] + self.phase_s["loss"] + w["forward_backward"]["dp"] + w["optimizer"]["dp"]
        pp = sum(w[p]["pp_send"] for p in PHASES)
        compute = max(0.0, self.phase_s["forward_backward"] - fb_waits)
        optimizer = max(0.0, self.phase_s["optimizer"] - opt_waits)
        busy = compute + tp + dp + pp + optimizer
        return {"compute": compute, "recompute": 0.0, "tp_comm": tp, "pp_comm": pp,
                "pipeline_bubble": max(0.0, self.step_s - busy), "dp_comm": dp, "optimizer": optimizer}


def _device_sync() -> None:
    """Wait for the GPU's queued kernels, so a host clock read after it times their work: CUDA runs
    asynchronously, and without it each phase would be charged for whatever the next synchronising call waits
    on (measured on an H200: the optimizer phase held 75% of a 544 ms step). No-op on a CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepTimer:
    """Times `ParallelModel.train_step` phases while `clock` counts waits; one StepSample per step (on a GPU
    the device is synchronised at each phase's edges: recording costs a few synchronisations per step)."""

    def __init__(self, clock: CommClock) -> None:
        self.clock = clock
        self.samples: list[StepSample] = []
        self._current: StepSample | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        sample = StepSample()
        self._current = sample
        calls0 = dict(self.clock.calls)
        _device_sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _device_sync()
            sample.step_s = time.perf_counter() - t0
            sample.calls = {a: self.clock.calls[a] - calls0[a] for a in AXES}
            self._current = None
            self.samples.append(sample)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        sample = self._current
        if sample is None:
            yield
            return
        _device_sync()
        before = self.clock.snapshot()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _device_sync()
            sample.phase_s[name] += time.perf_counter() - t0
            after = self.clock.snapshot()
            for axis in AXES:
                sample.waits_s[name][axis] += after[axis] - before[axis]


def rank_timing(timer: StepTimer, *, rank: int, pp_rank: int, dp_rank: int, tp_rank: int,
                warmup_steps: int):
    """This rank's `autopar.record.RankTiming`: every sample after the first `warmup_steps`."""
    from autopar.plan import BREAKDOWN_KEYS
    from autopar.record import RankTiming

    kept = timer.samples[warmup_steps:]
    parts = [s.components() for s in kept]
    calls = {a: statistics.median(s.calls[a] for s in kept) for a in AXES} if kept else {}
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    return RankTiming(rank=rank, pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank,
                      step_s=tuple(s.step_s for s in kept),
                      components_s={k: tuple(p[k] for p in parts) for k in BREAKDOWN_KEYS},
                      calls_per_step={a: float(n) for a, n in calls.items() if n}, peak_memory_bytes=int(peak))
