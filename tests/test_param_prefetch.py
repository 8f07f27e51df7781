"""ZeRO-1's parameter broadcast overlapped with the next step's forward (autopar.codegen.param_prefetch), in gloo
jobs: the same run with the broadcast after the step (the old path) gives the same losses, gradients, weights and
mid-training checkpoint bit for bit; each step issues one broadcast per bucket, a bucket one owner's parameters
(Σ_owner its buckets ≤ ⌈B / bucket⌉ + dp); every bucket of a step's broadcast is waited for by a forward pre-hook of the
next step, except after a save, which waits for them all itself."""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from param_prefetch_cases import SAVE_AFTER, job

pytestmark = pytest.mark.multiproc


def _check(results: list[dict]) -> list[str]:
    failures = []
    for r in results:
        name = r["case"]
        if r["grads_differ"] or r["weights_differ"] or r["losses"][0] != r["losses"][1] or not r["grads_compared"]:
            failures.append(f"{name}: gradients {r['grads_differ'][:3]}, weights {r['weights_differ'][:3]} differ; "
                            f"losses {r['losses']} ({r['grads_compared']} gradients compared)")
        if r["checkpoint_differs"]:
            failures.append(f"{name}: the checkpoint saved after step {SAVE_AFTER} differs: "
                            f"{r['checkpoint_differs'][:5]}")
        if r["buckets"] < 2 or r["in_flight"] != ([False] * len(r["waits"]), [True] * len(r["waits"])):
            failures.append(f"{name}: {r['buckets']} buckets; in flight after each step (old, new) {r['in_flight']}")
        # one broadcast per bucket, a bucket one owner's: Σ_owner its buckets ≤ ⌈B / bucket⌉ + dp a step (buckets
        # packed across owners cost up to dp broadcasts each)
        want, bound = r["owner_buckets"]
        if r["buckets"] != want or want > bound or set(r["broadcasts"]) != {want}:
            failures.append(f"{name}: {r['buckets']} buckets, broadcasts issued per step {r['broadcasts']}; want "
                            f"{want} (one per owner's bucket, ≤ {bound})")
        for step, waits in enumerate(r["waits"], start=1):
            # step 1 waits for nothing (no broadcast before it); the step after the save: the save waited
            want_forward = step > 1 and step != SAVE_AFTER + 1
            buckets = sorted(w.bucket for w in waits)
            if step > 1 and buckets != list(range(r["buckets"])):
                failures.append(f"{name}: step {step} waited for buckets {buckets} of {r['buckets']}")
            wrong = [w for w in waits if w.in_forward != want_forward
                     or (not want_forward and w.where != "save")]
            if wrong:
                failures.append(f"{name}: step {step}: waits {wrong[:3]} not where expected "
                                f"({'forward pre-hooks' if want_forward else 'the save'})")
        if r["user_state_dict"] != (True, False, ["state_dict"]):
            failures.append(f"{name}: a module's own state_dict() after the last step (in flight before, after, "
                            f"waited by): {r['user_state_dict']}")
        if any(r["old_waits"]):
            failures.append(f"{name}: the after-step path left broadcasts to wait for: {r['old_waits']}")
    return failures


def test_prefetched_broadcast_is_bit_identical_on_two_ranks(tmp_path):
    cases = [("gpt", dict(dp=2, zero_stage=1, num_microbatches=2), {}),
             ("gpt", dict(dp=2, zero_stage=1, num_microbatches=2, precision="bf16"), dict(max_grad_norm=0.05)),
             # out_proj of nn.MultiheadAttention and nn.ParameterList entries: no forward of their own runs
             ("param_list", dict(dp=2, zero_stage=1, num_microbatches=2), {})]
    results = run_distributed(job, 2, str(tmp_path), cases, timeout_s=600)
    assert not _check(results[0] + results[1])


def test_prefetched_broadcast_under_pipeline_and_tensor_parallel_on_four_ranks(tmp_path):
    cases = [("gpt", dict(dp=2, pp=2, zero_stage=1, num_microbatches=2, schedule="1f1b"), {}),
             ("llama_tied", dict(dp=2, tp=2, zero_stage=1, num_microbatches=2, precision="bf16"),
              dict(max_grad_norm=0.05))]
    results = run_distributed(job, 4, str(tmp_path), cases, timeout_s=600)
    assert not _check([r for rank in results for r in rank])
