"""A random-init model's checkpoint: built once per what decides its weights, then copied.

A ring, a calibration or a benchmark on a random-init model (`model.source=random`) saves the
model into its run folder, so that every stage loads the same weights. Building and saving
takes ~2 s, and a launcher that computes nothing else pays ~1.5 s more to import torch and
transformers for it. The same model group and seed give the same weights, so the first save
goes to the cache, `$SPLITLAB_CACHE/random/KEY/` (`splitlab.assets.cache_dir`), and later runs
copy that folder: milliseconds, with no torch import.

KEY is a digest of the model group, the seed, the installed torch and transformers versions
and the source of `splitlab.models` (the family adapters' config and init code): a change to
any of them builds a fresh checkpoint. `splitlab.assets.build_once` builds it as it builds an
asset: under a lock (a concurrent run waits for the build rather than building too), in a temp
folder beside the entries, published by one atomic rename (a crashed build leaves no entry).
`SPLITLAB_RANDOM_CACHE=0` builds into the run folder every time.

    .venv/bin/pytest tests/unit/test_random_checkpoint.py -q
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from importlib import metadata
from pathlib import Path

from splitlab.assets import build_once, cache_dir
from splitlab.config.enums import ModelSource
from splitlab.config.schema import ModelConfig
from splitlab.errors import ConfigError

CACHE_SWITCH_ENV = "SPLITLAB_RANDOM_CACHE"  # "0" builds every time
CACHE_FOLDER = "random"  # under the asset cache's root
MODELS_DIR = Path(__file__).resolve().parent  # whose source decides a model's init


def cache_root() -> Path:
    """Where the entries live: `random/` under the asset cache's root."""
    return cache_dir() / CACHE_FOLDER


def _cache_on() -> bool:
    return os.environ.get(CACHE_SWITCH_ENV, "1").strip() != "0"


def _source_digest() -> str:
    """sha256 over every .py file of `splitlab.models`, with its relative path."""
    digest = hashlib.sha256()
    for path in sorted(MODELS_DIR.rglob("*.py")):
        digest.update(path.relative_to(MODELS_DIR).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def checkpoint_key(model_cfg: ModelConfig, *, seed: int) -> str:
    """The cache entry's name: what decides the weights and the saved files, digested."""
    facts = {
        "model": dataclasses.asdict(model_cfg),
        "seed": seed,
        "torch": metadata.version("torch"),
        "transformers": metadata.version("transformers"),
        "safetensors": metadata.version("safetensors"),
        "splitlab.models": _source_digest(),
    }
    text = json.dumps(facts, sort_keys=True, default=str)
    return f"{model_cfg.name}-seed{seed}-{hashlib.sha256(text.encode()).hexdigest()[:20]}"


def build_random_checkpoint(model_cfg: ModelConfig, folder: Path, *, seed: int) -> Path:
    """Random-init weights (seeded) plus the tokenizer, saved into `folder` as safetensors."""
    import torch

    from splitlab.models.load import load_model

    torch.manual_seed(seed)
    model, tokenizer = load_model(model_cfg)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def save_random_checkpoint(model_cfg: ModelConfig, folder: Path, *, seed: int) -> Path:
    """`folder` holds the checkpoint of `model_cfg` under `seed`: copied from the cache, which
    builds it first when it has no entry for the key (or built in place with the cache off).

    Raises:
        ConfigError: `model_cfg` is not a random-init model.
    """
    if ModelSource(model_cfg.source) is not ModelSource.random:
        raise ConfigError(
            f"model.source={ModelSource(model_cfg.source).value}: only a random-init model "
            "(model.source=random) gets a saved checkpoint"
        )
    if not _cache_on():
        return build_random_checkpoint(model_cfg, folder, seed=seed)
    entries = cache_root()
    entry = entries / checkpoint_key(model_cfg, seed=seed)
    build_once(
        entry,
        lambda out, _scratch: build_random_checkpoint(model_cfg, out, seed=seed),
        done=Path.is_dir,
    )
    shutil.copytree(entry, folder, dirs_exist_ok=True)
    return folder
