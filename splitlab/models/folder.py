"""A local transformers model folder under any preset: its architecture facts from config.json.

`model.path=/folder` (or `model.id=/folder`) names a folder saved by `save_pretrained`. Whatever
the preset says, the folder decides the family (by its `model_type`), the block count, the
width and whether the head is tied to the embedding; `resolve_local_model` writes those facts
into the model config before any check runs, so cuts and even splits follow the folder and
the resolved config.yaml records them. Only config.json is read, never the weights.

    splitlab model.path=/path/to/folder architecture.cut_layers=3
    .venv/bin/pytest tests/integration/test_preflight.py -q
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from splitlab.config.enums import ModelSource, TaskKind
from splitlab.config.schema import ModelConfig
from splitlab.errors import ConfigError
from splitlab.models.families import family_for_model_type

if TYPE_CHECKING:  # transformers only once a folder is read: the config path stays light
    from transformers import PreTrainedConfig

    from splitlab.models.families import FamilyAdapter

# What `from_pretrained` loads weights from; a folder with none of them is not a model.
WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model.bin.index.json",
)  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")
_PATH_PREFIXES = ("/", "./", "../", "~")


def local_folder(model: ModelConfig) -> tuple[str, Path] | None:
    """(config key, folder) when the model config names a local folder, else None.

    `model.path` always names a folder; `model.id` does when it is an existing folder or is
    spelled as a path (a hub id is `owner/name`, never `/...`, `./...` or `~...`).

    Raises:
        ConfigError: `model.path`, or an `id` spelled as a path, is not a folder.
    """
    if model.path:
        key, ref = "model.path", model.path
    elif model.id:
        key, ref = "model.id", model.id
        if not ref.startswith(_PATH_PREFIXES) and not Path(ref).is_dir():
            return None  # an asset name or a hub id
    else:
        return None
    folder = Path(ref).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{key}={ref!r}: no such folder")
    return key, folder.resolve()


def read_folder_config(key: str, folder: Path) -> tuple[FamilyAdapter, PreTrainedConfig]:
    """The folder's transformers config and the registered family of its `model_type`.

    Raises:
        ConfigError: no config.json, one transformers cannot read, a model type no registered
            family handles, or no weights file.
    """
    where = f"{key}={str(folder)!r}"
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{where}: not a model folder (no config.json)")
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{where}: config.json is not a transformers config: {reason}") from exc
    adapter = family_for_model_type(config.model_type, where=where)
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"{where}: no weights in the folder (looked for {list(WEIGHT_FILES)})")
    return adapter, config


def has_tokenizer(folder: Path) -> bool:
    """Whether `save_pretrained` left a tokenizer in the folder."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def tied_head(adapter: FamilyAdapter, config: PreTrainedConfig) -> bool:
    """Whether a model built from `config` shares one tensor between embedding and head."""
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return adapter.task is TaskKind.causal_lm and tied


def resolve_local_model(model: ModelConfig) -> ModelConfig:
    """`model` with the facts of the local folder it names (unchanged if it names none).

    The folder becomes `source=hub`, `id` = `path` = its absolute path; family, num_layers,
    hidden_size, vocab_size and tie_word_embeddings come from its config.json; a folder with a
    tokenizer of its own uses it instead of the preset's.

    Raises:
        ConfigError: see `local_folder` and `read_folder_config`.
    """
    found = local_folder(model)
    if found is None:
        return model
    key, folder = found
    adapter, config = read_folder_config(key, folder)
    own_tokenizer = has_tokenizer(folder)
    return dataclasses.replace(
        model,
        family=adapter.name,
        source=ModelSource.hub,
        id=str(folder),
        path=str(folder),
        tokenizer=None if own_tokenizer else model.tokenizer,
        num_layers=adapter.num_layers(config),
        hidden_size=adapter.hidden_size(config),
        vocab_size=int(config.vocab_size),
        tie_word_embeddings=tied_head(adapter, config),
    )
