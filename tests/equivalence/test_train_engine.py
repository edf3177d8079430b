"""U-shape engine vs the unsplit model trained with AdamW on the same windows (fp32).

.venv/bin/pytest tests/equivalence/test_train_engine.py -q
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from model_helpers import adapter_of, padded_batch, tiny_model, twin
from torch import nn

from splitlab.config.enums import Objective, TaskKind
from splitlab.errors import NonFiniteError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan
from splitlab.models.tokens import IGNORE_INDEX, positions_from_pad_mask
from splitlab.reference.ushape import UShapeEngine
from splitlab.telemetry.records import Record
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters
from splitlab.train.optim import adamw as build_adamw
from splitlab.train.wrr import AdaptiveWeights

FAMILIES = ["bert", "gpt2", "llama"]
WINDOW = 3
NUM_MICROBATCHES = 7  # windows of 3, 3 and a partial 1
LENGTHS = [(8, 5, 3), (6, 6), (4, 7, 2), (8,), (3, 3, 5), (7, 2), (5, 8, 1)]


def adamw(params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    # eps=1e-6: a key-projection bias gets a gradient that is zero in exact arithmetic (softmax
    # ignores a per-row shift), i.e. pure rounding noise; with eps=1e-8 Adam would blow that
    # noise up to lr-sized steps that differ between any two summation orders. The nodes' own
    # AdamW (fused where it can be), so that the processes' and the reference's steps match.
    return build_adamw(params, lr=1e-2, weight_decay=0.01, eps=1e-6)


def batches(
    family: str, n: int = NUM_MICROBATCHES, seed: int = 10
) -> list[dict[str, torch.Tensor]]:
    return [
        padded_batch(family, lengths=LENGTHS[i % len(LENGTHS)], seed=seed + i) for i in range(n)
    ]


def train_unsplit(
    model: nn.Module,
    family: str,
    data: Sequence[dict[str, torch.Tensor]],
    *,
    window: int = WINDOW,
    clip: float = 0.0,
    clip_groups: Sequence[Sequence[nn.Parameter]] = (),
) -> None:
    """The reference: transformers' forward per microbatch, mean over the window, one AdamW step."""
    adapter = adapter_of(family)
    optimizer = adamw(list(model.parameters()))
    for start in range(0, len(data), window):
        chunk = data[start : start + window]
        for batch in chunk:
            logits = model(
                input_ids=batch[INPUT_IDS],
                attention_mask=batch[PAD_MASK],
                position_ids=positions_from_pad_mask(batch[PAD_MASK]),
            ).logits
            (adapter.loss(logits, adapter.labels(batch)) / len(chunk)).backward()
        for params in clip_groups:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def split_nodes(
    model: nn.Module, name: str = "o0", worker: str = "w0", cut: int = 1, tail: int = 1
) -> tuple[OwnerNode, WorkerNode]:
    front, body, tail_part = build_parts(
        model, u_shape_plan(num_layers=4, cut_layers=cut, tail_blocks=tail)
    )
    owner = OwnerNode(name, front, tail_part, adamw(partition_parameters(front, tail_part)))
    return owner, WorkerNode(worker, body, adamw(partition_parameters(body)))


def assert_same_parameters(ref: nn.Module, split: nn.Module) -> None:
    split_params = dict(split.named_parameters())
    for name, param in ref.named_parameters():
        torch.testing.assert_close(split_params[name], param, msg=lambda m, n=name: f"{n}: {m}")


def one_by_one(model: nn.Module, **engine_args: Any) -> UShapeEngine:
    owner, worker = split_nodes(model)
    defaults: dict[str, Any] = {"max_inflight": 2, "credit": 2}
    return UShapeEngine(owners=[owner], workers=[worker], **{**defaults, **engine_args})


@pytest.mark.parametrize("family", FAMILIES)
def test_one_owner_one_worker_matches_unsplit(family: str) -> None:
    ref = tiny_model(family)
    split = twin(ref)
    data = batches(family)

    train_unsplit(ref, family, data)
    reports = one_by_one(split).run_round({"o0": data}, quota=WINDOW)

    assert [r.group_total for r in reports] == [3, 3, 1]
    assert_same_parameters(ref, split)


