"""MODEL as a Hugging Face transformers config: a folder holding `config.json`, a `config.json` path, or a Hub
name (`org/name`, `org/name@revision`) found in the local Hugging Face cache. The model is built on the meta
device from its config alone (no weights are read), with the transformers class its `architectures` names,
so a user plans DeepSeek-V3 or Qwen3-235B from the file they already have instead of writing a factory.

The cache is where huggingface_hub keeps it: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`$XDG_CACHE_HOME/huggingface/hub` (`~/.cache/huggingface/hub`), laid out as
`models--org--name/snapshots/<commit>/config.json` with `refs/<revision>` naming the commit. A name not in
the cache is fetched from the Hub into it (config.json alone, by huggingface_hub) unless `HF_HUB_OFFLINE` is
set; where neither works it is refused with the cache path looked at and the command that fetches it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.errors import AutoparError

__all__ = ["hf_cache_dir", "find_config", "looks_like_hub_name", "build_from_config"]

# Hub repository ids: `name` or `org/name`, letters, digits, `-`, `_`, `.`; an optional `@revision`
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(@[\w./-]+)?$")
# (transformers Auto class, its mapping of model_type → class names), tried in order for `architectures`
_AUTO_CLASSES = (("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
                 ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
                 ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"))
DEFAULT_SEQ_LEN = 2048  # as the zoo: min(context, 2048) tokens unless --seq-len says


def hf_cache_dir() -> Path:
    """The Hugging Face Hub cache folder, resolved from the environment as huggingface_hub resolves it."""
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub:
        return Path(hub).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def looks_like_hub_name(spec: str) -> bool:
    return bool(_HUB_NAME.match(spec)) and not spec.endswith(".json")


def _offline() -> bool:
    """Whether the user asked for no network (`HF_HUB_OFFLINE`, read as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def _fetch_config(repo: str, revision: str, cache: Path, fetch: str) -> Path:
    """config.json of `repo` at `revision`, downloaded from the Hub into `cache` (that file only)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        raise AutoparError(f"Hub model {repo!r} is not in the local Hugging Face cache {cache}, and huggingface_hub "
                           f"is not installed to fetch it ({e}): {fetch}") from None
    # the Hub client retries for about half a minute when there is no network: say what the wait is
    print(f"autopar: fetching {repo}@{revision} config.json from the Hugging Face Hub into {cache} "
          "(set HF_HUB_OFFLINE=1 to use the cache alone)", file=sys.stderr, flush=True)
    try:
        return Path(hf_hub_download(repo_id=repo, filename="config.json", revision=revision, cache_dir=cache))
    except Exception as e:  # no network, an unknown or gated repository, a missing revision: all the user's to fix
        reason = (str(e).strip().splitlines() or [""])[0]
        raise AutoparError(f"Hub model {repo!r} (revision {revision!r}) is not in the local Hugging Face cache {cache} "
                           f"and fetching its config.json from the Hub failed ({type(e).__name__}: {reason}): "
                           f"{fetch}") from None


def _cached_config(spec: str) -> Path:
    """config.json of Hub name `spec` (`org/name[@revision]`): from the local cache, else fetched from the Hub
    into it; AutoparError naming the cache path and how to fill it when neither works."""
    repo, _, revision = spec.partition("@")
    revision = revision or "main"
    cache = hf_cache_dir()
    folder = cache / f"models--{repo.replace('/', '--')}"
    fetch = (f"fetch it on a machine with network access (`huggingface-cli download {repo} config.json`, with "
             f"HF_HUB_CACHE pointing at that cache) or pass the path of a folder holding its config.json (if "
             f"{spec!r} was meant as one: {Path(spec).expanduser().resolve()} does not exist)")
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    config = folder / "snapshots" / commit / "config.json"
    if config.is_file():
        return config
    if not _offline():
        return _fetch_config(repo, revision, cache, fetch)
    if not folder.is_dir():
        raise AutoparError(f"unknown model {spec!r}: not a zoo name, a path or a .py factory, and Hub model "
                           f"{repo!r} is not in the local Hugging Face cache {cache} (looked for {folder.name}; "
                           f"HF_HUB_OFFLINE is set, so autopar does not download): {fetch}")
    have = sorted(p.name for p in (folder / "refs").glob("*")) if (folder / "refs").is_dir() else []
    raise AutoparError(f"Hub model {repo!r} is in the cache {cache} but has no config.json for revision "
                       f"{revision!r} (looked for {config}; cached refs: {have or 'none'}; HF_HUB_OFFLINE is set, so "
                       f"autopar does not download): {fetch}")


def find_config(spec: str) -> Path | None:
    """The config.json MODEL `spec` names (a folder holding one, the file itself, or a cached Hub name), None
    when `spec` is none of these shapes; AutoparError when it has the shape but the file is missing."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise AutoparError(f"MODEL folder {spec!r} holds no config.json; pass a Hugging Face model folder (with "
                               "config.json), a config.json path, a zoo name or path/file.py:factory")
        return path / "config.json"
    if path.suffix == ".json":
        if not path.is_file():
            raise AutoparError(f"MODEL config {spec!r} does not exist (cwd: {Path.cwd()}); pass the path of a "
                               "transformers config.json")
        return path
    if looks_like_hub_name(spec):
        return _cached_config(spec)
    return None


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AutoparError(f"{path}: not a readable JSON config ({e}); pass a transformers config.json") from None
    if not isinstance(data, dict) or "model_type" not in data and "architectures" not in data:
        raise AutoparError(f"{path} is not a transformers config: it has no model_type or architectures "
                           "(a config.json as saved by PretrainedConfig.save_pretrained)")
    return data


def _auto_class(config: Any, trust_remote_code: bool, where: Path) -> Any:
    """The transformers Auto class that builds the first of the config's `architectures` (a causal LM, a
    sequence-to-sequence LM or a masked LM), from transformers' own mappings or the config's `auto_map`."""
    import transformers
    from transformers.models.auto import modeling_auto

    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", "")
    auto_map = getattr(config, "auto_map", None) or {}
    for arch in archs:
        for auto_name, mapping_name in _AUTO_CLASSES:
            if trust_remote_code and str(auto_map.get(auto_name, "")).endswith(f".{arch}"):
                return getattr(transformers, auto_name)
            names = getattr(modeling_auto, mapping_name, {}).get(model_type, ())
            if arch in ((names,) if isinstance(names, str) else tuple(names)):
                return getattr(transformers, auto_name)
    if not archs:  # a config without architectures: the causal LM of its model type, when there is one
        for auto_name, mapping_name in _AUTO_CLASSES:
            if model_type in getattr(modeling_auto, mapping_name, {}):
                return getattr(transformers, auto_name)
    remote = [a for a in auto_map if a.startswith("AutoModel")]
    hint = (" (its auto_map names remote code: pass --trust-remote-code, or trust_remote_code=True, if you trust it)"
            if remote and not trust_remote_code else "")
    raise AutoparError(f"{where}: architectures {archs or 'none'} (model_type {model_type!r}) is not a causal, "
                       f"sequence-to-sequence or masked language model transformers {transformers.__version__} "
                       f"can build{hint}; autopar plans text models from their config (a multimodal model: point at "
                       "its text model's config)")


def build_from_config(spec: str, path: Path, seq_len: int | None, *, dtype: torch.dtype | None = None,
                      overrides: dict[str, Any] | None = None, trust_remote_code: bool = False
                      ) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """`(model, (input_ids [1, seq_len],), kwargs)` of the config at `path`, built on meta in `dtype` (default
    bfloat16, as zoo models). overrides: config fields to replace (`--override num_hidden_layers=4`)."""
    try:
        import transformers
        from transformers import AutoConfig
    except ImportError as e:
        raise AutoparError(f"MODEL {spec!r} is a transformers config, and transformers is not installed ({e}); "
                           "pip install transformers") from None
    raw = _read(path)
    unknown = sorted(set(overrides or {}) - set(raw))
    try:
        config = AutoConfig.from_pretrained(str(path.parent) if path.name == "config.json" else str(path),
                                            trust_remote_code=trust_remote_code, local_files_only=True)
    except ValueError as e:
        if not trust_remote_code and (raw.get("auto_map") or "trust_remote_code" in str(e)):
            raise AutoparError(f"{path}: model_type {raw.get('model_type')!r} is not built into transformers "
                               f"{transformers.__version__}; its config names remote code: pass --trust-remote-code "
                               "(trust_remote_code=True) if you trust it") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AutoparError(f"{path}: transformers {transformers.__version__} cannot read this config ({first}); "
                           "upgrade transformers for a newer model type, or fix the config") from None
    except (OSError, KeyError, TypeError) as e:
        raise AutoparError(f"{path}: transformers cannot read this config: {type(e).__name__}: {e}") from None
    unknown = [k for k in unknown if not hasattr(config, k)]
    if unknown:
        raise AutoparError(f"--override {', '.join(unknown)}: not field(s) of {path}'s {type(config).__name__}; "
                           "override fields the config has, e.g. num_hidden_layers=4")
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq_len = seq_len or min(context or DEFAULT_SEQ_LEN, DEFAULT_SEQ_LEN)
    if context and seq_len > context:
        raise AutoparError(f"--seq-len {seq_len} is longer than {spec}'s max_position_embeddings={context}; pass "
                           f"--seq-len ≤ {context}, or --override max_position_embeddings={seq_len} to plan the "
                           "longer context on purpose")
    auto = _auto_class(config, trust_remote_code, path)
    dtype = dtype or torch.bfloat16
    key = "dtype" if tuple(int(p) for p in re.findall(r"\d+", transformers.__version__)[:2]) >= (4, 56) \
        else "torch_dtype"
    try:
        with torch.device("meta"):
            model = auto.from_config(config, trust_remote_code=trust_remote_code, **{key: dtype})
    except Exception as e:  # a config transformers accepts but cannot build: the user's input, said plainly
        raise AutoparError(f"{path}: building {auto.__name__} from this config on the meta device failed: "
                           f"{type(e).__name__}: {str(e)[:300]}") from None
    model.zoo_name = spec  # type: ignore[attr-defined]  # names the graph (and plans) by MODEL as given
    input_ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    kwargs: dict[str, Any] = {}
    if getattr(config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = input_ids
    return model, (input_ids,), kwargs
