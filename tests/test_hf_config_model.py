"""MODEL as a transformers config: a folder with config.json, a config.json path, or a Hub name in the local
Hugging Face cache, built on meta from the config alone (autopar.hf_models). No network, no weights, no factory.

Capturing a real-size MoE model on meta costs about a second per layer on the dev VM (DeepSeek-V3's 61 layers:
~70 s under load), so the real size is planned once (DeepSeek-V3 on 32 DGX H100 nodes) and the other cases
override num_hidden_layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import autopar
from autopar.cli.main import main
from autopar.errors import AutoparError
from autopar.models import resolve_model

pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "fixtures" / "hf_configs"


def _qwen3_moe_params(layers: int) -> int:
    """Qwen3-235B-A22B's parameter count from its published dimensions (an independent reference)."""
    h, heads, kv, d, experts, ffn, vocab = 4096, 64, 4, 128, 128, 1536, 151936
    attention = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d  # q, k, v, o and the q/k norms
    moe = experts * 3 * h * ffn + h * experts  # gate/up/down per expert, the router
    return 2 * vocab * h + h + layers * (attention + moe + 2 * h)  # untied embedding and head, final norm


def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repo: str, config: dict) -> Path:
    """A Hugging Face Hub cache in tmp_path holding `repo`'s config.json at a snapshot refs/main names."""
    cache = tmp_path / "hub"
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def _config(name: str, **changes) -> dict:
    return {**json.loads((FIXTURES / name / "config.json").read_text()), **changes}


def test_deepseek_v3_at_real_size_plans_on_32_nodes_from_its_config_folder(capsys: pytest.CaptureFixture) -> None:
    folder = str(FIXTURES / "deepseek-v3")
    model, inputs, kwargs = resolve_model(folder, 4096)
    graph = autopar.capture(model, inputs, kwargs)
    # DeepSeek-V3's published size: 671B parameters (the MTP module not included: transformers does not build it)
    assert graph.num_params == sum(p.numel() for p in model.parameters()) == 671_026_404_352
    moe = [la.moe for la in graph.layers if la.moe is not None]
    assert len(moe) == 58 and moe[0].num_experts == 256 and moe[0].top_k == 8  # first_k_dense_replace = 3
    assert graph.model_name == folder and graph.seq_len == 4096
    cluster = autopar.Cluster.preset("dgx-h100", nodes=32)
    plan = autopar.plan(graph, cluster, global_batch_size=1024)
    assert plan.world_size == 256 and plan.estimate.fits and plan.config.ep > 1


