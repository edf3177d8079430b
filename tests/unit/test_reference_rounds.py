"""Rounds in one process: resume reproduces an uninterrupted run; saving off still averages.

.venv/bin/pytest tests/unit/test_reference_rounds.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_helpers import padded_batch, tiny_model, twin
from torch import nn

from splitlab.config.schema import LoraConfig
from splitlab.errors import AssetError
from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan
from splitlab.reference.rounds import LocalRounds
from splitlab.reference.ushape import UShapeEngine
from splitlab.train.checkpoint import (
    checkpoint_path,
    completed_rounds,
    load_checkpoint,
    save_checkpoint,
)
from splitlab.train.exchange import ADAPTERS, MERGED, Exchange
from splitlab.train.lora import apply_lora, merged_state, trainable_state
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


def make_lora_run(checkpoint_dir: Path, exchange: Exchange) -> LocalRounds:
    base = tiny_model("gpt2")
    owners, workers = [], []
    for name in ("o0", "o1"):
        front, _, tail = build_parts(twin(base), PLAN)
        apply_lora([front, tail], LoraConfig(r=4, alpha=8.0))
        owners.append(OwnerNode(name, front, tail, adamw(partition_parameters(front, tail))))
    _, body, _ = build_parts(twin(base), PLAN)
    apply_lora([body], LoraConfig(r=4, alpha=8.0))
    workers.append(WorkerNode("w0", body, adamw(partition_parameters(body))))
    engine = UShapeEngine(owners=owners, workers=workers, max_inflight=2, credit=2)
    return LocalRounds(
        engine=engine, make_optimizer=adamw, checkpoint_dir=checkpoint_dir, exchange=exchange
    )


def test_lora_adapter_fedavg_moves_only_adapters_and_checkpoints_dense(tmp_path: Path) -> None:
    run = make_lora_run(tmp_path, ADAPTERS)
    base_before = {
        k: v.clone() for k, v in run.modules[0].state_dict().items() if "base_layer" in k
    }

    (summary,) = run.run(rounds=1, data=data, quota=2)

    front0, tail0, front1, tail1, body = run.modules
    for name, tensor in trainable_state(front0).items():  # every replica holds the average
        torch.testing.assert_close(trainable_state(front1)[name], tensor)
    for key, tensor in base_before.items():  # the frozen base never moved
        assert torch.equal(front0.state_dict()[key], tensor)
    saved = load_checkpoint(summary.checkpoint)
    assert set(saved.state) == set(tiny_model("gpt2").state_dict())  # original keys only
    torch.testing.assert_close(saved.state["transformer.h.1.attn.c_attn.weight"],
                               merged_state(body)["transformer.h.1.attn.c_attn.weight"])  # fmt: skip


def test_lora_merged_fedavg_folds_the_dense_average_into_every_base(tmp_path: Path) -> None:
    run = make_lora_run(tmp_path, MERGED)

    (summary,) = run.run(rounds=1, data=data, quota=2)

    saved = load_checkpoint(summary.checkpoint).state
    for module in run.modules:
        assert all(not p.any() for n, p in module.named_parameters() if "lora_B" in n)
        for key, tensor in merged_state(module).items():
            torch.testing.assert_close(tensor, saved[key])


def test_resume_refuses_a_wrongly_shaped_tensor_before_loading_anything(tmp_path: Path) -> None:
    make_run(0, tmp_path).run(rounds=1, data=data, quota=2)
    good = load_checkpoint(checkpoint_path(tmp_path, 0)).state
    key = next(k for k in good if k.endswith("attn.c_attn.weight"))
    save_checkpoint(tmp_path, round_id=0, state={**good, key: torch.ones(1)})  # checksum intact
    restarted = make_run(7, tmp_path)
    before = states(restarted)

    with pytest.raises(AssetError, match=rf"round-000001.*{key}.*\[1\]"):
        restarted.run(rounds=2, data=data, quota=2, resume=True)

    for expected, actual in zip(before, states(restarted), strict=True):
        for k, tensor in expected.items():
            assert torch.equal(actual[k], tensor), k


def test_resume_falls_back_past_a_junk_newest_checkpoint(tmp_path: Path) -> None:
    make_run(0, tmp_path).run(rounds=1, data=data, quota=2)
    checkpoint_path(tmp_path, 1).write_bytes(b"junk")
    (tmp_path / ".round-000002.safetensors.tmp-99").write_bytes(b"half")

    summaries = make_run(7, tmp_path).run(rounds=2, data=data, quota=2, resume=True)

    assert [s.round_id for s in summaries] == [1]
    assert load_checkpoint(checkpoint_path(tmp_path, 1)).round_id == 1
    assert not list(tmp_path.glob(".round-*"))
