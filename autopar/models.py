"""Resolve the MODEL argument of the CLI into `(model, example_inputs)`.

MODEL is one of
- a built-in zoo name (`gpt2-small`, `llama3-70b`, ...), built on the meta device;
- `path/to/file.py:factory`, a file loaded as a module;
- `package.module:factory`, an importable module;
- a Hugging Face transformers config: a folder holding config.json, a config.json path, or a Hub name
  (`org/name`) in the local Hugging Face cache, built on meta from the config alone (autopar.hf_models).
A factory is called with no argument, or with `seq_len=` when one is given and the factory accepts
it, and returns `(model, example_inputs)` with example_inputs a tuple (a single tensor is accepted),
or `(model, example_inputs, example_kwargs)` for a forward that takes keyword inputs (an encoder–decoder's
`decoder_input_ids`, an attention mask).

A zoo model is built in a *training dtype*, because the dtype changes the captured graph (bytes,
kernels) and so its fingerprint, which a plan must match at run time: bfloat16 where it will train on
GPUs (mixed precision, what the planner assumes for GPU clusters), float32 where it will train on this
machine's CPU (autopar's CPU runtime and examples/train_gpt.py train in float32). `training_dtype`
is that rule, shared by the CLI and the training script; `--dtype` overrides it on both sides.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from autopar import zoo
from autopar.errors import AutoparError

__all__ = ["resolve_model", "training_dtype", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def training_dtype(where: str = "local", name: str | None = None) -> torch.dtype:
    """The dtype a zoo model trains in: `name` (a DTYPES key) when given, else float32 when `where` is
    "local" on a machine without CUDA (CPU training), else bfloat16 (GPU mixed precision)."""
    if name is not None:
        if name not in DTYPES:
            raise AutoparError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[name]
    import torch.cuda

    return torch.float32 if where == "local" and not torch.cuda.is_available() else torch.bfloat16


def _load_module(target: str) -> ModuleType:
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise AutoparError(f"MODEL file {target!r} does not exist (cwd: {Path.cwd()}); "
                               "give a path to a .py file, e.g. examples/my_model.py:build")
        name = f"autopar_user_model_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise AutoparError(f"cannot load {target!r} as a Python module; is it a .py file?")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise AutoparError(f"importing {target!r} failed: {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise AutoparError(f"cannot import module {target!r} ({e}); MODEL must be a zoo name "
                           f"({', '.join(zoo.names())}), path/file.py:factory or package.module:factory") from e


def resolve_model(spec: str, seq_len: int | None = None, *, dtype: torch.dtype | None = None,
                  overrides: dict[str, Any] | None = None, seq_len_optional: bool = False,
                  trust_remote_code: bool = False) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """`(model, example_inputs, example_kwargs)` for a MODEL string (`autopar.capture(*resolve_model(...))`);
    see the module docstring for the accepted forms.

    dtype: the dtype of a zoo model (default: the zoo's bfloat16); a factory decides its own dtype.
    overrides: zoo config fields to replace (`--override dropout=0`), as examples/train_gpt.py takes them,
    or a transformers config's fields (`--override num_hidden_layers=4`).
    trust_remote_code: let a transformers config run the modelling code its auto_map names (off by default).
    """
    if seq_len is not None and seq_len <= 0:
        raise AutoparError(f"seq_len={seq_len}; it must be a positive number of tokens")
    if ":" not in spec:
        if spec in zoo.names():
            return (*zoo.build(spec, seq_len=seq_len, dtype=dtype, **(overrides or {})), {})
        from autopar.hf_models import build_from_config, find_config

        try:
            config = find_config(spec)
        except AutoparError as e:  # a one-word name: perhaps a misspelled zoo name
            raise AutoparError(f"{e}; zoo names: {', '.join(zoo.names())}" if "/" not in spec else str(e)) from None
        if config is not None:
            return build_from_config(spec, config, seq_len, dtype=dtype, overrides=overrides,
                                     trust_remote_code=trust_remote_code)
        raise AutoparError(f"unknown model {spec!r}: not a zoo name ({', '.join(zoo.names())}), not a transformers "
                           "config (a folder with config.json, a .json file or a Hub name org/name) and not of the "
                           "form path/file.py:factory or package.module:factory")
    if overrides:
        raise AutoparError(f"--override {' '.join(f'{k}={v}' for k, v in overrides.items())}: overrides replace "
                           f"fields of a zoo model's config; MODEL {spec!r} is a factory, so set them in it")
    target, _, factory_name = spec.rpartition(":")
    if not target or not factory_name.isidentifier():
        raise AutoparError(f"MODEL {spec!r}: expected path/file.py:factory or package.module:factory with "
                           "a function name after the colon")
    module = _load_module(target)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise AutoparError(f"{target!r} has no callable {factory_name!r}; its functions are {found}")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or extension callable: what it takes is unknown
        params = None
    takes_any = params is None or any(p.kind == p.VAR_KEYWORD for p in params.values())
    params = params or {}
    if seq_len is not None and "seq_len" not in params and not takes_any and not seq_len_optional:
        raise AutoparError(f"MODEL factory {spec} takes no seq_len, so --seq-len {seq_len} would be ignored; drop it "
                           "(the factory's example inputs set the sequence length) or add a seq_len parameter")
    passed = {"seq_len"} if seq_len is not None and "seq_len" in params else set()
    needed = [n for n, p in params.items() if p.default is p.empty and n not in passed
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if needed == ["seq_len"]:
        raise AutoparError(f"MODEL factory {spec} needs seq_len; pass --seq-len (or give it a default)")
    if needed:
        raise AutoparError(f"MODEL factory {spec} needs argument(s) {needed}; autopar calls it with no argument "
                           "(or seq_len= when it accepts one): give them defaults, or wrap it in a function that does")
    try:
        result = factory(seq_len=seq_len) if passed else factory()
    except Exception as e:
        raise AutoparError(f"MODEL factory {spec} raised {type(e).__name__}: {e}") from e
    if not (isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], nn.Module)):
        raise AutoparError(f"{spec}: the factory returned {type(result).__name__}; it must return "
                           "(model, example_inputs), e.g. `return model, (input_ids,)`, or (model, example_inputs, "
                           "example_kwargs), e.g. `return model, (), {'input_ids': ids, 'decoder_input_ids': dec}`")
    model, inputs, kwargs = result if len(result) == 3 else (*result, {})
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise AutoparError(f"{spec}: example_inputs is a {type(inputs).__name__}; return a tuple of tensors")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise AutoparError(f"{spec}: example_kwargs is a {type(kwargs).__name__}; return a dict of the keyword "
                           "inputs of model.forward")
    return model, tuple(inputs), kwargs
