"""Training precision, gradient clipping, loss scaling and the user's optimizer (issue 20), in gloo jobs
against one process (tests/precision_cases.py runs the cases inside the ranks).

- bf16: 5 AdamW steps under dp, ZeRO-1, ZeRO-3, tp2, pp2 (1F1B, interleaved) and tp2×pp2×dp2 (in
  tests/test_eight_ranks.py's shared eight-rank job) follow one process under torch.autocast(bfloat16)
  with fp32 AdamW within 2e-2; Linears run in bf16 and the optimizer steps fp32 parameters.
- fp32 with max_grad_norm=0.05 (active every step) on a model with tied embeddings: `grad_norm` equals
  clip_grad_norm_'s within 1e-5 relative, losses within rtol 1e-4, weights within rtol 1e-4 / atol 1e-5;
  the same layouts, and cp2 alone, with dp2 under ZeRO-1 and with dp2 under ZeRO-3 (gradients averaged
  and sharded over the flattened dp·cp axis). bf16 under cp2 as well, and FP8 linears (tensorwise, float8
  all-gathers under ZeRO-3) under the bf16 policy.
- fp16: a step whose gradients overflow on one rank's shard is skipped on every rank and halves the scale;
  a checkpoint carries the scaler's state to a resumed run.
- memory: the bytes of every parameter, gradient and optimizer-state tensor per rank equal the planner's
  model-state bytes for that rank within 1%, per precision × ZeRO stage × tp.
- LR schedules and parameter groups by name on `ParallelModel.optimizer` give one process's learning
  rates and losses.
"""

from __future__ import annotations

import math

import pytest
from dist_harness import run_distributed
from parity_models import ATOL, RTOL
from precision_cases import MODES, job

pytestmark = pytest.mark.multiproc

LAYOUTS_2 = [dict(dp=2), dict(dp=2, zero_stage=1), dict(dp=2, zero_stage=3, num_microbatches=2), dict(tp=2),
             dict(pp=2, num_microbatches=4, schedule="1f1b"),
             dict(pp=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)]
BF16_TOL = 2e-2
CLIP = dict(MODES["clip"], steps=3)


def _cases(layouts: list[dict]) -> list:
    return ([("gpt", cfg, dict(precision="bf16")) for cfg in layouts]
            + [("llama_tied", cfg, CLIP) for cfg in layouts])


def check_policy(results: list[dict]) -> None:
    """Each case's losses, grad norms, weights and dtypes against its one-process reference."""
    failures = []
    for r in results:
        if "bf16" in r["case"]:
            if not all(math.isclose(a, b, rel_tol=BF16_TOL) for a, b in zip(r["losses"], r["ref_losses"], strict=True)):
                failures.append(f"{r['case']}: losses {r['losses']} vs autocast reference {r['ref_losses']}")
            if r["linear_dtypes"] != ["torch.bfloat16"]:
                failures.append(f"{r['case']}: a Linear's output is {r['linear_dtypes']}, not bf16")
        else:
            if not all(math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) for a, b in zip(r["losses"], r["ref_losses"],
                                                                                      strict=True)):
                failures.append(f"{r['case']}: losses {r['losses']} vs reference {r['ref_losses']}")
            if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(r["norms"], r["ref_norms"], strict=True)):
                failures.append(f"{r['case']}: grad_norm {r['norms']} vs clip_grad_norm_ {r['ref_norms']}")
            if not all(n > 0.05 for n in r["ref_norms"]):
                failures.append(f"{r['case']}: clipping was not active on every step ({r['ref_norms']})")
            if r["weight_excess"] > ATOL:
                failures.append(f"{r['case']}: weight {r['weight_key']} off by {r['weight_excess']:.2e} beyond rtol")
        if r["optimizer_dtypes"] != ["torch.float32"]:
            failures.append(f"{r['case']}: the optimizer steps {r['optimizer_dtypes']} parameters, not fp32")
    assert not failures, "\n".join(failures)


def test_policies_clipping_and_schedules_on_two_ranks():
    # offload="optimizer" under ZeRO-1: pm.optimizer is still the user's (it steps the owned host masters)
    schedules = [dict(dp=2, zero_stage=1), dict(tp=2), dict(pp=2, num_microbatches=2),
                 dict(dp=2, zero_stage=1, offload="optimizer")]
    # context parallelism needs a model taking position_ids (the Llama), not the zoo GPT
    cp = [("llama_tied", dict(cp=2), dict(precision="bf16")), ("llama_tied", dict(cp=2), CLIP)]
    # FP8 linears (torchao, emulated on CPU) under the bf16 policy: float8 all-gathers of fp32 masters' shards
    fp8 = [("gpt", dict(dp=2, zero_stage=3, num_microbatches=2, fp8="tensorwise"), dict(precision="bf16"))]
    results = run_distributed(job, 2, _cases(LAYOUTS_2) + cp + fp8, schedules, timeout_s=900)
    check_policy(results[0]["policy"])
    failures = []
    for r in results[0]["schedules"]:
        if r["lrs"] != pytest.approx(r["ref_lrs"], rel=1e-12) or len(set(r["lrs"])) < 4:
            failures.append(f"{r['case']}: learning rates {r['lrs']} vs {r['ref_lrs']}")
        if not all(math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) for a, b in zip(r["losses"], r["ref_losses"],
                                                                                  strict=True)):
            failures.append(f"{r['case']}: losses {r['losses']} vs {r['ref_losses']}")
        if not (r["decay_ok"] and r["is_optimizer"]) or r["weight_excess"] > ATOL:
            failures.append(f"{r['case']}: parameter groups by name lost, or weights off ({r['weight_excess']:.2e} "
                            f"at {r['weight_key']})")
    assert not failures, "\n".join(failures)


def test_memory_bytes_fp16_overflow_and_cp_clipping_on_four_ranks(tmp_path):
    cases = [(prec, zero, tp) for prec in ("fp32", "bf16", "fp16") for zero in (0, 1, 2, 3) for tp in (1, 2)]
    # clipping where gradients are averaged over the flattened dp·cp axis: ZeRO-1 owners and FSDP shards on it
    cp = [("llama_tied", dict(cp=2, dp=2, zero_stage=z), CLIP) for z in (1, 3)]
    results = run_distributed(job, 4, cp, None, cases, str(tmp_path / "ck"), timeout_s=900)
    check_policy(results[0]["policy"])
    failures = []
    for rank in results:
        for r in rank["memory"]:
            for state, want in r["want"].items():
                if not math.isclose(r["got"][state], want, rel_tol=0.01):
                    failures.append(f"{r['case']}: {state} {r['got'][state]:,} B held vs {want:,} B planned")
        o = rank["overflow"]
        if o["unchanged"] != [False, True, False] or o["skipped"] != 1:
            failures.append(f"rank {o['rank']}: steps changed the weights {[not u for u in o['unchanged']]}, "
                            f"{o['skipped']} skipped; want only step 2 skipped")
        (s0, s1), (t0, t1) = o["scales"][0], o["scales"][1]
        if not (s1 == s0 and t1 == t0 / 2 and math.isinf(o["norms"][1])):
            failures.append(f"rank {o['rank']}: scales {o['scales']}, norms {o['norms']}; want the scale halved "
                            "at the overflowing step only")
        if o["resumed_scaler"] != o["saved_scaler"] or o["saved_scaler"]["skipped_steps"] != 1:
            failures.append(f"rank {o['rank']}: resumed loss scaler {o['resumed_scaler']}, saved {o['saved_scaler']}")
    assert not failures, "\n".join(failures)
