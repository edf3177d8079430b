"""The logger group's pure parts: metric mapping, config flattening, selection and the
missing-library check (splitlab/loggers/points.py, registry.py).

    .venv/bin/pytest tests/unit/test_loggers.py -q
"""

from __future__ import annotations

import pytest

from splitlab.config.schema import (
    CsvLoggerConfig,
    LoggerConfig,
    MlflowLoggerConfig,
    TensorboardLoggerConfig,
)
from splitlab.errors import ConfigError, ExitCode
from splitlab.loggers import registry
from splitlab.loggers.points import (
    MetricPoint,
    config_params,
    final_points,
    ring_points,
    round_points,
)

ROWS = [  # two owners' round records: 0-based `round`, as the traces hold them
    {"round": 0, "owner": "owner0", "loss": 1.0, "accuracy": 0.5, "samples": 30, "bytes": 7},
    {"round": 0, "owner": "owner1", "loss": 0.5, "accuracy": 0.75, "samples": 10, "bytes": 9},
    {"round": 1, "owner": "owner0", "loss": 0.2, "accuracy": None, "samples": 40, "bytes": 3},
]


def test_round_points_weight_owners_by_samples_at_the_round_number() -> None:
    points = {(p.name, p.step): p.value for p in round_points(ROWS)}

    assert points[("round/loss", 1)] == pytest.approx((1.0 * 30 + 0.5 * 10) / 40)
    assert points[("round/accuracy", 1)] == pytest.approx((0.5 * 30 + 0.75 * 10) / 40)
    assert points[("round/owner1/bytes", 1)] == 9.0
    assert points[("round/loss", 2)] == pytest.approx(0.2)
    assert ("round/accuracy", 2) not in points  # no owner measured it
    assert ("round/owner0/accuracy", 2) not in points
    assert all(step in (1, 2) for _, step in points)  # rounds as people count them


def test_final_points_keep_numbers_at_the_final_round() -> None:
    final = {"round": 3, "split": "test", "samples": 200, "val_loss": 0.4, "val_accuracy": 0.8}

    assert final_points(final) == [
        MetricPoint("final/samples", 200.0, 3),
        MetricPoint("final/val_loss", 0.4, 3),
        MetricPoint("final/val_accuracy", 0.8, 3),
    ]
    assert final_points(None) == []


def test_ring_points_carry_summary_figures_and_tpot_per_token() -> None:
    result = {"prompt": "hi", "token_ids": [5, 6, 7], "ttft_ms": 12.5, "tpot_ms_median": 4.0,
              "tpot_ms": [3.0, 5.0], "tokens_per_s": 200.0, "prompt_len": 4,
              "stop_reason": "max_new_tokens"}  # fmt: skip

    points = ring_points(result)

    figures = {p.name: p.value for p in points if p.step == 0}
    assert figures == {"ring/ttft_ms": 12.5, "ring/tpot_ms_median": 4.0,
                       "ring/tokens_per_s": 200.0, "ring/prompt_len": 4.0,
                       "ring/num_tokens": 3.0}  # fmt: skip
    assert [(p.name, p.value, p.step) for p in points if p.step > 0] == [
        ("ring/tpot_ms", 3.0, 1), ("ring/tpot_ms", 5.0, 2),
    ]  # fmt: skip


def test_config_params_flatten_to_dotted_strings() -> None:
    loggers = LoggerConfig(csv=CsvLoggerConfig(), mlflow=MlflowLoggerConfig(experiment="e"))

    params = config_params(loggers)

    assert params == {"tensorboard": "None", "mlflow.tracking_uri": "None",
                      "mlflow.experiment": "e", "mlflow.run_name": "None"}  # fmt: skip


def test_selected_lists_the_chosen_loggers_in_order() -> None:
    loggers = LoggerConfig(mlflow=MlflowLoggerConfig(), csv=CsvLoggerConfig())

    assert list(registry.selected(loggers)) == ["csv", "mlflow"]
    assert registry.selected(LoggerConfig()) == {}


def test_a_missing_logger_library_is_a_config_error_naming_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(registry.REQUIRES, "tensorboard", ("splitlab_no_such_module",))

    with pytest.raises(ConfigError, match=r"logger=tensorboard: splitlab_no_such_module .*"
                       r"pip install 'splitlab\[loggers\]'") as caught:  # fmt: skip
        registry.check_loggers(LoggerConfig(tensorboard=TensorboardLoggerConfig()))
    assert caught.value.exit_code == ExitCode.CONFIG
    registry.check_loggers(LoggerConfig(csv=CsvLoggerConfig()))  # csv needs nothing


def test_mlflow_needs_sql_modules_only_for_a_sqlite_store() -> None:
    assert "sqlalchemy" in registry.required_modules("mlflow", MlflowLoggerConfig())
    remote = MlflowLoggerConfig(tracking_uri="http://127.0.0.1:5000")
    assert registry.required_modules("mlflow", remote) == ("mlflow",)


def test_preflight_refuses_a_selected_logger_whose_library_is_missing(monkeypatch) -> None:
    from splitlab.configure import compose_config
    from splitlab.preflight import preflight

    cfg = compose_config(["model=tiny_bert", "logger=[csv,mlflow]"])
    monkeypatch.setitem(registry.REQUIRES, "mlflow", ("splitlab_no_such_module",))

    with pytest.raises(ConfigError, match=r"logger=mlflow: splitlab_no_such_module"):
        preflight(cfg)
