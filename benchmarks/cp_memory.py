"""Long-context memory under context parallelism: what a cp rank keeps for backward, measured on CPU, beside its price.

    PYTHONPATH=$PWD python benchmarks/cp_memory.py                    # 16,384 tokens, cp2, every recompute mode
    PYTHONPATH=$PWD python benchmarks/cp_memory.py --seq 32768 --hidden 128

A transformers Llama (2 layers, grouped-query attention: 4 query heads, 2 key/value heads, fp32) trains one
step of one sequence under cp=2 on two gloo ranks, once per recompute mode (cost_models.memory.RECOMPUTE_MODES),
under autopar's runtime and the lm_cross_entropy loss. Measured on each rank, with torch's MemTracker (which
follows every storage from its allocation to its release): the bytes alive when the loss has run, before
backward starts — everything the forward left for backward (the layers' saved tensors, what a recompute
policy caches, the checkpointed blocks' inputs, the logits and the loss's log-sum-exps) plus the batch. Priced
by the plan of that layout (`Plan.estimate.memory_breakdown`): the activations, and of the logits what the
chunked loss keeps from its forward to its backward (cost_models.memory.loss_saved_bytes: the logits and a
fp32 log-sum-exp per token; `logits` itself prices the loss backward's peak, which adds their gradient).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ModeMemory", "measure_rank", "measure", "SHAPE", "main"]

MIB = 2 ** 20
# the model's shape: tiny enough that 16k tokens train in seconds on a CPU core, with grouped-query attention
SHAPE = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)


@dataclass(frozen=True, kw_only=True)
class ModeMemory:
    """One recompute mode on one cp rank (bytes)."""

    mode: str
    measured_bytes: int  # alive when the loss has run (MemTracker's activations), the batch excluded
    priced_activation_bytes: int  # memory_breakdown["activations"]
    priced_loss_saved_bytes: int  # the logits and log-sum-exps the loss keeps for backward
    priced_logits_peak_bytes: int  # memory_breakdown["logits"]: the loss backward's peak
    measured_loss_peak_bytes: int  # the step's peak less the bytes alive when the loss had run

    @property
    def priced_bytes(self) -> int:
        return self.priced_activation_bytes + self.priced_loss_saved_bytes

    @property
    def error(self) -> float:
        """(priced − measured) / measured."""
        return (self.priced_bytes - self.measured_bytes) / self.measured_bytes


def _model(seq: int, shape: dict[str, int], device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, max_position_embeddings=seq, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device(device):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).float()


def _current(tracker: Any) -> dict[str, int]:
    snapshot = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
    return {str(k).split(".")[-1]: int(v) for k, v in snapshot.items()}


def measure_rank(seq: int = 16384, modes: tuple[str, ...] = ("none", "selective", "op_sac", "full"),
                 shape: dict[str, int] | None = None, cp: int = 2) -> list[dict[str, Any]]:
    """Run in each of two gloo ranks: one cp2 training step per mode (module docstring)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import autopar
    from autopar.codegen import lm_cross_entropy, parallelize
    from cost_models.memory import loss_saved_bytes

    shape = {**SHAPE, **(shape or {})}
    graph = autopar.capture(_model(seq, shape, "meta"), (torch.zeros(1, seq, dtype=torch.long),))
    cluster = dataclasses.replace(autopar.Cluster.preset("dgx-h200"), devices_per_node=cp)
    ids = torch.randint(0, shape["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(ids, -1, dims=1)
    out = []
    for mode in modes:
        opts = autopar.PlannerOptions(tp=1, pp=1, dp=1, cp=cp, micro_batch_size=1, num_microbatches=1, recompute=mode,
                                      zero_stage=0, precision="fp32", compile=False)
        plan = autopar.plan(graph, cluster, global_batch_size=1, options=opts)
        tracker = MemTracker()
        at_loss: dict[str, int] = {}

        def loss(logits: torch.Tensor, t: torch.Tensor, tracker=tracker, at_loss=at_loss) -> torch.Tensor:
            value = lm_cross_entropy(logits, t)
            at_loss.update(_current(tracker))
            return value

        model = _model(seq, shape, "cpu")
        pm = parallelize(model, plan, graph=graph, loss_fn=loss,
                         optimizer=lambda named: torch.optim.AdamW([p for _, p in named]))
        tracker.track_external(model, pm.optimizer)
        x, t = pm.local_batch(ids), pm.local_batch(targets)
        with tracker:
            pm.train_step(x, t)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        # the rank's shard of the batch: ids and targets, int64 (the runtime's copies, made in the step)
        batch = 2 * 8 * seq // cp
        breakdown = plan.estimate.memory_breakdown
        saved_loss = loss_saved_bytes(micro_batch=1, seq_len=seq // cp, vocab=shape["vocab_size"], dtype_bytes=4,
                                      loss_kernel="chunked")
        out.append(dataclasses.asdict(ModeMemory(
            mode=mode, measured_bytes=at_loss["ACT"] - batch, priced_activation_bytes=int(breakdown["activations"]),
            priced_loss_saved_bytes=int(saved_loss), priced_logits_peak_bytes=int(breakdown["logits"]),
            measured_loss_peak_bytes=int(sum(v for k, v in peak.items() if str(k).endswith(("ACT", "TEMP"))))
            - at_loss["ACT"])))
    return out


def measure(seq: int = 16384, modes: tuple[str, ...] = ("none", "selective", "op_sac", "full"),
            shape: dict[str, int] | None = None) -> list[list[ModeMemory]]:
    """Per rank, per mode: `measure_rank` on two gloo ranks (tests/dist_harness.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from dist_harness import run_distributed

    per_rank = run_distributed(measure_rank, 2, seq, modes, shape, timeout_s=1800)
    return [[ModeMemory(**m) for m in rank] for rank in per_rank]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    args = ap.parse_args()
    shape = {"hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4}
    per_rank = measure(args.seq, shape=shape)
    print(f"transformers Llama {({**SHAPE, **shape})}, one sequence of {args.seq} tokens, cp=2, fp32; MiB per rank")
    print(f"{'rank':>4} {'mode':>10} {'measured':>10} {'priced':>10} {'(acts':>10} {'+ loss)':>9} {'error':>7}")
    for r, modes in enumerate(per_rank):
        for m in modes:
            print(f"{r:>4} {m.mode:>10} {m.measured_bytes / MIB:10.2f} {m.priced_bytes / MIB:10.2f} "
                  f"{m.priced_activation_bytes / MIB:10.2f} {m.priced_loss_saved_bytes / MIB:9.2f} {m.error:+7.2%}")


if __name__ == "__main__":
    main()
