"""ZeRO-0/1 gradient all-reduce overlapped with backward (autopar.codegen.grad_overlap), in gloo jobs: the same
run with the reduction after backward (the old path) gives the same gradients, weights and losses bit for bit;
the buckets are all-reduced from backward hooks during the last micro-batch's backward, none earlier; and the
planner's NCCL price hides, per layer, the all-reduce behind that backward (autopar.planner.dp_costs)."""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from grad_overlap_cases import job

pytestmark = pytest.mark.multiproc


def _check(results: list[dict], m: int, one_stage: bool = True) -> list[str]:
    """one_stage: each rank runs one pipeline stage, whose last micro-batch's backward starts after all the
    others' (with two, one stage's buckets may launch while the other still has micro-batches to go)."""
    failures = []
    for r in results:
        if r["grads_differ"] or r["weights_differ"] or r["losses"][0] != r["losses"][1] or not r["grads_compared"]:
            failures.append(f"{r['case']}: gradients {r['grads_differ'][:3]}, weights {r['weights_differ'][:3]} "
                            f"differ; losses {r['losses']} ({r['grads_compared']} gradients compared)")
        first_micro_batch = sum(e // m for e in r["expected"])  # gradients the hooks count before the last one
        for step in r["launches"]:
            if [la.bucket for la in step] != list(range(r["buckets"])) or r["buckets"] < 2:
                failures.append(f"{r['case']}: launched {[la.bucket for la in step]} of {r['buckets']} buckets")
            late = [la for la in step if not la.in_backward
                    or (one_stage and la.grads_seen <= first_micro_batch * (m - 1))]
            if late:
                failures.append(f"{r['case']}: buckets launched after backward or before the last micro-batch: "
                                f"{late} ({first_micro_batch} gradients per micro-batch)")
        if any(step for step in r["old_launches"]):
            failures.append(f"{r['case']}: the after-backward path launched from hooks: {r['old_launches']}")
    return failures


def test_overlapped_reduction_is_bit_identical_on_two_ranks():
    cases = [("gpt", dict(dp=2, num_microbatches=2), {}),
             ("gpt", dict(dp=2, zero_stage=1, num_microbatches=2, precision="bf16"), dict(max_grad_norm=0.05)),
             ("llama_tied", dict(dp=2, zero_stage=1, num_microbatches=2, recompute="full"), {})]
    results = run_distributed(job, 2, cases, timeout_s=600)
    assert not _check(results[0] + results[1], m=2)


def test_overlapped_reduction_under_pipeline_and_tensor_parallel_on_four_ranks():
    cases = [("gpt", dict(dp=2, pp=2, zero_stage=1, num_microbatches=2, schedule="1f1b", precision="bf16"), {}),
             ("llama_tied", dict(dp=2, pp=2, num_microbatches=2, schedule="gpipe"), {}),
             ("gpt", dict(dp=2, tp=2, num_microbatches=2), dict(max_grad_norm=0.05))]
    results = run_distributed(job, 4, cases, timeout_s=600)
    assert not _check([r for rank in results for r in rank], m=2)
    interleaved = [("gpt", dict(dp=2, pp=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2), {})]
    results = run_distributed(job, 4, interleaved, timeout_s=600)
    assert not _check([r for rank in results for r in rank], m=4, one_stage=False)
