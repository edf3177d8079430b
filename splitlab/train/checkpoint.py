"""Round checkpoints: safetensors with the original model's key names, written atomically.

A checkpoint is `<dir>/round-NNNNNN.safetensors` holding the merged model state (the keys
`model.state_dict()` has, so `from_pretrained`-style tooling and `load_state_dict` accept it)
and, in the safetensors metadata, the round number and the RNG state needed to resume. Names
and metadata count rounds 1..N as the logs do (`round-000001` is the first round's); the
functions here take and return the 0-based round index the code and traces use.

Writing goes to a hidden temp file in the same folder, is fsynced, then `os.replace`d onto the
final name and the folder is fsynced, so a crash leaves either the old set of checkpoints or
the new one. Only names matching `round-NNNNNN.safetensors` are ever read back, so a
half-written temp is never mistaken for a checkpoint; `remove_stale_temps` clears what a killed
write left behind. `prune_checkpoints` keeps what `task.keep_checkpoints` asks for (all, the
last, or the last and the best by the validation loss stored in each file's metadata).

Nothing is trusted at load: the metadata's round must equal the file name's, the RNG state must
parse, a SHA-256 over every tensor's key, dtype, shape and bytes must match, and, given the
model's shapes, every key must be there with exactly its shape (never broadcast), all checked
before any tensor reaches a model. `latest_checkpoint` falls back past a bad newest file to the
last intact one, saying once which file it skipped and why.

    .venv/bin/pytest tests/unit/test_train_checkpoint.py -q
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import math
import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from splitlab.config.enums import KeepCheckpoints
from splitlab.errors import AssetError, StorageError
from splitlab.telemetry.records import round_number
from splitlab.train.checkpoint_files import NAME, checkpoint_path, completed_rounds

log = logging.getLogger(__name__)

_TEMP = re.compile(r"^\.round-\d{6}\.safetensors\.tmp-\d+$")
_ROUND_KEY = "splitlab.round"
_RNG_KEY = "splitlab.rng"
_SUM_KEY = "splitlab.sha256"
_VAL_KEY = "splitlab.val_loss"  # the round's validation loss, what `keep` ranks "best" by

Shapes = Mapping[str, Sequence[int]]  # key -> the shape the model holds


@dataclass(frozen=True)
class Checkpoint:
    round_id: int  # the last completed round's 0-based index (its file says round_id + 1)
    state: dict[str, torch.Tensor]
    rng: dict[str, str]  # opaque; hand to `restore_rng`
    path: Path


def capture_rng() -> dict[str, str]:
    """The torch (CPU and CUDA) and Python RNG states as JSON-safe strings."""
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        cuda = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
        state["cuda"] = json.dumps(cuda)
    version, internal, gauss = random.getstate()
    state["python"] = json.dumps([version, list(internal), gauss])
    return state


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def restore_rng(state: Mapping[str, str]) -> None:
    """Put back what `capture_rng` took (CUDA states only where this machine has CUDA)."""
    if "torch" in state:
        torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in json.loads(state["cuda"])])
    if "python" in state:
        version, internal, gauss = json.loads(state["python"])
        random.setstate((version, tuple(internal), gauss))


def unshared(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, cloning any that share storage (tied weights) with an earlier key:
    safetensors refuses aliased tensors, and loading writes the same values to both keys."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        t = tensor.detach().cpu().contiguous()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[key] = t.clone() if ident in seen else t
        seen.add(ident)
    return out


def _fsync_path(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    directory: Path,
    *,
    round_id: int,
    state: Mapping[str, torch.Tensor],
    rng: Mapping[str, str] | None = None,
    val_loss: float | None = None,
) -> Path:
    """Write round `round_id`'s merged state atomically; returns the final path. `val_loss`
    (the round's validation loss, if validated) is kept in the metadata for `prune`.

    Raises:
        StorageError: naming the file and the cause (a full disk, a read-only folder) when it
            cannot be written; no temp file is left behind and earlier checkpoints are intact.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"checkpoint folder {str(directory)!r}: cannot be made: {exc}") from exc
    final = checkpoint_path(directory, round_id)
    temp = directory / f".{final.name}.tmp-{os.getpid()}"
    tensors = unshared(state)
    metadata = {
        "format": "pt",
        _ROUND_KEY: str(round_number(round_id)),
        _RNG_KEY: json.dumps(dict(rng if rng is not None else capture_rng())),
        _SUM_KEY: state_checksum(tensors),
    }
    if val_loss is not None:
        metadata[_VAL_KEY] = repr(float(val_loss))
    try:
        save_file(tensors, str(temp), metadata=metadata)
        _fsync_path(temp)
        os.replace(temp, final)
        _fsync_path(directory)  # the rename survives a crash only once the folder is synced
    except (OSError, SafetensorError) as exc:
        kept = completed_rounds(directory)
        raise StorageError(
            f"checkpoint {str(final)!r}: cannot be written: {exc}; nothing partial is left, "
            + (
                f"the newest earlier one is {checkpoint_path(directory, kept[-1]).name}"
                if kept
                else "no earlier checkpoint is in the folder"
            )
        ) from exc
    finally:
        temp.unlink(missing_ok=True)
    return final


