"""Checkpoints: original keys, round and RNG metadata, atomic writes, resume from the latest."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from splitlab.config.enums import KeepCheckpoints
from splitlab.errors import AssetError, ExitCode, StorageError
from splitlab.train import checkpoint
from splitlab.train.checkpoint import (
    capture_rng,
    checkpoint_path,
    completed_rounds,
    latest_checkpoint,
    load_checkpoint,
    next_round,
    prune_checkpoints,
    restore_rng,
    rounds_to_keep,
    save_checkpoint,
)
from splitlab.train.checkpoint_files import checkpoint_bytes


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
    (tmp_path / ".round-000003.safetensors.tmp-123").write_bytes(b"\x00" * 10)
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

    with pytest.raises(StorageError, match="disk full") as raised:
        save_checkpoint(tmp_path, round_id=5, state=_state())

    assert "round-000006.safetensors" in str(raised.value)
    assert "no earlier checkpoint" in str(raised.value)
    assert raised.value.exit_code == ExitCode.STORAGE
    assert list(tmp_path.iterdir()) == []
    assert latest_checkpoint(tmp_path) is None


def test_overwrite_is_atomic_replace(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, round_id=0, state=_state())
    newer = {k: v + 1 for k, v in _state().items()}

    save_checkpoint(tmp_path, round_id=0, state=newer)

    loaded = load_checkpoint(checkpoint_path(tmp_path, 0))
    assert torch.equal(loaded.state["model.layers.0.mlp.up_proj.weight"], torch.full((2, 2), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["round-000001.safetensors"]


def test_corrupt_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    checkpoint_path(tmp_path, 4).write_bytes(b"not safetensors")

    with pytest.raises(AssetError, match="round-000005"):
        latest_checkpoint(tmp_path)


# ---- resume never trusts a checkpoint blindly (issue 18, F10) ----


def _expected() -> dict[str, torch.Size]:
    return {key: tensor.shape for key, tensor in _state().items()}


def _rewrite(path: Path, state: dict[str, torch.Tensor], **metadata: str) -> None:
    """Rewrite `path` keeping its metadata except `metadata` (what a tamperer or bug could do)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        kept = dict(f.metadata() or {})
    save_file(state, str(path), metadata={**kept, **metadata})


def test_a_tensor_with_the_wrong_shape_is_refused_naming_file_and_key(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, round_id=0, state=_state())
    bad = {**_state(), "model.layers.0.mlp.up_proj.weight": torch.ones(1)}
    _rewrite(path, bad)

    with pytest.raises(AssetError, match=r"round-000001.*up_proj.*\[2, 2\]"):
        load_checkpoint(path, expected=_expected())


def test_shapes_are_checked_against_the_model_exactly(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, round_id=0, state=_state())
    wider = {**_expected(), "model.layers.0.mlp.up_proj.weight": torch.Size([2, 1])}

    with pytest.raises(AssetError, match=r"round-000001.*up_proj.*\[2, 1\]"):
        load_checkpoint(path, expected=wider)


def test_a_missing_key_names_the_file_and_the_key(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, round_id=0, state=_state())
    expected = {**_expected(), "lm_head.weight": torch.Size([3, 2])}

    with pytest.raises(AssetError, match=r"round-000001.*lm_head\.weight"):
        load_checkpoint(path, expected=expected)


def test_metadata_round_must_match_the_file_name(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, round_id=1, state=_state())
    _rewrite(path, _state(), **{"splitlab.round": "7"})

    with pytest.raises(AssetError, match=r"round-000002.*splitlab\.round.*7"):
        load_checkpoint(path)


def test_corrupted_tensor_bytes_fail_the_checksum(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, round_id=0, state=_state())
    data = bytearray(path.read_bytes())
    data[-4:] = b"\x00\x00\x20\x40"  # finite noise: the last float 1.0 becomes 2.5
    path.write_bytes(bytes(data))

    with pytest.raises(AssetError, match=r"round-000001.*checksum"):
        load_checkpoint(path)


