"""Plans for full-size mixture-of-experts models, beside the closest published runs.

Mixtral-8x7B (transformers' default MixtralConfig) on 8 DGX H100 nodes at batch 512 × 4096, and
DeepSeek-V3 (671B, transformers' default DeepseekV3Config) on 256 H800 nodes at its final batch of 15,360 ×
4096, both built and captured on the meta device in bf16; each plan with its capture and planning time,
its predicted MFU, the best plan without expert parallelism, and (DeepSeek-V3) its published layout
(PP16 · EP64 · ZeRO-1 on 2,048 H800, no TP: DeepSeek-V3 technical report, arXiv 2412.19437, §3.2) priced
with `autopar.estimate`.

Published figures the plans are set beside:
- Megatron-Core's MoE README (NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md, MCore v0.9,
  2024-11): Mixtral-8x7B bf16 dropless at 468 TFLOP/s per H100 on 64 GPUs (TP1 EP8 PP4 VP8, batch 256 × 4096).
- MoE Parallel Folding (Liu et al. 2025, arXiv 2504.14960, abstract): Megatron-Core reaches 49.3% MFU on
  Mixtral-8x22B and 39.0% on Qwen2-57B-A14B on H100.
- DeepSeek-V3 report, Table 1 / §1: pre-training on 14.8T tokens took 2.664M H800 GPU hours, i.e.
  14.8e12 / (2.664e6 · 3600) = 1,543 tokens/s per GPU; at 6 · 37B activated parameters per token that is
  35% of the H800's 989 TFLOP/s bf16 peak (DeepSeek trained its GEMMs in FP8, whose peak is twice that).

    python benchmarks/moe_plans.py [--load-imbalance F]
"""

from __future__ import annotations

import argparse
import time

import torch

import autopar
from autopar import Cluster, ParallelConfig, PlannerOptions
from autopar.errors import InfeasiblePlanError

DEEPSEEK_TOKENS_PER_S_PER_GPU = 14.8e12 / (2.664e6 * 3600)
DEEPSEEK_ACTIVE_PARAMS = 37e9


def _captured(config_name: str, model_name: str, seq_len: int, imbalance: float | None):
    import transformers

    cfg = getattr(transformers, config_name)()
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = getattr(transformers, model_name)(cfg).to(torch.bfloat16)
    built = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    graph = autopar.capture(model, (torch.zeros(1, seq_len, dtype=torch.long, device="meta"),))
    print(f"{model_name}: {graph.num_params / 1e9:.1f}B parameters ({graph.expert_params / 1e9:.1f}B in experts), "
          f"built in {built:.1f} s, captured in {time.perf_counter() - t0:.1f} s wall / "
          f"{time.process_time() - c0:.1f} s CPU")
    return graph.with_moe_load_imbalance(imbalance) if imbalance is not None else graph


def _plan(graph, cluster: Cluster, batch: int, label: str) -> autopar.Plan:
    t0, c0 = time.perf_counter(), time.process_time()
    plan = autopar.plan(graph, cluster, global_batch_size=batch)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    try:
        dense = autopar.plan(graph, cluster, global_batch_size=batch, options=PlannerOptions(ep=1, top_k=0))
        without = f"{dense.config}: MFU {dense.estimate.mfu:.1%}"
    except InfeasiblePlanError as e:
        without = f"none fits ({e})"
    print(f"  {label}: {plan.config}\n    MFU {plan.estimate.mfu:.1%}, step {plan.estimate.step_time_s:.2f} s, "
          f"{plan.estimate.tokens_per_s / cluster.world_size:,.0f} tokens/s/GPU; planned in "
          f"{wall:.1f} s wall / {cpu:.1f} s CPU ({plan.solver.configs_considered:,} layouts, {plan.solver.ilps_solved} "
          f"ILPs; both searches {time.perf_counter() - t0:.1f} s wall / {time.process_time() - c0:.1f} s CPU), "
          f"{plan.solver.status}, gap {plan.solver.gap:g}\n"
          f"    best without expert parallelism: {without}")
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load-imbalance", type=float, default=None,
                    help="busiest expert's tokens ÷ the mean (default: capture's DEFAULT_LOAD_IMBALANCE, 1.0)")
    args = ap.parse_args(argv)

    mixtral = _captured("MixtralConfig", "MixtralForCausalLM", 4096, args.load_imbalance)
    _plan(mixtral, Cluster.preset("dgx-h100", nodes=8), 512, "Mixtral-8x7B on 64 H100, batch 512 × 4096")
    print("    closest published: Megatron-Core, Mixtral-8x7B (dropless), 64 H100, TP1 EP8 PP4 VP8, batch 256 × 4096: "
          "468 TFLOP/s/GPU by Megatron's count (MCore v0.9, megatron/core/transformer/moe/README.md), 47.3% of the "
          "bf16 peak; priced on its own layout by `python benchmarks/published_runs.py --only mixtral`")

    dsv3 = _captured("DeepseekV3Config", "DeepseekV3ForCausalLM", 4096, args.load_imbalance)
    h800 = Cluster.preset("hgx-h800", nodes=256)
    _plan(dsv3, h800, 15360, "DeepSeek-V3 on 2,048 H800, batch 15,360 × 4096")
    pub_mfu = 6 * DEEPSEEK_ACTIVE_PARAMS * DEEPSEEK_TOKENS_PER_S_PER_GPU / h800.device.peak_flops_for("bfloat16")
    moe = next(la.moe for la in dsv3.layers if la.moe is not None)
    print(f"    router: top-{moe.top_k} of {moe.num_experts} experts inside {moe.route_group_top_k} of "
          f"{moe.route_groups} groups (found by capture)")
    # DeepSeek recomputes norms and MLA up-projections: between none and full. Dispatched by autopar's runtime
    # (an NCCL all-to-all of every routed copy) and as DeepSeek dispatches (DeepEP's kernels: InfiniBand once
    # per token and destination node, at most 4 nodes under its node-limited router)
    for recompute, dispatcher in (("none", "all_to_all"), ("full", "all_to_all"), ("full", "deepep")):
        own = ParallelConfig(pp=16, dp=128, ep=64, zero_stage=1, micro_batch_size=1, num_microbatches=120,
                             recompute=recompute)
        est = autopar.estimate(dsv3, h800, own, global_batch_size=15360,
                               options=PlannerOptions(ep_dispatcher=dispatcher))
        print(f"  DeepSeek's layout {own}, {dispatcher} dispatch: MFU {est.mfu:.1%}, "
              f"{est.tokens_per_s / h800.world_size:,.0f} tokens/s/GPU, all-to-all and TP "
              f"{est.breakdown['tp_comm']:.1f} s of {est.step_time_s:.1f} s, "
              f"peak {est.peak_memory_bytes / 2**30:.0f} GiB, fits={est.fits}")
    print(f"    published: {DEEPSEEK_TOKENS_PER_S_PER_GPU:,.0f} tokens/s/GPU over pre-training = {pub_mfu:.1%} of the "
          "bf16 peak by 6·37B (FP8 GEMMs, all-to-all hidden under DualPipe; arXiv 2412.19437)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