@pytest.mark.parametrize("family", FAMILIES)
def test_dropout_on_matches_unsplit_with_the_same_rng_order(family: str) -> None:
    ref = tiny_model(family, dropout=0.2).train()
    split = twin(ref).train()
    data = batches(family)

    torch.manual_seed(1234)
    train_unsplit(ref, family, data)
    torch.manual_seed(1234)
    one_by_one(split).run_round({"o0": data}, quota=WINDOW)

    assert_same_parameters(ref, split)


def test_dropout_changes_the_result_so_the_test_above_means_something() -> None:
    ref = tiny_model("gpt2", dropout=0.2).train()
    split = twin(ref).train()
    data = batches("gpt2")

    torch.manual_seed(1)
    train_unsplit(ref, "gpt2", data)
    torch.manual_seed(2)
    one_by_one(split).run_round({"o0": data}, quota=WINDOW)

    with pytest.raises(AssertionError):
        assert_same_parameters(ref, split)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gradients_back_out_of_order_give_the_same_parameters(family: str) -> None:
    ref = tiny_model(family)
    split = twin(ref)
    data = batches(family)

    train_unsplit(ref, family, data)
    reports = one_by_one(split, max_inflight=3, credit=3, backward_order="lifo").run_round(
        {"o0": data}, quota=WINDOW
    )

    assert reports[0].peak_live == 3
    assert_same_parameters(ref, split)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_clipping_is_per_partition(family: str) -> None:
    ref = tiny_model(family)
    split = twin(ref)
    data = batches(family)
    ref_front, ref_body, ref_tail = build_parts(
        ref, u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)
    )
    groups = [partition_parameters(ref_front, ref_tail), partition_parameters(ref_body)]

    train_unsplit(ref, family, data, clip=0.05, clip_groups=groups)
    one_by_one(split, clip_grad_norm=0.05).run_round({"o0": data}, quota=WINDOW)

    assert_same_parameters(ref, split)


def test_each_part_runs_forward_once_per_microbatch() -> None:
    model = tiny_model("gpt2", dropout=0.1).train()
    engine = one_by_one(model)
    calls = {"front": 0, "body": 0, "tail": 0}
    owner, worker = engine.owners[0], engine.workers["w0"]
    for name, part in (("front", owner.front), ("body", worker.body), ("tail", owner.tail)):
        part.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))

    engine.run_round({"o0": batches("gpt2")}, quota=WINDOW)

    assert calls == dict.fromkeys(calls, NUM_MICROBATCHES)


def test_graphs_are_released_and_parameters_frozen_until_the_window_drains() -> None:
    model = tiny_model("llama")
    outputs: list[weakref.ref[torch.Tensor]] = []
    snapshot: dict[str, torch.Tensor] = {}
    problems: list[str] = []

    def emit(record: Record) -> None:
        kind, fields = record.KIND, record.to_dict()
        if kind == "plan":
            snapshot.update({k: v.detach().clone() for k, v in model.named_parameters()})
        if kind == "drained":
            if any(ref() is not None for ref in outputs):
                problems.append(f"window {fields['window']}: a body output outlived its backward")
            for name, param in model.named_parameters():
                if not torch.equal(param, snapshot[name]):
                    problems.append(f"window {fields['window']}: {name} changed before drain")

    engine = one_by_one(model, emit=emit)
    engine.workers["w0"].body.register_forward_hook(
        lambda _m, _i, out: outputs.append(weakref.ref(out))
    )

    engine.run_round({"o0": batches("llama")}, quota=WINDOW)

    assert problems == []
    assert len(outputs) == NUM_MICROBATCHES


def test_non_finite_body_output_names_the_worker() -> None:
    model = tiny_model("gpt2")
    engine = one_by_one(model)
    with torch.no_grad():
        next(engine.workers["w0"].body.parameters()).fill_(float("nan"))

    with pytest.raises(NonFiniteError, match="body output of worker 'w0'.*'o0'"):
        engine.run_round({"o0": batches("gpt2")}, quota=WINDOW)


