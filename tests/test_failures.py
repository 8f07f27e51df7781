"""A failure on one rank stops every peer within seconds, even when the failed rank catches it and lives on.

The watch's rules are checked with a clock of the test's own over an in-process store; then with real
processes: a rank raising inside its stage's forward, caught by user code that goes on living, while
its peer is blocked receiving from it; the peer must end (exit code 1, the failed rank named on stderr)
long before the process group's 10-minute timeout, and the failed rank's next step must raise
`PeerFailedError` at once instead of blocking.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from autopar.codegen.failures import GRACE_S, FailureWatch
from autopar.errors import PeerFailedError


def _pair() -> tuple[FailureWatch, FailureWatch]:
    store = dist.HashStore()
    return FailureWatch(store, 0, 2), FailureWatch(store, 1, 2)


def test_a_rank_blocked_after_a_peer_failed_stops_after_the_grace():
    zero, one = _pair()
    zero.enter("train_step", 100.0)
    one.enter("train_step", 100.0)
    one.publish("train_step", "ValueError: boom\nmore")
    assert zero.poll(101.0) is None  # seen now: the grace starts
    assert zero.poll(101.0 + GRACE_S - 0.1) is None
    why = zero.poll(101.0 + GRACE_S)
    assert why is not None and why.startswith("rank 1 failed during train_step (ValueError: boom) and has not gone on")
    assert one.poll(200.0) is None  # the failed rank is never stopped by its own failure


def test_ranks_that_failed_alike_and_go_on_are_never_stopped():
    zero, one = _pair()
    for w in (zero, one):
        w.enter("train_step", 0.0)
    one.publish("train_step", "ValueError: bad batch")
    zero.refresh()  # rank 0 raises the same error, names rank 1 and publishes nothing
    for w in (zero, one):
        w.leave()
    zero.enter("train_step", 1.0)
    assert zero.poll(1.5) is None
    one.enter("train_step", 2.0)  # rank 1 goes on: its failure no longer stands
    assert zero.poll(2.0 + 10 * GRACE_S) is None and not zero.standing


def test_a_rank_outside_entry_points_is_not_stopped_and_a_stopped_peer_is_named_at_entry():
    zero, one = _pair()
    one.publish("save", "OSError: disk full")
    assert zero.poll(0.0) is None and zero.poll(10 * GRACE_S) is None  # not inside an entry point
    zero.enter("train_step", 100.0)
    zero.poll(100.0)
    why = zero.poll(100.0 + GRACE_S)
    assert why is not None
    zero.publish("stopped", why)
    with pytest.raises(PeerFailedError, match=r"rank 0 stopped \(rank 1 failed during save \(OSError: disk full"):
        one.enter("train_step", 200.0)


def _caught_and_lives_on(flag_dir: str) -> str:
    """Rank 1's stage raises in forward; user code catches it and lives on. Rank 0 is blocked receiving."""
    from parity_models import pipeline_failing_on_rank1

    rank = int(os.environ["RANK"])
    flags = Path(flag_dir)
    if rank == 0:  # its last words, for the test to read
        err = os.open(flags / "rank0.stderr", os.O_WRONLY | os.O_CREAT)
        os.dup2(err, 2)
    pm, hook, x, t = pipeline_failing_on_rank1("boom in the last block")
    try:
        pm.train_step(pm.local_batch(x), pm.local_batch(t))
    except ValueError:
        (flags / "failed").write_text(str(time.time()))
    if rank == 0:
        return "rank 0 went on"
    hook.remove()
    deadline = time.monotonic() + 300
    while not (flags / "rank0_exited").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # lives on, as a user's loop might, until the test has seen rank 0 stop
    try:
        pm.train_step(pm.local_batch(x), pm.local_batch(t))
    except PeerFailedError as e:
        return f"PeerFailedError: {e}"
    return "rank 1 trained again"


@pytest.mark.multiproc
def test_a_peer_blocked_on_a_rank_that_caught_its_failure_stops_within_seconds(tmp_path):
    import torch.multiprocessing as mp
    from dist_harness import _worker, free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, _caught_and_lives_on, (str(tmp_path),), results),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=240)
        stopped_s = time.time()
        (tmp_path / "rank0_exited").touch()
        rank, status, message = results.get(timeout=120)
        if status == "ok":  # _worker sends a rank's result pickled (dist_harness)
            message = pickle.loads(message)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    stderr_path = tmp_path / "rank0.stderr"
    err = stderr_path.read_text() if stderr_path.exists() else f"(rank {rank} {status}: {message})"
    assert procs[0].exitcode == 1, (procs[0].exitcode, err)
    assert "autopar: rank 1 failed during train_step (ValueError: boom in the last block) and has not gone on" in err
    waited_s = stopped_s - float((tmp_path / "failed").read_text())
    assert waited_s < 60, f"rank 0 stopped {waited_s:.0f} s after rank 1's failure"  # the group's timeout: 600 s
    print(f"rank 0 stopped {waited_s:.1f} s after rank 1's failure")
    assert (rank, status) == (1, "ok"), message
    # the store lived in rank 0's process (as `init_process_group` makes it): the entry point says it has ended
    # (under torchrun the agent holds it, and the entry point names rank 0's stop: the tests above)
    assert message.startswith("PeerFailedError: the job's store cannot be reached"), message


_EXIT_INSIDE_A_STEP = """
import atexit, os, sys, threading
import torch.distributed as dist
seen = {}
atexit.register(lambda: print("watch alive at exit:", seen["thread"].is_alive(), flush=True))  # runs last
from autopar.codegen import failures
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
with failures.named_failures("train_step"):  # starts the watch, which polls the store while inside
    seen["thread"] = failures._thread
    threading.Event().wait(3 * failures.POLL_S)
    sys.exit(0)  # leaves the interpreter from inside an entry point, the group never destroyed
"""


def test_the_watch_thread_ends_before_the_interpreter_finalizes():
    """A daemon thread caught inside a store request when finalization starts aborts the process after a
    run that succeeded ("terminate called without an active exception"): the watch is stopped and joined
    by an exit hook while the interpreter is whole, so no poll can be in flight when it finalizes."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", _EXIT_INSIDE_A_STEP, str(port)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "watch alive at exit: False" in out.stdout
