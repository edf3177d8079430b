"""Two-stage engine vs an unsplit AdamW reference, for control_count 1, 2 and 3.

The reference trains the unsplit model with two AdamW optimizers: the last-stage parameters
step after every microbatch; the first-stage gradients accumulate over a window of
`control_count` microbatches, are averaged over its real count, and step once.

.venv/bin/pytest tests/equivalence/test_train_two_stage.py -q
"""

from __future__ import annotations

import secrets
import threading

import pytest
import torch
from model_helpers import adapter_of, padded_batch, tiny_model, twin
from test_train_engine import adamw, assert_same_parameters
from torch import nn

from splitlab.errors import ConfigError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import build_parts
from splitlab.models.plan import two_stage_plan
from splitlab.models.tokens import positions_from_pad_mask
from splitlab.reference.two_stage import TwoStageEngine, in_order, reversed_order
from splitlab.train.nodes import partition_parameters
from splitlab.train.two_stage_net import FirstStage, LastStage
from splitlab.wire.inproc import InProcHub, InProcTransport
from splitlab.wire.tcp import TcpTransport

PLAN = two_stage_plan(num_layers=4, cut_layers=2)
NUM_MICROBATCHES = 5  # control_count 2 and 3 both end with a partial window


def untied(family: str) -> nn.Module:
    """Two stages on two machines cannot share one embedding/head tensor."""
    model = tiny_model(family)
    if family == "gpt2":
        model.config.tie_word_embeddings = False
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def data(family: str) -> list[dict[str, torch.Tensor]]:
    shapes = [(8, 5, 3), (6, 2), (7,), (4, 4, 8), (3, 6)]
    return [padded_batch(family, lengths=shapes[i], seed=30 + i) for i in range(NUM_MICROBATCHES)]


def train_reference(model: nn.Module, family: str, batches: list, control_count: int) -> None:
    adapter = adapter_of(family)
    first, last = build_parts(model, PLAN)  # only to know which parameters are which stage's
    first_params, last_params = partition_parameters(first), partition_parameters(last)
    first_opt, last_opt = adamw(first_params), adamw(last_params)
    for start in range(0, len(batches), control_count):
        chunk = batches[start : start + control_count]
        for batch in chunk:
            logits = model(
                input_ids=batch[INPUT_IDS],
                attention_mask=batch[PAD_MASK],
                position_ids=positions_from_pad_mask(batch[PAD_MASK]),
            ).logits
            adapter.loss(logits, adapter.labels(batch)).backward()
            last_opt.step()
            last_opt.zero_grad(set_to_none=True)
        for param in first_params:
            param.grad.div_(len(chunk))
        first_opt.step()
        first_opt.zero_grad(set_to_none=True)


def engine_for(model: nn.Module, control_count: int, **kwargs: object) -> TwoStageEngine:
    first, last = build_parts(model, PLAN)
    return TwoStageEngine(
        first=first,
        last=last,
        first_optimizer=adamw(partition_parameters(first)),
        last_optimizer=adamw(partition_parameters(last)),
        control_count=control_count,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("control_count", [1, 2, 3])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_matches_unsplit_adamw_with_gradients_back_out_of_order(
    family: str, control_count: int
) -> None:
    ref = untied(family)
    split = twin(ref)
    batches = data(family)

    train_reference(ref, family, batches, control_count)
    engine_for(split, control_count, return_order=reversed_order).run(batches)

    assert_same_parameters(ref, split)


def test_first_stage_steps_once_per_window_with_a_partial_last_window() -> None:
    events: list[tuple[str, dict]] = []
    engine = engine_for(
        untied("llama"), 2, emit=lambda record: events.append((record.KIND, record.to_dict()))
    )

    engine.run(data("llama"))

    steps = [fields["num_microbatches"] for kind, fields in events if kind == "step"]
    assert steps == [2, 2, 1]
    forwards = [fields["microbatch"] for kind, fields in events if kind == "forward"]
    assert forwards == list(range(NUM_MICROBATCHES))  # one forward each, never repeated


def test_in_order_and_reversed_returns_agree() -> None:
    ref = untied("gpt2")
    other = twin(ref)
    batches = data("gpt2")

    engine_for(ref, 3, return_order=in_order).run(batches)
    engine_for(other, 3, return_order=reversed_order).run(batches)

    assert_same_parameters(ref, other)


def test_rejects_bad_control_count_and_tied_stages() -> None:
    with pytest.raises(ConfigError, match="control_count=0"):
        engine_for(untied("llama"), 0)
    with pytest.raises(ConfigError, match="tied"):
        engine_for(tiny_model("gpt2"), 1)


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
@pytest.mark.parametrize("control_count", [1, 2, 3])
def test_stages_over_a_transport_match_unsplit_adamw(control_count: int, transport: str) -> None:
    ref = untied("llama")
    split = twin(ref)
    batches = data("llama")
    first_part, last_part = build_parts(split, PLAN)
    if transport == "inproc":
        hub = InProcHub()
        first_t, last_t = InProcTransport("first", hub), InProcTransport("last", hub)
    else:
        key = secrets.token_bytes(32)
        first_t = TcpTransport("first", key=key, session="s", pool_bytes=16 << 20)
        last_t = TcpTransport("last", key=key, session="s", pool_bytes=16 << 20)
        first_t.connect("last", *last_t.address)
    first = FirstStage(
        part=first_part, optimizer=adamw(partition_parameters(first_part)), transport=first_t,
        last_stage="last", control_count=control_count, timeout_s=20.0,
    )  # fmt: skip
    last = LastStage(
        part=last_part, optimizer=adamw(partition_parameters(last_part)), transport=last_t,
        timeout_s=20.0,
    )  # fmt: skip
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            last.serve({"first": len(batches)})
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    train_reference(ref, "llama", batches, control_count)
    thread = threading.Thread(target=serve)
    thread.start()
    try:
        first.run(batches)
    finally:
        thread.join(timeout=60)
        first_t.close()
        last_t.close()

    assert errors == []
    assert_same_parameters(ref, split)


def test_stages_sharing_a_tied_embedding_and_head_are_refused() -> None:
    from splitlab.errors import ConfigError
    from splitlab.train.two_stage_net import check_untied

    first, last = build_parts(tiny_model("gpt2"), PLAN)  # GPT-2 ties wte and lm_head
    with pytest.raises(ConfigError, match="model.untie_embeddings=true"):
        check_untied(first, last)
    check_untied(*build_parts(untied("gpt2"), PLAN))