def test_non_finite_loss_names_the_owner() -> None:
    model = tiny_model("bert")
    engine = one_by_one(model)
    with torch.no_grad():
        engine.owners[0].tail.module("classifier").weight.fill_(float("inf"))

    with pytest.raises(NonFiniteError, match="owner 'o0'"):
        engine.run_round({"o0": batches("bert")}, quota=WINDOW)


def summed_token_losses(family: str, logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Sum of the per-target cross-entropies of a batch (next tokens, or one per sequence)."""
    labels = adapter_of(family).labels(batch)
    if adapter_of(family).task is TaskKind.causal_lm:  # position t predicts token t + 1
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def train_unsplit_token_weighted(
    model: nn.Module, family: str, data: Sequence[dict[str, torch.Tensor]]
) -> None:
    """The token-weighted reference: per window, the sum of every target's loss over the
    window's target count (counted from the masks), one AdamW step."""
    causal = adapter_of(family).task is TaskKind.causal_lm
    optimizer = adamw(list(model.parameters()))
    for start in range(0, len(data), WINDOW):
        chunk = data[start : start + WINDOW]
        # real tokens after each (right-padded) row's first, or one per row
        total = sum(int(b[PAD_MASK][:, 1:].sum()) if causal else len(b[PAD_MASK]) for b in chunk)
        for batch in chunk:
            logits = model(input_ids=batch[INPUT_IDS], attention_mask=batch[PAD_MASK],
                           position_ids=positions_from_pad_mask(batch[PAD_MASK])).logits  # fmt: skip
            (summed_token_losses(family, logits, batch) / total).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_token_weighted_objective_is_the_window_token_sum_over_its_targets(family: str) -> None:
    ref = tiny_model(family)
    split, other = twin(ref), twin(ref)
    data = batches(family)  # uneven lengths: windows of 3, 3 and a partial 1

    train_unsplit_token_weighted(ref, family, data)
    one_by_one(split, objective=Objective.token_weighted).run_round({"o0": data}, quota=WINDOW)
    one_by_one(other).run_round({"o0": data}, quota=WINDOW)  # mean of per-microbatch means

    assert_same_parameters(ref, split)
    if adapter_of(family).task is TaskKind.causal_lm:  # uneven targets: the objectives differ
        with pytest.raises(AssertionError):
            assert_same_parameters(ref, other)


def test_adaptive_weights_switch_from_initial_to_measured_throughput() -> None:
    now = [0.0]
    model = tiny_model("llama")
    owner, fast = split_nodes(model)
    _, slow = split_nodes(twin(model), worker="w1")
    for worker, seconds in ((fast, 1.0), (slow, 4.0)):  # fake body time per forward
        worker.body.register_forward_hook(lambda *_, s=seconds: now.__setitem__(0, now[0] + s))
        worker.clock = lambda: now[0]
    weights = AdaptiveWeights({"w0": 1.0, "w1": 1.0})
    reports = UShapeEngine(
        owners=[owner],
        workers=[fast, slow],
        max_inflight=2,
        credit=2,
        weights={"o0": weights},
    ).run_round({"o0": batches("llama", n=12)}, quota=4)

    assert reports[0].assignment["o0"] == ["w0", "w1", "w0", "w1"]  # initial 1:1
    measured = weights.weights()
    assert measured["w0"] > 2.0 * measured["w1"]  # ~4x the tokens per second
    assert reports[2].assignment["o0"].count("w0") >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_on_cuda_matches_cpu_reference_and_times_with_events(family: str) -> None:
    ref = tiny_model(family)
    split = twin(ref).cuda()
    data = batches(family)
    on_gpu = [{k: v.cuda() for k, v in b.items()} for b in data]

    train_unsplit(ref, family, data)
    engine = one_by_one(split)
    engine.run_round({"o0": on_gpu}, quota=WINDOW)

    split_params = dict(split.named_parameters())
    for name, param in ref.named_parameters():
        torch.testing.assert_close(split_params[name].cpu(), param, atol=1e-4, rtol=1e-3)
    assert engine.workers["w0"].tokens_per_s() is not None
