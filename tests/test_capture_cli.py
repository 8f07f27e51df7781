"""`autopar capture MODEL` and `autopar.models.resolve_model`."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from autopar import AutoparError, ModelGraph
from autopar.cli.main import main
from autopar.models import resolve_model

FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 16)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
            self.head = nn.Linear(16, 100)

        def forward(self, ids):
            x = self.embed(ids)
            for b in self.blocks:
                x = torch.relu(b(x))
            return self.head(x)

    def build(seq_len=8):
        return Tiny(), (torch.zeros(2, seq_len, dtype=torch.long),)

    def not_a_pair():
        return 42
""")


@pytest.fixture()
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_model.py"
    path.write_text(FACTORY)
    return path


def test_resolve_zoo_name_builds_on_meta() -> None:
    model, (ids,), kwargs = resolve_model("gpt-tiny", seq_len=32)
    assert kwargs == {}
    assert ids.shape == (1, 32) and next(model.parameters()).device.type == "meta"


def test_resolve_file_factory_passes_seq_len(factory_file: Path) -> None:
    model, (ids,), _ = resolve_model(f"{factory_file}:build", seq_len=12)
    assert type(model).__name__ == "Tiny" and ids.shape == (2, 12)


def test_resolve_module_factory(factory_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(factory_file.parent))
    model, inputs, _ = resolve_model("tiny_model:build")
    assert type(model).__name__ == "Tiny" and isinstance(inputs, tuple)


@pytest.mark.parametrize("spec,message", [
    ("no-such-model", "unknown model"),
    ("missing/file.py:build", "does not exist"),
    ("no_such_module_xyz:build", "cannot import"),
])
def test_resolve_errors(spec: str, message: str) -> None:
    with pytest.raises(AutoparError, match=message):
        resolve_model(spec)


def test_resolve_factory_errors(factory_file: Path) -> None:
    with pytest.raises(AutoparError, match="no callable 'nope'.*build"):
        resolve_model(f"{factory_file}:nope")
    with pytest.raises(AutoparError, match=r"must return \(model, example_inputs\)"):
        resolve_model(f"{factory_file}:not_a_pair")
    with pytest.raises(AutoparError, match="positive"):
        resolve_model("gpt-tiny", seq_len=0)


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", "llama-tiny", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "tok_embeddings" in out and "layers.0 … layers.3" in out and "attn(h=4,kv=2) mlp" in out
    assert "total: 988,288 parameters" in out and "fingerprint" in out
    assert main(["capture", "llama-tiny", "--all-layers"]) == 0
    assert "layers.3 " in capsys.readouterr().out


def test_cli_json_round_trips(capsys: pytest.CaptureFixture[str], factory_file: Path) -> None:
    assert main(["capture", f"{factory_file}:build", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fingerprint = data.pop("fingerprint")
    g = ModelGraph.from_dict(data)
    assert g.fingerprint == fingerprint and g.model_name == "Tiny"
    assert [la.name for la in g.layers] == ["embed", "blocks.0", "blocks.1", "head"]
    assert g.num_params == 100 * 16 + 2 * (16 * 16 + 16) + 16 * 100 + 100
    assert g.layer("blocks.0").forward_flops == 2 * 8 * 16 * 16  # per sample: seq 8, one 16x16 matmul


def test_cli_user_error_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", "no-such-model"]) == 1
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_capture_is_exported() -> None:
    import autopar

    assert "capture" in autopar.__all__ and callable(autopar.capture)
    assert isinstance(autopar.capture(*resolve_model("gpt-tiny", seq_len=16)), ModelGraph)
    assert torch.is_grad_enabled()
