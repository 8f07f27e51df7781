"""Which linears FP8 converts (the filter the planner prices too), and the conversion itself, on one process."""

from __future__ import annotations

import pytest
import torch
from parity_models import build_model, graph_of

from autopar.codegen.float8 import convert_float8, float8_linear_names, is_float8_linear
from autopar.errors import PlanMismatchError


def test_every_linear_but_the_head_and_widths_the_kernels_refuse():
    gpt = build_model("gpt")
    names = float8_linear_names(gpt, graph_of("gpt", gpt), tp=1)
    assert len(names) == 12 and "lm_head" not in names  # q, k, v, o, fc, proj in 2 blocks
    llama = build_model("hf_llama")  # MLP width 168 = 16·10 + 8: no _scaled_mm shape
    names = float8_linear_names(llama, graph_of("hf_llama", llama), tp=1)
    assert sorted({n.rsplit(".", 1)[1] for n in names}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    # per-rank shares count: k/v project 64 → 32 features, 8 per rank at tp=4 (not a multiple of 16)
    names4 = float8_linear_names(llama, graph_of("hf_llama", llama), tp=4)
    assert sorted({n.rsplit(".", 1)[1] for n in names4}) == ["o_proj", "q_proj"]


def test_conversion_is_torchao_float8_and_trains():
    model = build_model("gpt")
    names = float8_linear_names(model, graph_of("gpt", model), tp=1)
    assert convert_float8(model, names, "rowwise", device=torch.device("cpu")) == 12
    assert {n for n, m in model.named_modules() if is_float8_linear(m)} == set(names)
    x = torch.randint(0, 128, (2, 16))
    model(x).float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_no_qualifying_linear_is_refused():
    model = build_model("gpt")
    with pytest.raises(PlanMismatchError, match="no linear"):
        convert_float8(model, (), "tensorwise", device=torch.device("cpu"))
