"""ParallelConfig / PlannerOptions validate themselves and round-trip through text and JSON."""

import pytest

from autopar import ParallelConfig, PlannerOptions
from autopar.errors import ConfigError


def test_parse_round_trips_str():
    cfg = ParallelConfig(tp=8, pp=16, dp=8, zero_stage=1, micro_batch_size=1, num_microbatches=192,
                         schedule="interleaved_1f1b", virtual_stages=3, recompute="selective",
                         sequence_parallel=True)
    assert ParallelConfig.parse(str(cfg)) == cfg
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.world_size == 1024
    assert cfg.global_batch_size == 8 * 1 * 192


def test_parse_partial_uses_defaults():
    cfg = ParallelConfig.parse("tp=4, pp=2", dp=2, num_microbatches=4)
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.num_microbatches) == (4, 2, 2, 4)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"tp": 0}, "positive integer"),
        ({"zero_stage": 4}, "zero_stage"),
        ({"schedule": "zigzag"}, "schedule"),
        ({"recompute": "some"}, "recompute"),
        ({"sequence_parallel": True}, "tp > 1"),
        ({"schedule": "interleaved_1f1b", "pp": 1}, "pp > 1"),
        ({"schedule": "interleaved_1f1b", "pp": 2, "num_microbatches": 3}, "divisible"),
        ({"virtual_stages": 2}, "interleaved"),
        ({"fp8": "e4m3"}, "fp8"),
        ({"offload": "disk"}, "offload"),
        ({"offload": "params", "dp": 2, "zero_stage": 1}, "zero_stage=3"),
    ],
)
def test_invalid_config_says_what_to_fix(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        ParallelConfig(**kwargs)


def test_parse_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="unknown config key"):
        ParallelConfig.parse("tq=4")
    with pytest.raises(ValueError, match="not an integer"):
        ParallelConfig.parse("tp=four")
    with pytest.raises(ValueError, match="key=value"):
        ParallelConfig.parse("tp4")


def test_planner_options_validate():
    with pytest.raises(ValueError, match="exclude_schedules"):
        PlannerOptions(exclude_schedules=("zigzag",))
    assert PlannerOptions(tp=2).tp == 2


def test_fp8_and_offload_round_trip_and_print():
    cfg = ParallelConfig(dp=4, zero_stage=3, fp8="rowwise", offload="params")
    assert "fp8=rowwise" in str(cfg) and "offload=params" in str(cfg)
    assert ParallelConfig.parse(str(cfg)) == cfg
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("fp8", "offload")}  # a plan saved before them
    assert ParallelConfig.from_dict(old).fp8 == "none" and ParallelConfig.from_dict(old).offload == "none"
    assert "fp8" not in str(ParallelConfig())


@pytest.mark.parametrize(("spec", "key"), [("tp=2,tp=1", "'tp' is"), ("num_microbatches=4,m=2", "as num_microbatches"),
                                            ("pp=2, schedule=gpipe ,schedule=1f1b", "'schedule' is")])
def test_parse_refuses_a_key_given_twice(spec: str, key: str) -> None:
    """A key given twice (also once by its alias) is refused naming it, not silently the last value."""
    with pytest.raises(ConfigError, match=f"{key}.*given twice|given twice.*{key}"):
        ParallelConfig.parse(spec)
    with pytest.raises(ConfigError, match="given twice"):
        ParallelConfig.parse_fields(spec)
