"""Load the model (and tokenizer) a `ModelConfig` names: random init, hub/local folder, or asset.

- `source=random`: a fresh model from the config's dimensions; deterministic under
  `torch.manual_seed`.
- `source=hub`: `from_pretrained` on a local folder or a hub id (transformers honours
  `HF_HUB_OFFLINE`); a missing model is an `AssetError` saying where it looked.
- `source=packaged`: the folder `splitlab.assets.fetch(cfg.id)` builds once.
- `model.path` set: that local folder, whatever the source (`splitlab.models.folder`).
- `model.untie_embeddings`: a head tied to the input embedding gets its own copy of the weights
  (`untie_head`), so two-stage can put the embedding and the head on different processes.

The loaded model is an unmodified transformers model; its block count and width are checked
against the config, because partition plans and wire buffers are sized from the config.
transformers' load report (a WARNING table: a fresh classifier is "MISSING") is silenced; one
INFO line says what was loaded from where, in how long, and which modules are newly initialised
(on a terminal transformers' own tqdm bar shows the load's progress; elsewhere it is off).

    .venv/bin/pytest tests/unit/test_models_load.py
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from splitlab.config.enums import DType, ModelSource, TaskKind
from splitlab.config.schema import ModelConfig
from splitlab.errors import AssetError, ConfigError
from splitlab.models.families import FamilyAdapter, get_family
from splitlab.telemetry.log import quiet_transformers

log = logging.getLogger(__name__)
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
    if cfg.untie_embeddings:
        untie_head(model)
    _check_dims(adapter, cfg, model.config)
    model.eval()
    tokenizer = _load_tokenizer(cfg, folder, model.config) if load_tokenizer else None
    return model, tokenizer


def untie_head(model: PreTrainedModel) -> bool:
    """Give a head that is the input embedding tensor its own copy of it, and mark the config
    untied so that no later `tie_weights` (or a saved folder's reload) ties them again.

    Returns:
        Whether there was a tie to undo.
    """
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embedding.weight:
        return False
    weight = embedding.weight
    head.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    model.config.tie_word_embeddings = False
    return True


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
    path = path if path is not None else (Path(cfg.path) if cfg.path else None)
    if path is not None:
        if not Path(path).is_dir():
            raise ConfigError(f"model path={str(path)!r}: not a folder")
        return str(path)
    if not cfg.id:
        raise ConfigError(f"model.id=None: model.source={source.value} needs an id")
    if source is ModelSource.packaged:
        from splitlab import assets  # the asset cache pulls in pip only when used

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
    began = time.monotonic()
    try:
        with quiet_transformers():
            model, info = adapter.model_class(config).from_pretrained(
                where, output_loading_info=True, **kwargs
            )
    except OSError as exc:
        raise AssetError(f"model.id={cfg.id!r}: cannot load weights from {where!r}: {exc}") from exc
    log.info("%s", load_line(cfg.name, where, info, elapsed_s=time.monotonic() - began))
    return model


def _modules(keys: Iterable[str]) -> str:
    """Parameter names folded to their modules (`classifier.weight` -> `classifier`)."""
    return ", ".join(sorted({key.rsplit(".", 1)[0] for key in keys}))


def load_line(name: str, where: str, info: Mapping[str, Any], *, elapsed_s: float) -> str:
    """One line for a `from_pretrained` load: what from where in how long, what is newly
    initialised, what in the folder went unused."""
    line = f"loaded {name} weights from {where} in {elapsed_s:.1f} s"
    new, unused = info.get("missing_keys") or (), info.get("unexpected_keys") or ()
    line += f"; newly initialised: {_modules(new)}" if new else "; nothing newly initialised"
    if unused:
        line += f"; unused in the folder: {_modules(unused)}"
    return line


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
        from splitlab import assets

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
