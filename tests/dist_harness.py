"""Run a function on N local processes joined by a gloo process group, as torchrun would.

`run_distributed(fn, world_size, *args)` starts the ranks (a free port, one thread each), runs `fn(*args)`
in every rank and returns the per-rank results in rank order.

Ranks are forked from a multiprocessing forkserver: a fresh interpreter, started once per test process,
that has imported torch, transformers, autopar and the test helpers (`PRELOAD`) and runs nothing else, so
a rank starts as a fresh interpreter with those imports done. Importing them in each rank cost 5-6 s of
CPU (tens of seconds on a loaded 2-core CI machine), and the suite starts about a hundred ranks.
A rank that raises, or a job that outlives `timeout_s`, fails the caller with every failing
rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["run_distributed", "free_port"]

# what the forkserver imports before it forks ranks (a module it cannot import is skipped: the rank imports
# what it needs itself); nothing here opens a process group, starts a thread pool or builds a model
PRELOAD = ["torch", "torch.distributed.tensor", "transformers", "transformers.modeling_utils", "autopar",
           "autopar.codegen", "autopar.planner", "parity_models"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # pickled here, by value: the queue's own pickler would send tensors as file descriptors that this
        # process serves, and a forked rank exits at once, before the parent has fetched them
        out = pickle.dumps(fn(*args))
        results.put((rank, "ok", out))
    except BaseException:  # every failure goes back to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_PORT_TAKEN = "EADDRINUSE"  # the free port was taken by another job between free_port() and the store's bind
_PORT_TRIES = 3


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """`fn(*args)` on `world_size` gloo ranks; `fn` must be importable (module level) and return picklables.

    A job whose store could not bind its port (another job took it first: CI runs jobs side by side) is
    started again on a new port, up to three times; any other failure fails the caller."""
    for attempt in range(_PORT_TRIES):
        try:
            return _run_once(fn, world_size, args, timeout_s)
        except AssertionError as e:
            if _PORT_TAKEN not in str(e) or attempt == _PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when this process starts its forkserver (its first job)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break  # every rank exited without reporting (killed, or crashed at start-up)
                continue
            got[rank] = (status, value)
            if status == "error":  # the others are likely blocked in a collective: give them a moment
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in got.items() if s == "error"}
    missing = sorted(set(range(world_size)) - set(got))
    if errors or missing:
        lines = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            lines.append(f"ranks {missing} returned nothing (hung past {timeout_s:.0f} s, blocked on a failed "
                         f"peer, or killed; exit codes {[p.exitcode for p in procs]})")
        raise AssertionError(f"distributed job {getattr(fn, '__name__', fn)} on {world_size} ranks failed:\n"
                             + "\n".join(lines))
    return [pickle.loads(got[r][1]) for r in range(world_size)]