def state_checksum(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 hex over every tensor's key, dtype, shape and bytes, in key order."""
    digest = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().cpu().contiguous()
        digest.update(f"{key}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _parse_rng(text: str, where: str) -> dict[str, str]:
    """The RNG metadata as `restore_rng` needs it; raises AssetError naming the field."""
    try:
        rng = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssetError(f"{where}: {_RNG_KEY} is not JSON: {exc}") from exc
    if not isinstance(rng, dict) or not all(isinstance(v, str) for v in rng.values()):
        raise AssetError(f"{where}: {_RNG_KEY} is not an object of strings: {text[:80]!r}")
    field = _RNG_KEY
    try:
        if "torch" in rng:
            field = f"{_RNG_KEY}.torch"
            base64.b64decode(rng["torch"], validate=True)
        if "cuda" in rng:
            field = f"{_RNG_KEY}.cuda"
            cuda = json.loads(rng["cuda"])
            if not isinstance(cuda, list):
                raise ValueError("not a list")
            for text_state in cuda:
                base64.b64decode(text_state, validate=True)
        if "python" in rng:
            field = f"{_RNG_KEY}.python"
            version, internal, gauss = json.loads(rng["python"])
            random.Random().setstate((version, tuple(internal), gauss))
    except (ValueError, TypeError, binascii.Error) as exc:
        raise AssetError(f"{where}: {field} is malformed: {exc}") from exc
    return rng


def _check_round(path: Path, metadata: Mapping[str, str], where: str) -> int:
    text = metadata.get(_ROUND_KEY)
    if text is None:
        raise AssetError(f"{where}: no {_ROUND_KEY!r} in its metadata")
    try:
        round_id = int(text)
    except ValueError as exc:
        raise AssetError(f"{where}: {_ROUND_KEY}={text!r} is not a round number") from exc
    if round_id < 1:
        raise AssetError(f"{where}: {_ROUND_KEY}={round_id}: rounds count from 1")
    named = NAME.match(path.name)
    if named and int(named.group(1)) != round_id:
        raise AssetError(
            f"{where}: {_ROUND_KEY}={round_id} but the file name says round {int(named.group(1))}"
        )
    return round_id - 1  # the 0-based index the code and traces use


def check_shapes(stored: Shapes, expected: Shapes, where: str) -> None:
    """Every expected key present with exactly its shape, and no key the model lacks.

    Raises:
        AssetError: naming `where`, the key, the expected and the stored shape.
    """
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise AssetError(f"{where}: lacks key {missing[0]!r} ({len(missing)} missing in all)")
    unexpected = sorted(set(stored) - set(expected))
    if unexpected:
        raise AssetError(
            f"{where}: holds key {unexpected[0]!r} the model lacks ({len(unexpected)} in all)"
        )
    for key in sorted(expected):
        want, got = list(expected[key]), list(stored[key])
        if want != got:
            raise AssetError(f"{where}: {key!r} has shape {got}, the model's is {want}")


def load_checkpoint(path: Path, *, expected: Shapes | None = None) -> Checkpoint:
    """Read and verify one checkpoint; `expected` (the model's key -> shape) checks keys and
    shapes exactly before any tensor is read.

    Raises:
        AssetError: naming the file and the field or key when it is not an intact checkpoint
            of round `round-NNNNNN` (its name) for this model.
    """
    path = Path(path)
    where = f"checkpoint {str(path)!r}"
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            round_id = _check_round(path, metadata, where)
            rng = _parse_rng(metadata.get(_RNG_KEY, "{}"), where)
            checksum = metadata.get(_SUM_KEY)
            if checksum is None:
                raise AssetError(f"{where}: no {_SUM_KEY!r} in its metadata (not written by "
                                 "this splitlab, or tampered with)")  # fmt: skip
            if expected is not None:
                shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}  # noqa: SIM118
                check_shapes(shapes, expected, where)
            state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - not a dict
    except (OSError, SafetensorError) as exc:
        raise AssetError(f"{where}: cannot be read: {exc}") from exc
    if state_checksum(state) != checksum:
        raise AssetError(f"{where}: tensor bytes do not match its {_SUM_KEY} checksum (corrupted)")
    return Checkpoint(round_id=round_id, state=state, rng=rng, path=path)


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete the temp files a killed `save_checkpoint` left in `directory`; returns them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = sorted(p for p in directory.iterdir() if _TEMP.match(p.name))
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        log.info("removed %d stale checkpoint temp file(s) in %s", len(stale), directory)
    return stale


def rounds_to_keep(
    rounds: Sequence[int], val_loss: Mapping[int, float], keep: KeepCheckpoints
) -> set[int]:
    """Which of `rounds` (at least one) `keep` keeps: all, the last, or the last and the one
    with the lowest `val_loss` (rounds missing from it never count as best; ties: earliest)."""
    if keep is KeepCheckpoints.all:
        return set(rounds)
    kept = {max(rounds)}
    scored = [(val_loss[r], r) for r in rounds if r in val_loss and math.isfinite(val_loss[r])]
    if keep is KeepCheckpoints.last_and_best and scored:
        kept.add(min(scored)[1])
    return kept


def _val_loss(path: Path) -> float | None:
    """The `val_loss` a checkpoint was saved with; None if absent or unreadable."""
    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get(_VAL_KEY)
        return float(text) if text is not None else None
    except (OSError, SafetensorError, ValueError):
        return None


def prune_checkpoints(directory: Path, keep: KeepCheckpoints) -> list[Path]:
    """Delete the checkpoints in `directory` that `keep` does not keep; returns the kept files."""
    rounds = completed_rounds(directory)
    if not rounds:
        return []
    losses = {r: v for r in rounds if (v := _val_loss(checkpoint_path(directory, r))) is not None}
    kept = rounds_to_keep(rounds, losses, KeepCheckpoints(keep))
    for round_id in rounds:
        if round_id not in kept:
            checkpoint_path(directory, round_id).unlink(missing_ok=True)
    return [checkpoint_path(directory, r) for r in sorted(kept)]


def latest_checkpoint(directory: Path, *, expected: Shapes | None = None) -> Checkpoint | None:
    """The newest intact checkpoint, or None when there is none at all (a fresh start).

    A newest file that fails `load_checkpoint` is skipped for the one before it, with one
    warning naming it and why.

    Raises:
        AssetError: the newest file's error, when no checkpoint in `directory` is intact.
    """
    rounds = completed_rounds(directory)
    first_error: AssetError | None = None
    for round_id in reversed(rounds):
        try:
            checkpoint = load_checkpoint(checkpoint_path(directory, round_id), expected=expected)
        except AssetError as exc:
            first_error = first_error or exc
            continue
        if first_error is not None:
            log.warning("resuming from %s, skipping newer: %s", checkpoint.path.name, first_error)
        return checkpoint
    if first_error is not None:
        raise first_error
    return None


def next_round(directory: Path) -> int:
    """Where `resume` starts: one past the last completed round (0 on a fresh start)."""
    rounds = completed_rounds(directory)
    return rounds[-1] + 1 if rounds else 0