def test_a_checkpoint_without_a_checksum_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = checkpoint_path(tmp_path, 0)
    save_file(_state(), str(path), metadata={"splitlab.round": "1", "splitlab.rng": "{}"})

    with pytest.raises(AssetError, match=r"round-000001.*splitlab\.sha256"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "rng",
    ["{not json", '["a list"]', '{"torch": "***"}', '{"python": "[1, 2"}', '{"torch": 5}'],
    ids=["not-json", "not-object", "bad-base64", "bad-python", "not-a-string"],
)
def test_malformed_rng_metadata_names_file_and_field(tmp_path: Path, rng: str) -> None:
    path = save_checkpoint(tmp_path, round_id=0, state=_state())
    _rewrite(path, _state(), **{"splitlab.rng": rng})

    with pytest.raises(AssetError, match=r"round-000001.*splitlab\.rng"):
        load_checkpoint(path)


def test_junk_newest_falls_back_to_the_last_intact_one_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_checkpoint(tmp_path, round_id=0, state=_state())
    save_checkpoint(tmp_path, round_id=1, state=_state())
    checkpoint_path(tmp_path, 2).write_bytes(b"junk")

    with caplog.at_level("WARNING", logger="splitlab.train.checkpoint"):
        latest = latest_checkpoint(tmp_path, expected=_expected())

    assert latest is not None and latest.round_id == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "round-000003.safetensors" in warnings[0]


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    checkpoint_path(tmp_path, 0).write_bytes(b"junk")
    checkpoint_path(tmp_path, 1).write_bytes(b"junk too")

    with pytest.raises(AssetError, match="round-000002"):
        latest_checkpoint(tmp_path)


def test_stale_temps_from_a_killed_write_are_removed(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, round_id=0, state=_state())
    stale = tmp_path / ".round-000002.safetensors.tmp-4242"
    stale.write_bytes(b"\x00" * 10)
    (tmp_path / "notes.txt").write_text("x")

    removed = checkpoint.remove_stale_temps(tmp_path)

    assert removed == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "round-000001.safetensors"]


@pytest.mark.parametrize(
    ("keep", "losses", "kept"),
    [
        (KeepCheckpoints.all, {0: 0.9, 1: 0.5, 2: 0.7}, {0, 1, 2}),
        (KeepCheckpoints.last, {0: 0.9, 1: 0.5, 2: 0.7}, {2}),
        (KeepCheckpoints.last_and_best, {0: 0.9, 1: 0.5, 2: 0.7}, {1, 2}),
        (KeepCheckpoints.last_and_best, {0: 0.9, 1: 0.8, 2: 0.7}, {2}),  # the last is the best
        (KeepCheckpoints.last_and_best, {}, {2}),  # not validated: no best
        (KeepCheckpoints.last_and_best, {0: float("nan"), 1: 0.6, 2: 0.7}, {1, 2}),
        (KeepCheckpoints.last_and_best, {0: 0.5, 1: 0.5, 2: 0.7}, {0, 2}),  # tie: the earliest
    ],
)
def test_rounds_to_keep(keep: KeepCheckpoints, losses: dict[int, float], kept: set[int]) -> None:
    assert rounds_to_keep([0, 1, 2], losses, keep) == kept


def test_prune_keeps_the_last_and_the_best_by_stored_val_loss(tmp_path: Path) -> None:
    for round_id, loss in enumerate([0.9, 0.4, 0.6, None]):
        save_checkpoint(tmp_path, round_id=round_id, state=_state(), val_loss=loss)
    sizes = [checkpoint_path(tmp_path, r).stat().st_size for r in (1, 3)]

    kept = prune_checkpoints(tmp_path, KeepCheckpoints.last_and_best)

    assert kept == [checkpoint_path(tmp_path, 1), checkpoint_path(tmp_path, 3)]
    assert completed_rounds(tmp_path) == [1, 3]
    assert checkpoint_bytes(tmp_path) == (2, sum(sizes))
    assert latest_checkpoint(tmp_path).round_id == 3  # resume still starts after the last
