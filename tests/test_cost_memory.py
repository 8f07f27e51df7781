"""Memory model against ZeRO (Rajbhandari et al. 2020, Fig. 1) and Korthikanti et al. 2022 (Table 2)."""

import pytest

from cost_models import memory


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_worked_example(stage, expected_gb):
    # Ψ = 7.5B parameters, N_d = 64, mixed-precision Adam (K = 12): the ZeRO paper's Figure 1.
    states = memory.model_state_bytes(7.5e9, zero_stage=stage, dp=64)
    assert round(states.total_bytes / 1e9, 1) == expected_gb


def test_zero_stage_shards_the_right_states():
    s = memory.model_state_bytes(1000, zero_stage=2, dp=10)
    assert (s.weights_bytes, s.grads_bytes, s.optimizer_bytes) == (2000, 200, 1200)
    s3 = memory.model_state_bytes(1000, zero_stage=3, dp=10, optimizer_bytes=8)  # e.g. bf16 Adam states
    assert s3.total_bytes == pytest.approx((2 + 2 + 8) * 1000 / 10)


# GPT-3 175B layer: s = 2048, h = 12288, a = 96, b = 1, t = 8 (Korthikanti et al. 2022, §5).
S, H, A, B, T = 2048, 12288, 96, 1, 8
SBH = S * B * H


@pytest.mark.parametrize("tp,sp,recompute,paper", [
    (1, False, "none", SBH * (34 + 5 * A * S / H)),
    (T, False, "none", SBH * (10 + 24 / T + 5 * A * S / (H * T))),
    (T, True, "none", SBH * (34 + 5 * A * S / H) / T),
    (T, False, "selective", SBH * (10 + 24 / T)),
    (T, True, "selective", SBH * 34 / T),
    (1, False, "full", SBH * 2),
    (T, False, "full", SBH * 2),
])
def test_korthikanti_table2_on_gpt3_175b(tp, sp, recompute, paper):
    got = memory.korthikanti_activation_bytes(seq_len=S, micro_batch=B, hidden=H, heads=A, tp=tp,
                                              sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(paper, rel=0.01)


@pytest.mark.parametrize("tp,sp", [(1, False), (8, False), (8, True), (4, True)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_rules_on_korthikanti_decomposition_match_the_paper(tp, sp, recompute):
    # Per sample: 34·sh saved, of which 24·sh + 5as² inside TP regions, 5as² attention core, 2·sh input.
    core = 5 * A * S * S
    got = memory.layer_activation_bytes(saved_bytes=34 * S * H + core, tp_sharded_bytes=24 * S * H + core,
                                        attention_core_bytes=core, input_bytes=2 * S * H, micro_batch=2,
                                        tp=tp, sequence_parallel=sp, recompute=recompute)
    ref = memory.korthikanti_activation_bytes(seq_len=S, micro_batch=2, hidden=H, heads=A, tp=tp,
                                              sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(ref, rel=1e-12)


def test_inflight_microbatches_by_schedule():
    assert memory.inflight_microbatches("gpipe", 4, 16, 0) == 16
    assert [memory.inflight_microbatches("1f1b", 4, 16, i) for i in range(4)] == [4, 3, 2, 1]
    assert memory.inflight_microbatches("1f1b", 8, 2, 0) == 2  # fewer micro-batches than stages
    # Interleaved, p = 4, v = 2: Megatron warms up (p−i−1)·2 + (v−1)·p chunks, +1 in flight, each 1/v.
    assert memory.inflight_microbatches("interleaved_1f1b", 4, 8, 0, virtual_stages=2) == pytest.approx(11 / 2)
    assert memory.inflight_microbatches("interleaved_1f1b", 4, 8, 3, virtual_stages=2) == pytest.approx(5 / 2)


def test_transients():
    assert memory.zero3_gathered_param_bytes(largest_layer_param_bytes=100.0) == 300.0
    # the loss's peak over the logits: tests/test_loss_memory.py
    assert 0 < memory.ALLOCATOR_RESERVE_FRACTION < 0.5


@pytest.mark.parametrize("kwargs,match", [
    (dict(zero_stage=4, dp=8), "zero_stage"),
    (dict(zero_stage=1, dp=0), "dp"),
])
def test_bad_inputs_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        memory.model_state_bytes(1e9, **kwargs)


def test_bad_recompute_and_sp():
    with pytest.raises(ValueError, match="recompute"):
        memory.korthikanti_activation_bytes(seq_len=1, micro_batch=1, hidden=8, heads=1, recompute="some")
    with pytest.raises(ValueError, match="sequence_parallel"):
        memory.korthikanti_activation_bytes(seq_len=1, micro_batch=1, hidden=8, heads=1, sequence_parallel=True)


def test_reserved_is_the_peak_plus_the_allocators_fragmentation_within_the_device():
    """GMLake (Guo et al. 2024): the caching allocator holds 15% more than its tensors on average; short of
    memory it frees cached blocks, so what it holds never exceeds what the device offers, nor drops below
    the tensors themselves."""
    from cost_models.memory import ALLOCATOR_FRAGMENTATION, reserved_bytes

    gib = float(1 << 30)
    assert ALLOCATOR_FRAGMENTATION == 0.15
    assert reserved_bytes(70 * gib, 91 * gib) == pytest.approx(70 * gib / 0.85)  # torchtitan 8B: ~82.4
    assert reserved_bytes(70 * gib, 76 * gib) == 76 * gib
    assert reserved_bytes(80 * gib, 76 * gib) == 80 * gib
    with pytest.raises(ValueError):
        reserved_bytes(-1.0, 76 * gib)
