"""Checkpoints: original keys, round and RNG metadata, atomic writes, resume from the latest."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from splitlab.errors import AssetError
from splitlab.train import checkpoint
from splitlab.train.checkpoint import (
    capture_rng,
    checkpoint_path,
    completed_rounds,
    latest_checkpoint,
    load_checkpoint,
    next_round,
    restore_rng,
    save_checkpoint,
)


def _state() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2),
        "model.layers.0.mlp.up_proj.weight": torch.ones(2, 2),
    }


def test_round_trip_keeps_keys_values_and_round(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, round_id=3, state=_state())

    loaded = load_checkpoint(path)

    assert path == checkpoint_path(tmp_path, 3)
    assert loaded.round_id == 3
    assert list(loaded.state) == list(_state())
    for key, tensor in _state().items():
        assert torch.equal(loaded.state[key], tensor)


def test_rng_state_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(11)
    random.seed(11)
    save_checkpoint(tmp_path, round_id=0, state=_state(), rng=capture_rng())
    expected = (torch.rand(4), random.random())
    torch.manual_seed(99)
    random.seed(99)

    restore_rng(load_checkpoint(checkpoint_path(tmp_path, 0)).rng)

    assert torch.equal(torch.rand(4), expected[0])
    assert random.random() == expected[1]


def test_tied_tensors_are_written_under_both_keys(tmp_path: Path) -> None:
    shared = torch.randn(4, 2)
    state = {"transformer.wte.weight": shared, "lm_head.weight": shared}

    loaded = load_checkpoint(save_checkpoint(tmp_path, round_id=0, state=state))

    assert torch.equal(loaded.state["lm_head.weight"], shared)
    assert torch.equal(loaded.state["transformer.wte.weight"], shared)


def test_latest_ignores_half_written_temps_and_other_files(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, round_id=0, state=_state())
    save_checkpoint(tmp_path, round_id=1, state=_state())
    (tmp_path / ".round-000002.safetensors.tmp-123").write_bytes(b"\x00" * 10)
    (tmp_path / "round-2.safetensors").write_bytes(b"junk")
    (tmp_path / "notes.txt").write_text("x")

    latest = latest_checkpoint(tmp_path)

    assert completed_rounds(tmp_path) == [0, 1]
    assert latest is not None and latest.round_id == 1
    assert next_round(tmp_path) == 2


def test_fresh_directory_starts_at_round_zero(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    assert next_round(tmp_path) == 0


def test_failed_write_leaves_no_checkpoint_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash_mid_write(tensors: object, filename: str, metadata: object) -> None:
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", crash_mid_write)

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, round_id=5, state=_state())

    assert list(tmp_path.iterdir()) == []
    assert latest_checkpoint(tmp_path) is None


def test_overwrite_is_atomic_replace(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, round_id=0, state=_state())
    newer = {k: v + 1 for k, v in _state().items()}

    save_checkpoint(tmp_path, round_id=0, state=newer)

    loaded = load_checkpoint(checkpoint_path(tmp_path, 0))
    assert torch.equal(loaded.state["model.layers.0.mlp.up_proj.weight"], torch.full((2, 2), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["round-000000.safetensors"]


def test_corrupt_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    checkpoint_path(tmp_path, 4).write_bytes(b"not safetensors")

    with pytest.raises(AssetError, match="round-000004"):
        latest_checkpoint(tmp_path)
