"""When one rank of a job fails, every other rank stops within seconds, saying which rank failed and why.

A rank that raises inside a collective entry point (a training step, an evaluation, a forward, a full
state dict, a checkpoint save or load) writes its error to the job's key-value store (the rendezvous
store torchrun and `init_process_group` already run) before the exception leaves it, and bumps a
counter there. Its peers are then stopped by one of two things:

- the collective they are blocked in fails, at once when the failing process exits (gloo and NCCL see
  the closed connection). They look in the store and raise `PeerFailedError` naming the failed rank;
- the failing rank lives on (user code caught its exception): nothing closes the connections (destroying
  or aborting a gloo group does not), and the peers would wait for the process group's timeout (10 min).
  So each rank runs a watch thread that reads the counter every `POLL_S`; a rank that has been inside an
  entry point for `GRACE_S` while a peer's failure stands writes why to stderr, records itself as
  stopped (so the failed rank's next collective call raises `PeerFailedError` instead of blocking) and
  ends its process with exit code 1, as torchrun expects of a failed worker.

A failure stands until the rank that failed enters its next entry point: ranks that all raised the same
error (bad input, checked before any collective) and go on together are never stopped.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from autopar.errors import PeerFailedError

__all__ = ["named_failures", "FailureWatch"]

_KEY = "autopar/failed/{rank}"  # "<entry point>|<error>", or "" once that rank went on
_COUNT = "autopar/failed/count"
_STOPPED = "stopped"  # the entry point of a rank that stopped itself for a peer's failure
# Seconds between reads of the failure counter: one store round trip per rank, so a 4096-rank job costs
# the store ~8k small requests a second, far below what a TCPStore serves.
POLL_S = 0.5
# Seconds a rank stays inside an entry point after a peer's failure before it stops itself: ranks that
# hit the same bad input raise within milliseconds of each other, a blocked rank never returns.
GRACE_S = 5.0


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no default group, or no store behind it
        return None


class FailureWatch:
    """One rank's view of the job's standing failures, refreshed from the store by `poll`.

    `enter`/`leave` bracket an entry point; `poll(now)` returns the message this rank stops with, or None.
    Kept apart from the thread so tests can drive it with a clock of their own."""

    def __init__(self, store, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.standing: dict[int, tuple[str, str]] = {}  # peer rank → (entry point, error) while it stands
        self._count = 0
        self._failed = False  # this rank published a failure that still stands
        self._depth = 0
        self._entered_s = 0.0
        self._what = ""
        self._seen_s: float | None = None  # when this rank, inside an entry point, first saw a standing failure

    def refresh(self) -> None:
        """Re-read the records when the counter moved (one store request when it did not)."""
        count = self.store.add(_COUNT, 0)
        if count == self._count:
            return
        self._count = count
        standing = {}
        for rank in range(self.world):
            key = _KEY.format(rank=rank)
            if rank != self.rank and self.store.check([key]):
                what, _, error = self.store.get(key).decode(errors="replace").partition("|")
                if what:
                    standing[rank] = (what, error)
        self.standing = standing

    def publish(self, what: str, error: str) -> None:
        """Record this rank's failure during `what` (an empty `what`: its failure no longer stands)."""
        self.store.set(_KEY.format(rank=self.rank), f"{what}|{error}"[:2000])
        self.store.add(_COUNT, 1)
        self._failed = bool(what)

    def describe(self) -> tuple[int, str]:
        """The first standing failure: its rank, and "failed during train_step (ValueError: ...)"."""
        rank, (what, error) = min(self.standing.items())
        if what == _STOPPED:
            return rank, f"stopped ({error.splitlines()[0][:300]})"
        return rank, f"failed during {what} ({error.splitlines()[0][:300]})"

    def enter(self, what: str, now: float) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        self._entered_s, self._what, self._seen_s = now, what, None
        try:
            if self._failed:  # this rank goes on: its failure no longer stands
                self.publish("", "")
            self.refresh()
        except dist.DistError as e:  # nothing but the end of its host process closes the store
            self._depth = 0
            raise PeerFailedError(f"the job's store cannot be reached ({str(e).splitlines()[0][:200]}): the "
                                  "process hosting it (rank 0, or torchrun's agent) has ended, so the job "
                                  "cannot go on; restart it and look at the rank that failed first") from None
        if any(what == _STOPPED for what, _ in self.standing.values()):
            self._depth = 0
            rank, message = self.describe()
            raise PeerFailedError(f"rank {rank} {message}; the job cannot go on: restart it (torchrun "
                                  "--max-restarts) and look at the rank that failed first")

    def leave(self) -> None:
        self._depth = max(0, self._depth - 1)

    def poll(self, now: float) -> str | None:
        if self._depth == 0:  # outside entry points nothing can block: no store request
            self._seen_s = None
            return None
        self.refresh()
        if not self.standing:
            self._seen_s = None
            return None
        if self._seen_s is None:
            self._seen_s = max(now, self._entered_s)
            return None
        if now - self._seen_s < GRACE_S:
            return None
        rank, message = self.describe()
        return (f"rank {rank} {message} and has not gone on; rank {self.rank} was inside {self._what} for "
                f"{now - self._entered_s:.1f} s, blocked on it")


