"""The random-init checkpoint cache: same weights as a fresh build, a new key for whatever
decides them, nothing published by a failed build."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from splitlab.configure import compose_config
from splitlab.errors import ConfigError
from splitlab.models import random_checkpoint as rc

WEIGHTS = "model.safetensors"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setattr(rc, "cache_root", lambda: root)
    monkeypatch.delenv(rc.CACHE_SWITCH_ENV, raising=False)
    return root


def _model(*overrides: str):
    return compose_config(["task=infer", "model=tiny_llama", *overrides]).model


def test_a_copied_checkpoint_holds_the_weights_a_fresh_build_saves(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    first = rc.save_random_checkpoint(model, tmp_path / "run1" / "checkpoint", seed=3)
    (entry,) = cache.iterdir()
    assert entry.name == rc.checkpoint_key(model, seed=3)
    built = []
    monkeypatch.setattr(rc, "build_random_checkpoint", lambda *a, **k: built.append(a))
    second = rc.save_random_checkpoint(model, tmp_path / "run2" / "checkpoint", seed=3)
    assert built == []  # the second run copied the entry
    monkeypatch.undo()
    monkeypatch.setenv(rc.CACHE_SWITCH_ENV, "0")
    fresh = rc.save_random_checkpoint(model, tmp_path / "run3" / "checkpoint", seed=3)
    assert sorted(p.name for p in second.iterdir()) == sorted(p.name for p in fresh.iterdir())
    a, b, c = (load_file(str(f / WEIGHTS)) for f in (first, second, fresh))
    assert a.keys() == b.keys() == c.keys()
    assert all(a[k].equal(b[k]) and a[k].equal(c[k]) for k in a)


def test_the_key_follows_seed_model_and_init_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    key = rc.checkpoint_key(model, seed=0)
    assert rc.checkpoint_key(_model(), seed=0) == key
    assert rc.checkpoint_key(model, seed=1) != key
    assert rc.checkpoint_key(_model("model.intermediate_size=96"), seed=0) != key
    assert rc.checkpoint_key(dataclasses.replace(model, dtype="bf16"), seed=0) != key
    copy = tmp_path / "models"
    shutil.copytree(rc.MODELS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(rc, "MODELS_DIR", copy)
    assert rc.checkpoint_key(model, seed=0) == key
    adapter = copy / "families" / "llama.py"
    adapter.write_text(adapter.read_text() + "\n# an edited init\n")
    assert rc.checkpoint_key(model, seed=0) != key


def test_a_failed_build_publishes_nothing(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_build(model, folder: Path, *, seed: int) -> Path:
        (folder / WEIGHTS).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(rc, "build_random_checkpoint", half_build)
    with pytest.raises(OSError, match="disk full"):
        rc.save_random_checkpoint(_model(), tmp_path / "run" / "checkpoint", seed=0)
    assert list(cache.iterdir()) == []
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_only_a_random_model_gets_a_checkpoint(tmp_path: Path) -> None:
    model = compose_config(["model=smollm2_135m", "task=infer"]).model
    with pytest.raises(ConfigError, match="model.source=packaged"):
        rc.save_random_checkpoint(model, tmp_path / "checkpoint", seed=0)
