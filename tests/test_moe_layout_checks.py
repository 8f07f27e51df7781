"""What a layout asks of a mixture-of-experts model's experts, checked at `estimate`, and the expert banks'
activations each rank holds under folding and expert tensor parallelism (the rest of expert parallelism's
pricing: tests/test_moe_planner.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.config import ParallelConfig
from autopar.errors import InfeasiblePlanError
from autopar.planner.costs import CostModel
from autopar.planner.problem import MODES

sys.path.insert(0, str(Path(__file__).parent))
from hf_families import build_family  # noqa: E402
from test_planner import fake_cluster  # noqa: E402

SEQ = 16


@pytest.fixture(scope="module")
def moe():
    """Tiny Mixtral (4 experts, top-2) captured in bf16."""
    model = build_family("mixtral")
    return model, autopar.capture(model.to(torch.bfloat16), (torch.zeros(1, SEQ, dtype=torch.long),))


def test_estimate_refuses_expert_degrees_the_model_cannot_take() -> None:
    """`autopar.estimate` of a layout checks ep and etp against the captured experts as the planner's options
    are checked: the message names the model's expert count or FFN width (here 4 experts of width 30)."""
    import transformers

    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=30, num_hidden_layers=2, num_attention_heads=8,
                                     num_key_value_heads=4, num_local_experts=4, vocab_size=128)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16)
    g = autopar.capture(model, (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),))
    cluster = fake_cluster()
    cases = [(ParallelConfig(dp=8, ep=8, micro_batch_size=1), r"ep=8 does not divide the expert count .*\[4\]"),
             (ParallelConfig(tp=4, dp=2, ep=2, etp=4, micro_batch_size=4),
              r"etp=4 does not divide the experts' FFN width .*\[30\]")]
    for config, message in cases:
        with pytest.raises(InfeasiblePlanError, match=message):
            autopar.estimate(g, cluster, config, global_batch_size=8)
    assert autopar.estimate(g, cluster, ParallelConfig(tp=2, dp=4, ep=2, etp=2, micro_batch_size=2),
                            global_batch_size=8).step_time_s > 0  # 30 splits over 2


def test_expert_bank_activations_follow_the_rows_each_rank_runs(moe) -> None:
    """The bank's saved rows and FFN intermediates (LayerSpec.saved_activation_bytes_expert) are held at the
    rank's share: whole at tp2 without SP (every tp rank runs all rows of its replicated bank); half folded
    over tp (each tp rank takes half the rows) and under SP; tensor-parallel (etp2) with or without SP, every
    tp rank runs all its group's rows through half of each expert's FFN and keeps two h-wide rows per (token,
    slot) pair whole (the tokens entering the FFN, the expert's output the routing weight multiplies: measured
    on 2 ranks in tests/test_moe_expert_memory.py); the rest of the layer is priced as before."""
    _, g = moe
    costs = CostModel.for_cluster(g, fake_cluster())
    ri = next(i for i, run in enumerate(costs.memory.runs) if run[0].moe is not None)
    layer, mem, mbs = costs.memory.runs[ri][0], costs.memory, 2
    expert = layer.saved_activation_bytes_expert * mbs * mem.act_scale
    rows = 2 * SEQ * layer.moe.top_k * g.hidden_size * 2 * mbs * mem.act_scale  # 2 bf16 rows of h per pair
    assert 0 < rows < expert
    split = rows + (expert - rows) / 2  # etp2: the FFN-wide rest halved
    none = MODES.index("none")
    base = mem.activation_bytes(ri, 2, False, mbs)[none]
    for ep, etp, kept in ((2, 1, expert / 2), (1, 2, split), (2, 2, split)):  # folded; FFN split; both ways
        assert base - mem.activation_bytes(ri, 2, False, mbs, ep=ep, etp=etp)[none] == pytest.approx(expert - kept)
    sp = mem.activation_bytes(ri, 2, True, mbs)[none]
    assert mem.activation_bytes(ri, 2, True, mbs, ep=2)[none] == pytest.approx(sp)
    for ep in (1, 2):  # etp2 under SP: the rows gathered over tp, whole
        assert mem.activation_bytes(ri, 2, True, mbs, ep=ep, etp=2)[none] - sp == pytest.approx(split - expert / 2)
    assert mem.activation_bytes(ri, 1, False, mbs, ep=4)[none] == pytest.approx(
        mem.activation_bytes(ri, 1, False, mbs)[none])  # ep over dp: every rank runs its own tokens' rows
