"""Low-rank cut plans and the family cut contract (pure, fast).

.venv/bin/pytest tests/unit/test_lowrank_plan.py -q
"""

from __future__ import annotations

import pytest
from model_helpers import adapter_of, tiny_model

from splitlab.config.enums import ResidualMode
from splitlab.errors import ConfigError
from splitlab.models.lowrank import decompose
from splitlab.models.parts import cut_paths
from splitlab.models.plan import (
    CutSpec,
    lowrank_cuts,
    two_stage_plan,
    u_shape_plan,
    with_lowrank_cuts,
)


def test_both_cuts_sit_on_the_last_block_of_each_sender() -> None:
    plan = with_lowrank_cuts(
        u_shape_plan(num_layers=6, cut_layers=2, tail_blocks=1), rank=8, cuts="both"
    )

    front_cut, tail_cut = lowrank_cuts(plan)

    assert front_cut == CutSpec(1, 8, ResidualMode.drop)
    assert plan.front.code_out == plan.body.code_in == front_cut
    assert tail_cut.block == 4 and plan.body.code_out == plan.tail.code_in == tail_cut
    assert (plan.body.start, plan.body.stop) == (2, 5)  # block ranges are unchanged


def test_front_cut_needs_a_front_block() -> None:
    with pytest.raises(ConfigError, match="cut_layers >= 1"):
        with_lowrank_cuts(u_shape_plan(num_layers=4, cut_layers=0, tail_blocks=1), rank=2)


def test_two_stage_has_no_tail_cut() -> None:
    with pytest.raises(ConfigError, match="finetune.sft.cuts=tail"):
        with_lowrank_cuts(two_stage_plan(num_layers=4, cut_layers=2), rank=2, cuts="tail")


def test_rank_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="finetune.sft.rank=0"):
        with_lowrank_cuts(two_stage_plan(num_layers=4, cut_layers=2), rank=0)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "qwen2"])
def test_rank_above_full_is_a_config_error(family: str) -> None:
    with pytest.raises(ConfigError, match=r"finetune.sft.rank=33: must be in \[1, 32\]"):
        decompose(tiny_model(family), 1, 33, adapter=adapter_of(family))


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "qwen2"])
def test_sender_and_receiver_paths_cover_the_cut_block_once(family: str) -> None:
    model = tiny_model(family)
    adapter = adapter_of(family)
    decompose(model, 2, 4, adapter=adapter)
    cut = CutSpec(2, 4)
    block = adapter.block_path(2)

    def params_under(paths: list[str]) -> set[str]:
        return {
            f"{path}.{name}"
            for path in paths
            for name, _ in model.get_submodule(path).named_parameters()
        }

    sender = params_under(cut_paths(adapter, model, cut, sender=True))
    receiver = params_under(cut_paths(adapter, model, cut, sender=False))
    whole = {f"{block}.{n}" for n, _ in model.get_submodule(block).named_parameters()}

    assert not sender & receiver
    assert sender | receiver == whole


def test_a_cut_on_an_undecomposed_block_is_a_config_error() -> None:
    model = tiny_model("bert")
    with pytest.raises(ConfigError, match="not decomposed"):
        cut_paths(adapter_of("bert"), model, CutSpec(1, 4), sender=True)
