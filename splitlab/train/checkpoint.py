"""Round checkpoints: safetensors with the original model's key names, written atomically.

A checkpoint is `<dir>/round-NNNNNN.safetensors` holding the merged model state (the keys
`model.state_dict()` has, so `from_pretrained`-style tooling and `load_state_dict` accept it)
and, in the safetensors metadata, the round number and the RNG state needed to resume.

Writing goes to a hidden temp file in the same folder, is fsynced, then `os.replace`d onto the
final name and the folder is fsynced, so a crash leaves either the old set of checkpoints or
the new one. Only names matching `round-NNNNNN.safetensors` are ever read back, so a
half-written temp is never mistaken for a checkpoint.

    .venv/bin/pytest tests/unit/test_train_checkpoint.py -q
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from splitlab.errors import AssetError

_NAME = re.compile(r"^round-(\d{6})\.safetensors$")
_ROUND_KEY = "splitlab.round"
_RNG_KEY = "splitlab.rng"


@dataclass(frozen=True)
class Checkpoint:
    round_id: int  # the last completed round (0-based)
    state: dict[str, torch.Tensor]
    rng: dict[str, str]  # opaque; hand to `restore_rng`
    path: Path


def checkpoint_path(directory: Path, round_id: int) -> Path:
    return Path(directory) / f"round-{round_id:06d}.safetensors"


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
) -> Path:
    """Write round `round_id`'s merged state atomically; returns the final path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, round_id)
    temp = directory / f".{final.name}.tmp-{os.getpid()}"
    metadata = {
        "format": "pt",
        _ROUND_KEY: str(round_id),
        _RNG_KEY: json.dumps(dict(rng if rng is not None else capture_rng())),
    }
    try:
        save_file(unshared(state), str(temp), metadata=metadata)
        _fsync_path(temp)
        os.replace(temp, final)
    finally:
        temp.unlink(missing_ok=True)
    _fsync_path(directory)  # the rename itself survives a crash only once the folder is synced
    return final


def load_checkpoint(path: Path) -> Checkpoint:
    """Raises: AssetError naming the file when it is not a readable splitlab checkpoint."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - not a dict
    except (OSError, SafetensorError) as exc:
        raise AssetError(f"checkpoint {str(path)!r} cannot be read: {exc}") from exc
    if _ROUND_KEY not in metadata:
        raise AssetError(f"checkpoint {str(path)!r} has no {_ROUND_KEY!r} in its metadata")
    return Checkpoint(
        round_id=int(metadata[_ROUND_KEY]),
        state=state,
        rng=json.loads(metadata.get(_RNG_KEY, "{}")),
        path=path,
    )


def completed_rounds(directory: Path) -> list[int]:
    """Rounds with a finished checkpoint in `directory`, ascending (temps never count)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    rounds = [int(m.group(1)) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(rounds)


def latest_checkpoint(directory: Path) -> Checkpoint | None:
    """The last completed round's checkpoint, or None when there is none (a fresh start)."""
    rounds = completed_rounds(directory)
    return load_checkpoint(checkpoint_path(directory, rounds[-1])) if rounds else None


def next_round(directory: Path) -> int:
    """Where `resume` starts: one past the last completed round (0 on a fresh start)."""
    rounds = completed_rounds(directory)
    return rounds[-1] + 1 if rounds else 0
