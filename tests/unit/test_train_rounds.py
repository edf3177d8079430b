"""Many owners x many workers in one process: WRR split, barrier order, FedAvg weights, round end.

.venv/bin/pytest tests/unit/test_train_rounds.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_helpers import padded_batch, tiny_model, twin
from torch import nn

from splitlab.errors import ProtocolError
from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan
from splitlab.reference.ushape import UShapeEngine
from splitlab.train.checkpoint import latest_checkpoint
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters
from splitlab.train.rounds import NodeUpdate, finish_round, redistribute
from splitlab.train.window import effective_credit
from splitlab.train.wrr import AdaptiveWeights, SmoothWRR

PLAN = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)
WEIGHTS = {"w0": 3.0, "w1": 1.0}


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def make_group(
    base: nn.Module, owners: list[str], events: list[dict[str, Any]]
) -> tuple[UShapeEngine, list[nn.Module]]:
    """Each owner and worker gets its own replica of `base`."""
    owner_nodes, worker_nodes, modules = [], [], []
    for name in owners:
        front, _, tail = build_parts(twin(base), PLAN)
        owner_nodes.append(OwnerNode(name, front, tail, adamw(partition_parameters(front, tail))))
        modules += [front, tail]
    for name in WEIGHTS:
        _, body, _ = build_parts(twin(base), PLAN)
        worker_nodes.append(WorkerNode(name, body, adamw(partition_parameters(body))))
        modules.append(body)
    engine = UShapeEngine(
        owners=owner_nodes,
        workers=worker_nodes,
        max_inflight=2,
        credit=effective_credit(max_inflight=2, worker_max_inflight=8, num_owners=len(owners)),
        weights={name: AdaptiveWeights(WEIGHTS, adaptive=False) for name in owners},
        emit=lambda record: events.append(record.to_dict()),
    )
    return engine, modules


def data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    return [
        padded_batch("gpt2", lengths=(8, 5, 3)[: 1 + (i + seed) % 3], seed=seed + i)
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def three_by_two() -> dict[str, Any]:
    base = tiny_model("gpt2")
    events: list[dict[str, Any]] = []
    engine, modules = make_group(base, ["o0", "o1", "o2"], events)
    batches = {"o0": data(5, 0), "o1": data(2, 50), "o2": []}
    before_o2 = {k: v.clone() for k, v in engine.owners[2].state_dict().items()}
    reports = engine.run_round(batches, quota=3)
    return {
        "base": base,
        "engine": engine,
        "modules": modules,
        "batches": batches,
        "events": events,
        "reports": reports,
        "before_o2": before_o2,
    }


def test_each_owner_follows_the_3_to_1_wrr_sequence(three_by_two: dict[str, Any]) -> None:
    reports = three_by_two["reports"]

    for owner, count in (("o0", 5), ("o1", 2), ("o2", 0)):
        planned = [w for r in reports for w in r.assignment[owner]]
        assert planned == SmoothWRR(WEIGHTS).assign(count)


def test_enough_equal_batches_split_75_25() -> None:
    events: list[dict[str, Any]] = []
    engine, _ = make_group(tiny_model("gpt2"), ["o0"], events)

    engine.run_round({"o0": data(16, 0)}, quota=4)

    forwards = [e["worker"] for e in events if e["kind"] == "forward"]
    assert forwards.count("w0") == 12 and forwards.count("w1") == 4


def test_every_commit_after_all_drained_and_every_step_after_all_commits(
    three_by_two: dict[str, Any],
) -> None:
    events = three_by_two["events"]

    for window in {e["window"] for e in events}:
        kinds = [(i, e["kind"]) for i, e in enumerate(events) if e["window"] == window]
        last_drained = max(i for i, k in kinds if k == "drained")
        commits = [i for i, k in kinds if k == "commit"]
        assert len([k for _, k in kinds if k == "drained"]) == 3
        assert len(commits) == 2 and min(commits) > last_drained
        assert all(i > max(commits) for i, k in kinds if k == "step")
        assert all(i < last_drained for i, k in kinds if k in ("forward", "backward"))


def test_empty_owner_joins_every_window_without_stepping(three_by_two: dict[str, Any]) -> None:
    events, engine = three_by_two["events"], three_by_two["engine"]

    assert [e["window"] for e in events if e["kind"] == "drained" and e["owner"] == "o2"] == [0, 1]
    assert not [e for e in events if e["kind"] == "step" and e["owner"] == "o2"]
    for key, tensor in engine.owners[2].state_dict().items():
        assert torch.equal(tensor, three_by_two["before_o2"][key]), key
    # o1 ran 2 microbatches in window 0 and nothing in the partial window 1
    assert [e["window"] for e in events if e["kind"] == "step" and e["owner"] == "o1"] == [0]


def test_fedavg_weights_are_processed_samples(three_by_two: dict[str, Any], tmp_path: Path) -> None:
    engine, batches, reports = (
        three_by_two["engine"],
        three_by_two["batches"],
        three_by_two["reports"],
    )
    samples = {o: sum(int(b["input_ids"].shape[0]) for b in batches[o]) for o in batches}
    per_worker = dict.fromkeys(WEIGHTS, 0)
    for owner, owner_batches in batches.items():
        planned = [w for r in reports for w in r.assignment[owner]]
        for worker, batch in zip(planned, owner_batches, strict=True):
            per_worker[worker] += int(batch["input_ids"].shape[0])
    updates = [NodeUpdate(o.name, "owner", o.state_dict(), o.num_samples) for o in engine.owners]
    updates += [
        NodeUpdate(w.name, "body", w.state_dict(), w.num_samples) for w in engine.workers.values()
    ]
    key = "transformer.h.0.mlp.c_fc.weight"
    expected = sum(u.state[key] * u.num_samples for u in updates if key in u.state) / sum(
        samples.values()
    )

    result = finish_round(
        round_id=0, updates=updates, modules=three_by_two["modules"], checkpoint_dir=tmp_path
    )

    assert result.weights == {**samples, **per_worker}
    assert samples["o2"] == 0
    torch.testing.assert_close(result.state[key], expected)
    for module in three_by_two["modules"]:  # redistributed everywhere, the empty owner included
        for name, tensor in module.state_dict().items():
            torch.testing.assert_close(tensor, result.state[name])
    saved = latest_checkpoint(tmp_path)
    assert saved is not None and saved.round_id == 0
    assert set(saved.state) == set(three_by_two["base"].state_dict())


def test_redistribute_never_broadcasts_a_wrong_shape_and_copies_nothing() -> None:
    module = nn.Linear(2, 2, bias=True)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    merged = {"bias": torch.full((2,), 5.0), "weight": torch.ones(1)}

    with pytest.raises(ProtocolError, match=r"'weight' has shape \[1\].*\[2, 2\]"):
        redistribute(merged, [module])

    for key, tensor in module.state_dict().items():
        assert torch.equal(tensor, before[key]), key
