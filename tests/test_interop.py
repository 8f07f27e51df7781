"""autopar export / estimate --from: a plan written as a torchtitan TOML, Megatron-LM arguments and a DeepSpeed
ds_config reads back as the same layout with the same price, on a dense, an MoE and a long-context (cp) plan;
what a target cannot express is written as a note; each malformed input is refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

import autopar
from autopar.cli.main import main
from autopar.config import PlannerOptions
from autopar.errors import AutoparError
from autopar.interop import TARGETS, export_plan, import_layout

pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "fixtures" / "hf_configs"
CLUSTER = autopar.Cluster.preset("dgx-h100", nodes=2)
# settings all three formats express: sharded data parallelism, full recompute, 1F1B, no offload
PINS = dict(zero_stage=3, recompute="full", schedule="1f1b", offload="none")


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[autopar.ModelGraph, autopar.Plan]]:
    folder = tmp_path_factory.mktemp("dsv3")
    cfg = json.loads((FIXTURES / "deepseek-v3" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    from autopar.models import resolve_model

    graphs = {"dense": autopar.capture(*autopar.zoo.build("llama3-8b", seq_len=2048)),
              "moe": autopar.capture(*resolve_model(str(folder), 2048)),
              "long": autopar.capture(*autopar.zoo.build("llama3-8b", seq_len=32768))}
    options = {"dense": PlannerOptions(tp=2, pp=2, sequence_parallel=True, **PINS),
               "moe": PlannerOptions(tp=1, ep=4, **PINS),
               "long": PlannerOptions(tp=2, cp=4, sequence_parallel=True, **PINS)}
    return {k: (g, autopar.plan(g, CLUSTER, global_batch_size=32, options=options[k])) for k, g in graphs.items()}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["dense", "moe", "long"])
def test_export_import_round_trip_keeps_the_layout_and_its_price(plans, tmp_path: Path, target: str,
                                                                  kind: str) -> None:
    graph, plan = plans[kind]
    assert (plan.config.ep > 1) == (kind == "moe") and (plan.config.cp > 1) == (kind == "long")
    exported = export_plan(plan, target)
    path = tmp_path / f"layout.{ {'torchtitan': 'toml', 'deepspeed': 'json'}.get(target, 'txt') }"
    path.write_text(exported.text)
    source = f"@{path}" if target == "megatron" else str(path)
    blocks = sum(1 for la in graph.layers if la.kind == "block")
    got = import_layout(target, source, CLUSTER.world_size, blocks=blocks)
    assert got.config == plan.config, exported.text
    assert got.options.pipeline_runtime == {"torchtitan": "torch"}.get(target, target)
    assert export_plan(plan, target).text == exported.text
    # the same price: the imported layout priced as that framework runs it is the plan's layout priced so
    runtime = PlannerOptions(pipeline_runtime=got.options.pipeline_runtime)
    est = autopar.estimate(graph, CLUSTER, got.config, options=got.options)
    assert est.step_time_s == autopar.estimate(graph, CLUSTER, plan.config, options=runtime).step_time_s
    if target == "torchtitan" and not any(st.layer_recompute for st in plan.stages):
        assert est.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)  # autopar's own runtime


def test_what_a_target_cannot_express_is_noted_with_the_closest_setting(plans) -> None:
    _, plan = plans["dense"]
    import dataclasses

    odd = dataclasses.replace(plan, config=dataclasses.replace(plan.config, zero_stage=1, recompute="selective",
                                                               offload="optimizer", fp8="rowwise"))
    titan = export_plan(odd, "torchtitan")
    assert "# autopar note: ZeRO-1" in titan.text and 'fsdp_reshard_after_forward = "never"' in titan.text
    assert any("selective_ac_option" in n for n in titan.notes) and "enable_cpu_offload = true" in titan.text
    megatron = export_plan(odd, "megatron")
    assert "--fp8-recipe blockwise" in megatron.text and any("rowwise" in n for n in megatron.notes)
    assert "--use-distributed-optimizer" in megatron.text and "--optimizer-cpu-offload" in megatron.text
    ds = json.loads(export_plan(odd, "deepspeed").text)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert any("fp8=rowwise" in n for n in ds["autopar"]["notes"])
    # tensorwise float8 under FSDP all-gathers the weights in float8, as autopar runs and prices it (torchao)
    fsdp8 = dataclasses.replace(plan, config=dataclasses.replace(plan.config, zero_stage=3, fp8="tensorwise"))
    doc = tomllib.loads(export_plan(fsdp8, "torchtitan").text)
    assert doc["model"]["converters"] == ["quantize.linear.float8"]
    assert doc["quantize"]["linear"]["float8"] == {"recipe_name": "tensorwise", "enable_fsdp_float8_all_gather": True,
                                                   "precompute_float8_dynamic_scale_for_fsdp": True}
    assert "enable_fsdp_float8_all_gather" not in export_plan(odd, "torchtitan").text  # rowwise: none


def test_estimate_from_megatron_arguments_on_the_cli(capsys: pytest.CaptureFixture) -> None:
    args = ("torchrun pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
            "--micro-batch-size 1 --global-batch-size 32 --seq-length 2048 --sequence-parallel "
            "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform --bf16")
    rc = main(["estimate", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2", "--from-megatron", args, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    got = json.loads(out.out)
    assert got["from"] == "megatron" and got["options"]["pipeline_runtime"] == "megatron"
    assert got["config"] | {} == {**got["config"], "tp": 2, "pp": 2, "dp": 4, "zero_stage": 1, "num_microbatches": 8,
                                  "recompute": "full", "sequence_parallel": True}


BAD_TOML = {"not toml": "tp = = 2", "no tables": "x = 1\n",
            "schedule": "[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = 'ZBVZeroBubble'\n",
            "mode": "[parallelism]\n[activation_checkpoint]\nmode = 'sometimes'\n",
            "degrees": "[parallelism]\ntensor_parallel_degree = 3\n"}


@pytest.mark.parametrize("case,match", [("not toml", "not a TOML file"), ("no tables", "not a torchtitan job config"),
                                        ("schedule", "ZBVZeroBubble"), ("mode", "sometimes"),
                                        ("degrees", "does not divide")])
def test_torchtitan_refusals(tmp_path: Path, case: str, match: str) -> None:
    (tmp_path / "job.toml").write_text(BAD_TOML[case])
    with pytest.raises(AutoparError, match=match):
        import_layout("torchtitan", str(tmp_path / "job.toml"), 16)


@pytest.mark.parametrize("args,match", [("pretrain_gpt.py --lr 3e-4", "not a Megatron-LM argument list"),
                                        ("--tensor-model-parallel-size two", "not an integer"),
                                        ("--micro-batch-size 1 --recompute-granularity partial", "partial"),
                                        ("--micro-batch-size 1 --fp8-format hybrid --fp8-recipe nvfp4", "nvfp4"),
                                        ("--micro-batch-size 3 --global-batch-size 16", "not a multiple")])
def test_megatron_refusals(args: str, match: str) -> None:
    with pytest.raises(AutoparError, match=match):
        import_layout("megatron", args, 16)


@pytest.mark.parametrize("cfg,match", [({"optimizer": {"type": "AdamW"}}, "not a DeepSpeed ds_config"),
                                       ({"train_micro_batch_size_per_gpu": "auto"}, "HF Trainer"),
                                       ({"zero_optimization": {"stage": 4}}, "not a ZeRO stage"),
                                       ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
                                        "nvme"),
                                       ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 1}, "≠")])
def test_deepspeed_refusals(tmp_path: Path, cfg: dict, match: str) -> None:
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    with pytest.raises(AutoparError, match=match):
        import_layout("deepspeed", str(tmp_path / "ds.json"), 16)


def test_export_cli_writes_the_file_and_lists_the_notes(plans, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _, plan = plans["moe"]
    plan.save(tmp_path / "plan.json")
    rc = main(["export", str(tmp_path / "plan.json"), "--to", "deepspeed", "--out", str(tmp_path / "ds.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "ep=4: set deepspeed.moe.layer.MoE(ep_size=4)" in out
    assert json.loads((tmp_path / "ds.json").read_text())["train_batch_size"] == 32
