"""The low-rank cut study's pure parts: arm names, the grid, the learning-rate schedule, the
per-arm table over seeds, and a study folder refusing a run trained at another budget.

    .venv/bin/pytest tests/sft/test_sft_study.py -q
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from splitlab.config.enums import ResidualMode, SftCut, SftFactors
from splitlab.errors import ConfigError
from splitlab.sft import study as st


@pytest.mark.parametrize("name", ["baseline", "upper/drop/8", "lower/keep/1/3f", "upper/keep/32"])
def test_arm_names_round_trip(name: str) -> None:
    assert st.Arm.parse(name).name == name


def test_arm_maps_to_its_cut() -> None:
    arm = st.Arm.parse("lower/drop/8/3f")

    sft = arm.sft()

    assert (sft.enabled, sft.cuts, sft.residual, sft.rank, sft.factors) == (
        True, SftCut.front, ResidualMode.drop, 8, SftFactors.three,
    )  # fmt: skip
    assert arm.label == "lower/drop/3f" and not st.Arm.parse("baseline").sft().enabled


@pytest.mark.parametrize("bad", ["upper", "middle/drop/8", "upper/cut/8", "upper/drop/0",
                                 "upper/drop/x", "upper/drop/8/4f", ""])  # fmt: skip
def test_a_bad_arm_names_the_key(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"task\.arm="):
        st.Arm.parse(bad)


def test_a_rank_above_the_hidden_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="exceeds the hidden 384"):
        st.Arm.parse("upper/drop/512").check(384)


def test_grid_narrows_to_the_named_arms_in_each_form() -> None:
    two, three = SftFactors.two, SftFactors.three

    arms = st.grid((8, 32), factors=(two, three), arms=("upper/drop",))

    assert [a.name for a in arms] == [
        "baseline", "upper/drop/8", "upper/drop/8/3f", "upper/drop/32", "upper/drop/32/3f",
    ]  # fmt: skip
    assert len(st.grid((1, 8, 16, 32))) == 17  # the real budget's arms


def test_lr_warms_up_then_decays_to_zero() -> None:
    total, warm = 100, 10
    factors = [st.lr_factor(s, total, warm) for s in range(total)]

    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:], strict=False))
    assert factors[-1] == pytest.approx(1 / 90) and st.lr_factor(total, total, warm) == 0.0


def _record(arm: str, seed: int, accuracy: float, study: st.Study) -> dict:
    a = st.Arm.parse(arm)
    return {
        "arm": a.name, "label": a.label, "depth": a.depth or "-", "residual": "-",
        "rank": a.rank or 384, "factors": "-", "seed": seed, "accuracy": accuracy,
        "val_loss": 0.5, "best_accuracy": accuracy, "final_train_loss": 0.4,
        "bytes_per_step_front_cut": 1000.0, "bytes_per_step_tail_cut": 1000.0,
        "bytes_per_step_studied_cut": 100.0 if a.depth else 1000.0, "train_s": 1.0, "steps": 10,
        "curve": [{"step": 0, "accuracy": 0.5}, {"step": 10, "accuracy": accuracy}],
        "study": asdict(study),
    }  # fmt: skip


def test_summary_is_the_mean_and_spread_over_seeds_baseline_first() -> None:
    study = st.Study()
    records = [
        _record("upper/drop/8", 0, 0.70, study),
        _record("baseline", 1, 0.80, study),
        _record("upper/drop/8", 1, 0.74, study),
        _record("baseline", 0, 0.78, study),
    ]

    table, runs, curves = st.summarize(records)

    assert list(table["arm"]) == ["baseline", "upper/drop/8"]
    drop = table.iloc[1]
    assert drop["seeds"] == 2 and drop["accuracy"] == pytest.approx(0.72)
    assert drop["accuracy_std"] == pytest.approx(0.0283, abs=1e-4)
    assert list(runs["seed"][:2]) == [0, 1] and len(curves) == 8
    md = st.markdown(table, asdict(study))
    assert "| upper/drop/8 | 8 | 2 | 0.7200 +- 0.0283 | -7.0 |" in md


def test_a_folder_refuses_a_run_of_another_budget(tmp_path: Path) -> None:
    study = st.Study(samples=64)
    arm = st.Arm.parse("upper/drop/8")
    path = st.run_file(tmp_path, arm, 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_record(arm.name, 0, 0.7, study)))

    assert st.finished(tmp_path, arm, 0, study)["accuracy"] == 0.7
    assert st.finished(tmp_path, arm, 1, study) is None
    with pytest.raises(ConfigError, match="epochs=3.*epochs=5"):
        st.finished(tmp_path, arm, 0, replace(study, epochs=5))
    assert st.collect(tmp_path)["arm"].tolist() == ["upper/drop/8"]
    st.claim(tmp_path, study)
    st.claim(tmp_path, study)  # the same budget again
    with pytest.raises(ConfigError, match="a study at lr=0.0001, this run asks lr=0.001"):
        st.claim(tmp_path, replace(study, lr=1e-3))
    assert (tmp_path / "sft_rank.md").is_file() and (tmp_path / st.CURVES).is_file()


@pytest.mark.parametrize(("key", "value"), [("epochs", 0), ("lr", -1e-4), ("head_lr", 0.0),
                                            ("warmup", 1.0)])  # fmt: skip
def test_a_bad_budget_names_the_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"task.{key}="):
        replace(st.Study(), **{key: value}).check()


def test_a_rate_of_zero_freezes_those_tensors() -> None:
    import torch

    from splitlab.models.parts import LOWRANK_IN

    part = torch.nn.Module()
    part.classifier = torch.nn.Linear(2, 2)
    part.block = torch.nn.Module()
    setattr(part.block, LOWRANK_IN, torch.nn.Linear(2, 1))
    part.body = torch.nn.Linear(2, 2)

    groups = st._param_groups(replace(st.Study(), lr=0.0, factor_lr=1e-3), part)

    assert sorted((g["lr"], len(g["params"])) for g in groups) == [(1e-4, 2), (1e-3, 2)]
    assert not part.body.weight.requires_grad and part.classifier.weight.requires_grad
