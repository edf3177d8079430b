"""Rounds in one process: resume reproduces an uninterrupted run; saving off still averages.

.venv/bin/pytest tests/unit/test_train_local.py -q
"""

from __future__ import annotations

from pathlib import Path

import torch
from model_helpers import padded_batch, tiny_model, twin
from torch import nn

from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan
from splitlab.train.checkpoint import completed_rounds
from splitlab.train.engine import UShapeEngine
from splitlab.train.local import LocalRounds
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters

PLAN = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def make_run(seed: int, checkpoint_dir: Path | None, save: bool = True) -> LocalRounds:
    base = tiny_model("gpt2", seed=seed, dropout=0.1).train()
    owners, workers = [], []
    for name in ("o0", "o1"):
        front, _, tail = build_parts(twin(base), PLAN)
        owners.append(OwnerNode(name, front, tail, adamw(partition_parameters(front, tail))))
    _, body, _ = build_parts(twin(base), PLAN)
    workers.append(WorkerNode("w0", body, adamw(partition_parameters(body))))
    engine = UShapeEngine(owners=owners, workers=workers, max_inflight=2, credit=2)
    validation = {"o0": [padded_batch("gpt2", seed=77)]}
    return LocalRounds(
        engine=engine,
        make_optimizer=adamw,
        checkpoint_dir=checkpoint_dir,
        save_checkpoint=save,
        validation=validation,
    )


def data(round_id: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    return {
        "o0": [padded_batch("gpt2", seed=100 * round_id + i) for i in range(3)],
        "o1": [
            padded_batch("gpt2", lengths=(6, 4), seed=100 * round_id + 50 + i) for i in range(2)
        ],
    }


def states(run: LocalRounds) -> list[dict[str, torch.Tensor]]:
    return [m.state_dict() for m in run.modules]


def test_resume_continues_from_the_last_completed_round(tmp_path: Path) -> None:
    torch.manual_seed(0)
    straight = make_run(0, tmp_path / "a")
    straight.run(rounds=3, data=data, quota=2)
    torch.manual_seed(0)
    make_run(0, tmp_path / "b").run(rounds=2, data=data, quota=2)
    torch.manual_seed(12345)  # a new process: other RNG, other init; both come from the checkpoint

    restarted = make_run(7, tmp_path / "b")
    summaries = restarted.run(rounds=3, data=data, quota=2, resume=True)

    assert [s.round_id for s in summaries] == [2]
    assert completed_rounds(tmp_path / "b") == [0, 1, 2]
    for expected, actual in zip(states(straight), states(restarted), strict=True):
        for key, tensor in expected.items():
            torch.testing.assert_close(actual[key], tensor, msg=lambda m, k=key: f"{k}: {m}")


def test_saving_off_still_averages_and_redistributes(tmp_path: Path) -> None:
    run = make_run(0, tmp_path, save=False)

    summaries = run.run(rounds=1, data=data, quota=2)

    assert list(tmp_path.iterdir()) == []
    assert summaries[0].checkpoint is None
    front0, tail0, front1, tail1, _ = run.modules
    for a, b in ((front0, front1), (tail0, tail1)):
        for key, tensor in a.state_dict().items():
            torch.testing.assert_close(b.state_dict()[key], tensor)


def test_round_summary_reports_weights_and_local_validation(tmp_path: Path) -> None:
    run = make_run(0, tmp_path)

    (summary,) = run.run(rounds=1, data=data, quota=2)

    assert summary.weights == {"o0": 9, "o1": 4, "w0": 13}
    assert summary.num_windows == 2
    assert set(summary.validation) == {"o0"}
    assert summary.validation["o0"].perplexity is not None