_watch: FailureWatch | None = None
_lock = threading.Lock()
_stop = threading.Event()  # set at interpreter exit: the watch thread ends before finalization
_thread: threading.Thread | None = None


# Seconds the interpreter leaves the GIL free at exit before it finalizes. A gloo worker thread destroys
# each finished collective's work object after the caller's wait() returned (a barrier's work also holds
# the work it waited on); dropping the last reference to a tensor with a Python object takes the GIL.
# After finalization began, a thread that takes the GIL is ended by pthread_exit, whose forced unwind
# through C++ frames aborts the process ("terminate called without an active exception", exit -6)
# after a run that succeeded. Found by core dump (backtrace: ProcessGroupGloo::runLoop →
# ~AsyncBarrierWork → ~AsyncGatherWork → TensorImpl::decref_pyobject → take_gil → pthread_exit), one
# run in ~30 of examples/train_gpt.py under load; 200 ms covers a worker descheduled for many time slices.
EXIT_QUIESCE_S = 0.2


@atexit.register
def _quiet_exit() -> None:
    """End the watch thread, then let collective worker threads finish, while the interpreter is whole.

    A daemon thread still inside a store request when finalization starts is torn down as it takes the
    GIL back, and so is a gloo worker releasing a finished collective's tensors (see `EXIT_QUIESCE_S`)."""
    _stop.set()
    if _thread is None:
        return  # no process group was watched in this process: no collective ran through autopar
    if _thread is not threading.current_thread():
        _thread.join(timeout=10 * POLL_S)
    time.sleep(EXIT_QUIESCE_S)  # releases the GIL: a worker waiting for it takes it now


def _current_watch() -> FailureWatch | None:
    """This process's watch over the current default group (a new one when the group was made anew)."""
    global _watch, _thread
    if not dist.is_initialized() or (store := _store()) is None:
        return None
    with _lock:
        if _watch is None or _watch.store is not store:
            _watch = FailureWatch(store, dist.get_rank(), dist.get_world_size())
            _thread = threading.Thread(target=_run_watch, args=(_watch,), name="autopar-failure-watch", daemon=True)
            _thread.start()
        return _watch


def _run_watch(watch: FailureWatch) -> None:
    while not _stop.wait(POLL_S):
        if _watch is not watch or not dist.is_initialized() or _store() is not watch.store:
            return  # the group was destroyed or made anew
        try:
            with _lock:
                why = watch.poll(time.monotonic())
            if why is None:
                continue
            watch.publish(_STOPPED, why)
        except Exception:  # the store's host process ended: the collectives fail by themselves
            return
        sys.stderr.write(f"autopar: {why}; stopping this process (exit code 1) rather than waiting for the "
                         "process group's timeout. Look at that rank's error.\n")
        sys.stderr.flush()
        os._exit(1)


@contextmanager
def named_failures(what: str) -> Iterator[None]:
    """Run `what` (e.g. "train_step"); on failure publish this rank's error or name the peer that failed."""
    watch = _current_watch()
    if watch is not None:
        with _lock:
            watch.enter(what, time.monotonic())
    try:
        yield
    except Exception as e:
        if watch is None:
            raise
        me = watch.rank
        try:
            with _lock:
                watch.refresh()
                peer = watch.describe() if watch.standing else None
                if peer is None:
                    watch.publish(what, f"{type(e).__name__}: {e}")
        except Exception:  # the store itself is gone (its host rank died): the original error is all we have
            raise e from None
        if peer is not None:
            rank, message = peer
            raise PeerFailedError(f"rank {rank} {message}; rank {me} stopped with it during {what}. Look at "
                                  f"rank {rank}'s error; this rank's own was: {type(e).__name__}") from e
        raise
    finally:
        if watch is not None:
            with _lock:
                watch.leave()
