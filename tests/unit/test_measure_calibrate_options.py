"""Calibration options: `--only` and `--contexts` from tools/calibrate.py to `CalibrateOptions`,
and the refusal of a decode sweep with no more contexts than the fit's parameters.

.venv/bin/pytest tests/unit/test_measure_calibrate_options.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tool_helpers import load_tool

from splitlab.config.schema import CalibrateTaskConfig
from splitlab.configure import compose_config
from splitlab.errors import ConfigError
from splitlab.measure.calibrate import PROBES, options_from
from splitlab.measure.probes import load_counts


def test_only_and_contexts_flags_reach_the_options() -> None:
    tool = load_tool("calibrate")
    args = tool.build_parser().parse_args(
        ["--model", "tiny_llama", "--only", "load,decode", "--contexts", "2048,128,512"]
    )
    overrides = tool.overrides(args)
    assert "task.only=[load,decode]" in overrides and "task.contexts=[2048,128,512]" in overrides
    options = options_from(compose_config(overrides).task)
    assert options.probes == ("decode", "load")  # in PROBES order, whatever the flag's order
    assert options.contexts == (128, 512, 2048)


def test_no_only_runs_every_probe_and_contexts_default_to_geometric() -> None:
    options = options_from(CalibrateTaskConfig(quick=True))
    assert options.probes == PROBES and "load" in PROBES
    assert options.contexts == (128, 256, 512, 1024, 2048)


@pytest.mark.parametrize(
    "argv", [["--only", "decod"], ["--only", ""], ["--contexts", "128,x"], ["--contexts", "0,5,9"]]
)
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        load_tool("calibrate").build_parser().parse_args(argv)
    assert done.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_two_contexts_are_refused_for_the_two_parameter_decode_fit() -> None:
    cfg = compose_config(["task=calibrate", "task.contexts=[128,2048,2048]"])
    with pytest.raises(ConfigError, match=r"task.contexts=.*2 distinct contexts.*at least 3"):
        options_from(cfg.task)


def test_contexts_matter_only_when_decode_runs() -> None:
    cfg = compose_config(["task=calibrate", "task.contexts=[128,2048]", "task.only=[load]"])
    assert options_from(cfg.task).probes == ("load",)


def test_load_counts_give_more_points_than_the_two_parameters() -> None:
    assert load_counts(4) == (1, 2, 3, 4)
    assert load_counts(30) == (1, 2, 3, 4, 6, 8, 12, 16, 24)
    assert load_counts(2) == (1, 2)  # too few: the fit says so (NoFit), never a fake r^2


def test_tool_exits_2_naming_the_contexts_before_any_timing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "cal.json"
    code = load_tool("calibrate").main(["--model", "tiny_llama", "--only", "decode", "--contexts", "128,2048",
                         "--out", str(out)])  # fmt: skip
    assert code == 2 and "task.contexts=[128, 2048]" in capsys.readouterr().err
    assert not out.exists()
