"""`autopar.capture` once per model and example inputs in a test session, shared by every process.

Every rank of a parity job captures its model itself, and so did every job that trains the same family:
capturing a small MoE model costs seconds, DeepSeek-V3's about ten under CI load, times eight ranks in the
eight-rank job. Under pytest (tests/conftest.py names a session folder in `AUTOPAR_TEST_CAPTURE_CACHE`) the
first process to capture a model writes the graph there, holding a lock on its file, and the others wait
for it and read it: the same ModelGraph (capture is deterministic: meta tensors, the model's code and
config, the example inputs' shapes and values), so plans and parallelize see what they would have seen.
Without the variable (a suite run by hand) it is plain `autopar.capture`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autopar
from autopar.capture.graph import ModelGraph

ENV = "AUTOPAR_TEST_CAPTURE_CACHE"


def _digest(h: Any, value: Any) -> None:
    """Feed `value` (tensors, nested tuples, lists and dicts of them, plain values) into hash `h`."""
    if isinstance(value, torch.Tensor):
        h.update(f"T{value.dtype}{tuple(value.shape)}{value.device.type == 'meta'}".encode())
        if value.device.type != "meta" and value.numel():  # a meta tensor has no values
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, (tuple, list)):
        h.update(f"{type(value).__name__}{len(value)}(".encode())
        for v in value:
            _digest(h, v)
        h.update(b")")
    elif isinstance(value, dict):
        h.update(f"dict{len(value)}(".encode())
        for k in sorted(value, key=str):
            h.update(repr(k).encode())
            _digest(h, value[k])
        h.update(b")")
    else:
        h.update(repr(value).encode())


def model_key(model: nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None,
              options: dict[str, Any]) -> str:
    """What a capture depends on: the model's class, structure, config and weights, the inputs and options."""
    h = hashlib.sha256()
    h.update(f"{type(model).__module__}.{type(model).__qualname__}\n{model!r}\n".encode())
    config = getattr(model, "config", None)
    if config is not None:  # transformers: the whole config, private attention choice included
        h.update(f"{config}\n{getattr(config, '_attn_implementation', None)}\n".encode())
    _digest(h, dict(model.state_dict()))
    _digest(h, (example_inputs, example_kwargs or {}, options))
    return h.hexdigest()


def capture(model: nn.Module, example_inputs: Any = (), example_kwargs: dict[str, Any] | None = None,
            **options: Any) -> ModelGraph:
    """`autopar.capture(model, example_inputs, example_kwargs, **options)`, read from the session's cache
    when a process captured the same model and inputs before."""
    folder = os.environ.get(ENV)
    if not folder:
        return autopar.capture(model, example_inputs, example_kwargs, **options)
    path = Path(folder) / f"{model_key(model, example_inputs, example_kwargs, options)}.pickle"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process captures; the others wait here, idle, and read
        try:
            if path.exists():
                with open(path, "rb") as f:
                    return pickle.load(f)
            graph = autopar.capture(model, example_inputs, example_kwargs, **options)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                pickle.dump(graph, f)
            os.replace(tmp, path)
            return graph
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
