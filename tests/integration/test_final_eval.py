"""The merged checkpoint's final evaluation: its result and its one progress line.

.venv/bin/pytest tests/integration/test_final_eval.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from splitlab.configure import compose_config
from splitlab.train.checkpoint import save_checkpoint
from splitlab.train.final_eval import checkpoint_model, evaluate_checkpoint


@pytest.mark.assets  # rotten_tomatoes and MiniLM's tokenizer
def test_final_evaluation_reports_its_batches_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = compose_config(["model=tiny_bert", "data.samples_per_owner=8", "data.val_samples=8",
                          "data.test_samples=10", "finetune.batch_size=4"])  # fmt: skip
    model, _ = checkpoint_model(cfg)
    save_checkpoint(tmp_path, round_id=0, state=model.state_dict())

    with caplog.at_level("INFO", logger="splitlab.telemetry.progress"):
        final = evaluate_checkpoint(cfg, tmp_path)

    assert final is not None and final["samples"] == 10 and final["round"] == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "splitlab.telemetry.progress"]
    assert len(lines) == 1
    assert lines[0].startswith(
        "final evaluation of the round-1 checkpoint on 10 test examples: 3 batches in "
    )  # 4 + 4 + 2