def test_qwen3_moe_plans_from_a_hub_name_in_a_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    _cache(tmp_path, monkeypatch, "Qwen/Qwen3-235B-A22B", _config("qwen3-235b-a22b"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, inputs, _ = resolve_model("Qwen/Qwen3-235B-A22B", 4096, overrides={"num_hidden_layers": 2})
    assert sum(p.numel() for p in model.parameters()) == _qwen3_moe_params(2)
    assert tuple(inputs[0].shape) == (1, 4096) and next(model.parameters()).dtype.is_floating_point
    out = tmp_path / "plan.json"
    rc = main(["plan", "Qwen/Qwen3-235B-A22B", "--override", "num_hidden_layers=2", "--cluster", "dgx-h100",
               "--nodes", "32", "--global-batch-size", "512", "--seq-len", "4096", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = autopar.Plan.load(out)
    assert plan.model_name == "Qwen/Qwen3-235B-A22B" and plan.world_size == 256 and plan.seq_len == 4096


def test_a_hub_name_not_in_the_cache_names_the_cache_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    cache = _cache(tmp_path, monkeypatch, "Qwen/Qwen3-235B-A22B", _config("qwen3-235b-a22b"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = main(["capture", "deepseek-ai/DeepSeek-V3"])
    err = capsys.readouterr().err
    assert rc == 1 and str(cache) in err and "models--deepseek-ai--DeepSeek-V3" in err and "HF_HUB_OFFLINE" in err
    assert "huggingface-cli download deepseek-ai/DeepSeek-V3 config.json" in err
    with pytest.raises(AutoparError, match="zoo names: .*llama3-8b"):  # a one-word name: perhaps a misspelled zoo name
        resolve_model("llama3-8x")


def test_python_plan_takes_a_config_json_path_and_explain_rebuilds_it(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "dsv3-4" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_config("deepseek-v3", num_hidden_layers=4)))
    plan = autopar.plan(str(path), autopar.Cluster.preset("dgx-h100", nodes=2), global_batch_size=64)
    assert plan.model_name == str(path) and plan.world_size == 16 and plan.seq_len == 2048  # min(context, 2048)
    with pytest.raises(AutoparError, match="brings its own example inputs"):
        autopar.plan(str(path), autopar.Cluster.preset("dgx-h100"), global_batch_size=8, example_inputs=(1,))
    plan.save(tmp_path / "plan.json")  # explain rebuilds the model from the plan's model name, the config path
    rc = main(["explain", str(tmp_path / "plan.json"), "--config", "tp=1,pp=1,zero=3,ep=1", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out)["chosen"]["config"] == plan.config.to_dict()


def test_sliding_window_config_captures_at_a_sequence_past_its_window(capsys: pytest.CaptureFixture) -> None:
    rc = main(["capture", str(FIXTURES / "mistral-7b-v0.1"), "--override", "num_hidden_layers=2", "--seq-len", "8192",
               "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    graph = json.loads(out.out)
    assert graph["seq_len"] == 8192 and sum(la["kind"] == "block" for la in graph["layers"]) == 2
    assert graph["num_kv_heads"] == 8 and graph["vocab_size"] == 32000


@pytest.mark.parametrize("config,flags,match", [
    ({"model_type": "my_lab_lm", "architectures": ["MyLabForCausalLM"],
      "auto_map": {"AutoModelForCausalLM": "modeling_my_lab.MyLabForCausalLM"}}, [], "--trust-remote-code"),
    ({"hello": 1}, [], "not a transformers config"),
    (_config("mistral-7b-v0.1"), ["--override", "n_layers=2"], "not field"),
    (_config("mistral-7b-v0.1"), ["--seq-len", "65536"], "max_position_embeddings=32768"),
])
def test_config_refusals(tmp_path: Path, capsys: pytest.CaptureFixture, config: dict, flags: list[str],
                         match: str) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    rc = main(["capture", str(folder), *flags])
    err = capsys.readouterr().err
    assert rc == 1 and match in err and "Traceback" not in err, err


def test_a_folder_without_config_json_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    shutil.copytree(FIXTURES / "mistral-7b-v0.1", tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    assert main(["capture", str(tmp_path / "m")]) == 1
    assert "holds no config.json" in capsys.readouterr().err


def _fake_hub(monkeypatch: pytest.MonkeyPatch, config: dict | None, error: Exception | None = None) -> list:
    """huggingface_hub.hf_hub_download replaced by one that files `config` in the cache as the Hub client does
    (or raises `error`); returns the calls it got."""
    import huggingface_hub

    calls = []

    def download(*, repo_id: str, filename: str, revision: str, cache_dir: Path) -> str:
        calls.append((repo_id, filename, revision, Path(cache_dir)))
        if error is not None:
            raise error
        folder = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
        (folder / "snapshots" / "feedbeef").mkdir(parents=True)
        (folder / "snapshots" / "feedbeef" / filename).write_text(json.dumps(config))
        (folder / "refs").mkdir()
        (folder / "refs" / revision).write_text("feedbeef")
        return str(folder / "snapshots" / "feedbeef" / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return calls


def test_a_hub_name_not_in_the_cache_is_fetched_into_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    calls = _fake_hub(monkeypatch, _config("qwen3-235b-a22b"))
    for _ in range(2):  # the second time from the cache the first filled
        model, _, _ = resolve_model("Qwen/Qwen3-235B-A22B", 4096, overrides={"num_hidden_layers": 2})
        assert sum(p.numel() for p in model.parameters()) == _qwen3_moe_params(2)
    assert calls == [("Qwen/Qwen3-235B-A22B", "config.json", "main", tmp_path / "hub")]


def test_a_failed_fetch_names_the_cache_the_reason_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _fake_hub(monkeypatch, None, ConnectionError("Max retries exceeded with url: /api/models (no route to host)"))
    rc = main(["capture", "deepseek-ai/DeepSeek-V3@v1"])
    err = capsys.readouterr().err
    assert rc == 1 and str(tmp_path / "hub") in err and "revision 'v1'" in err
    assert "ConnectionError: Max retries exceeded" in err and "huggingface-cli download deepseek-ai/DeepSeek-V3" in err
    assert "Traceback" not in err
