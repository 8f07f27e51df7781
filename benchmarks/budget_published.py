"""`autopar.budget` against the pretraining GPU-hours open models publish: predicted vs published, as a table.

Llama 2 (Touvron et al. 2023, arXiv 2307.09288): Table 2 gives the pretraining time of each size in
A100-80GB GPU-hours (7B 184,320; 13B 368,640; 34B 1,038,336; 70B 1,720,320); Table 1: 2.0T tokens, 4k
context, a global batch of 4M tokens; §2.2.1: Meta's Research Super Cluster and production clusters, both
A100 with 200 Gbps endpoints per GPU (InfiniBand on RSC, RoCE in production): the `dgx-a100-80gb`
preset (HDR InfiniBand, 200 Gb/s per GPU). The paper gives no GPU count per model, so each model is
planned on 32..256 nodes (256 to 2,048 GPUs; LLaMA 1's 65B ran on 2,048 A100-80GB, Touvron et al. 2023a
§2.4) and the table shows the GPU-hours at the most efficient size swept and at 2,048 GPUs.

Models: the zoo's Llama 3 configs with Llama 2's shapes (Table 1 and the released configs): vocabulary
32,000, 4,096-token sequences, 7B and 13B without grouped-query attention (n_kv_heads = n_heads), 7B
ffn 11,008, 13B 40 layers × 5,120 with ffn 13,824, 34B 48 layers × 8,192 with ffn 22,016, 70B as
llama3-70b. Goodput 1.0 (the GPU-hours are taken as time training; `implied goodput` = predicted /
published is what would close the gap).

    python benchmarks/budget_published.py          # ~1-2 min on 2 idle cores
"""

from __future__ import annotations

import time

import autopar

TOKENS = 2.0e12
BATCH_TOKENS = 1024 * 4096  # "4M tokens"
NODES = [32, 64, 128, 256]
ROWS = [  # name, zoo base, overrides, published A100-80GB GPU-hours (Llama 2 Table 2)
    ("Llama 2 7B", "llama3-8b", dict(n_kv_heads=32, ffn_hidden_size=11008, vocab_size=32000), 184_320),
    ("Llama 2 13B", "llama3-8b", dict(n_layers=40, hidden_size=5120, n_heads=40, n_kv_heads=40,
                                      ffn_hidden_size=13824, vocab_size=32000), 368_640),
    ("Llama 2 34B", "llama3-70b", dict(n_layers=48, ffn_hidden_size=22016, vocab_size=32000), 1_038_336),
    ("Llama 2 70B", "llama3-70b", dict(vocab_size=32000), 1_720_320),
]


def main() -> None:
    t0 = time.perf_counter()
    print("| model (zoo config) | published GPU-h | predicted at best size (GPUs, layout) | error | band | "
          "at 2,048 GPUs | error | implied goodput |")
    print("|---|---|---|---|---|---|---|---|")
    for name, base, over, published in ROWS:
        model, inputs = autopar.zoo.build(base, seq_len=4096, **over)
        graph = autopar.capture(model, inputs)
        b = autopar.budget(graph, tokens=TOKENS, clusters=["dgx-a100-80gb"], nodes=NODES,
                           global_batch_tokens=BATCH_TOKENS)
        fits = [p for p in b.points if p.fits]
        best = min(fits, key=lambda p: p.gpu_hours)
        at2k = next(p for p in b.points if p.gpus == 2048)
        e = best.plan.estimate
        lo, hi = best.gpu_hours * (1 + e.band_lo), best.gpu_hours * (1 + e.band_hi)
        inside = "inside" if lo <= published <= hi else "outside"
        e2 = at2k.plan.estimate
        inside2 = "inside" if at2k.gpu_hours * (1 + e2.band_lo) <= published <= at2k.gpu_hours * (1 + e2.band_hi) \
            else "outside"
        print(f"| {name} ({base} + {len(over)} fields) | {published:,} | {best.gpu_hours:,.0f} ({best.gpus}, "
              f"{best.plan.config}) | "
              f"{best.gpu_hours / published - 1:+.1%} | {lo:,.0f}–{hi:,.0f} ({inside}) | {at2k.gpu_hours:,.0f} | "
              f"{at2k.gpu_hours / published - 1:+.1%} (band {e2.band_lo:+.0%}/{e2.band_hi:+.0%}: {inside2}) | "
              f"{best.gpu_hours / published:.2f} |", flush=True)
    print(f"\n{TOKENS:.1e} tokens, batch {BATCH_TOKENS:,} tokens, dgx-a100-80gb, goodput 1.0; "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
