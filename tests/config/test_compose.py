"""Every option of every config group composes, converts to dataclasses and validates.

pytest tests/config -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from splitlab.config import schema
from splitlab.config.enums import ArchitectureName, TaskName
from splitlab.config.load import CONF_DIR
from splitlab.configure import compose_config, load_resolved_config

GROUPS = [
    "task",
    "model",
    "architecture",
    "transport",
    "control",
    "finetune",
    "data",
    "drift",
    "planner",
    "testbed",
    "logger",
]

# Options that only make sense with a different companion choice.
COMPANIONS: dict[tuple[str, str], list[str]] = {
    ("architecture", "ring"): ["task=infer"],
    ("task", "analyze"): ["task.run_dir=/tmp/some-run"],
    # inproc runs no task's processes (refused elsewhere, tests/config/test_validate.py)
    ("transport", "inproc"): ["task=analyze", "task.run_dir=/tmp/some-run"],
    ("data", "gsm_symbolic"): ["model=tiny_llama"],
    ("data", "gsm8k"): ["model=tiny_gpt2"],
    ("data", "emotion"): ["model.num_labels=6"],
    ("model", "smollm2_135m"): ["task=infer"],
    ("model", "llama3_2_1b"): ["task=infer"],
    ("model", "gpt2"): ["data=gsm8k"],
    ("model", "tiny_gpt2"): ["data=gsm_symbolic"],
    ("model", "tiny_llama"): ["data=gsm_symbolic"],
}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


ALL_OPTIONS = [(g, o) for g in GROUPS for o in _options(g)]


def test_every_group_has_options() -> None:
    for group in GROUPS:
        assert _options(group), f"conf/{group}/ has no options"


@pytest.mark.parametrize(("group", "option"), ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_option_composes(group: str, option: str) -> None:
    overrides = [f"{group}={option}", *COMPANIONS.get((group, option), [])]
    cfg = compose_config(overrides)
    node = getattr(cfg, group)
    assert not isinstance(node, dict), f"{group}={option} did not convert to a dataclass"
    if hasattr(node, "name") and group not in ("finetune",):
        value = node.name.value if hasattr(node.name, "value") else node.name
        assert value == option


def test_default_is_the_main_job() -> None:
    cfg = compose_config()
    assert cfg.task.name is TaskName.finetune
    assert cfg.model.name == "minilm" and cfg.model.family == "bert"
    assert isinstance(cfg.architecture, schema.UShapeConfig)
    assert (cfg.architecture.owners, cfg.architecture.workers) == (2, 1)
    assert cfg.transport.name == "tcp" and cfg.control.name == "embedded"
    assert cfg.data.name == "rotten_tomatoes" and cfg.data.distribution.value == "dirichlet"


def test_task_infer_picks_ring_and_smollm2_but_the_command_line_wins() -> None:
    cfg = compose_config(["task=infer"])
    assert cfg.architecture.name is ArchitectureName.ring and cfg.model.name == "smollm2_135m"
    cfg = compose_config(["task=infer", "model=tiny_llama"])
    assert cfg.model.name == "tiny_llama"


def test_every_yaml_opens_with_the_command_that_runs_it() -> None:
    for path in CONF_DIR.rglob("*.yaml"):
        head = path.read_text(encoding="utf-8").splitlines()[:2]
        assert any(line.startswith("# splitlab") for line in head), f"{path} lacks its command line"


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    cfg = compose_config(["task=infer", "model=tiny_llama", "architecture.cuts=[1,3]"])
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.structured(cfg), path)
    again = load_resolved_config(path)
    assert again == cfg


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitlab", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_prints_the_composed_config() -> None:
    result = _cli("--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "architecture:" in result.stdout and "name: u_shape" in result.stdout


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model=nope", "model/nope"),
        ("transport.port=abc", "transport.port"),
        ("transport.prot=1", "transport.prot"),
        ("architecture.owners=two", "architecture.owners"),
    ],
)
def test_cli_refuses_bad_keys_naming_them(override: str, named: str) -> None:
    result = _cli(override, "--cfg", "job")
    assert result.returncode != 0
    assert named in result.stdout + result.stderr


def test_cli_refuses_an_unregistered_name_naming_the_key() -> None:
    # Names are checked against their registry at validation, which `--cfg job` skips.
    result = _cli("transport.name=carrier_pigeon")
    assert result.returncode != 0
    assert "transport.name" in result.stdout + result.stderr


def test_planner_option_round_trips_with_its_own_schema(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    cfg = compose_config(["task=infer", "planner=forced_shift", "planner.at_token=7"])
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.structured(cfg), path)
    again = load_resolved_config(path)
    assert isinstance(again.planner, schema.ForcedShiftPlannerConfig) and again == cfg


def test_logger_group_selects_several_and_round_trips(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    assert compose_config().logger == schema.LoggerConfig(csv=schema.CsvLoggerConfig())
    cfg = compose_config(["logger=[csv,tensorboard,mlflow]", "logger.mlflow.experiment=e1"])
    assert cfg.logger.tensorboard == schema.TensorboardLoggerConfig()
    assert cfg.logger.mlflow is not None and cfg.logger.mlflow.experiment == "e1"
    assert compose_config(["logger=[]"]).logger == schema.LoggerConfig()
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.structured(cfg), path)
    assert load_resolved_config(path) == cfg


def test_cli_refuses_an_unknown_logger_naming_the_known_ones() -> None:
    result = _cli("logger=[csv,wandb]", "--cfg", "job")
    assert result.returncode == 2
    assert "known options of logger: csv, mlflow, tensorboard" in result.stderr


def test_cli_refuses_a_key_of_an_unselected_logger_naming_it() -> None:
    result = _cli("logger.tensorboard.dir=tb", "--cfg", "job")
    assert result.returncode == 2
    assert result.stderr.startswith("config error: logger.tensorboard.dir: ")
    assert "logger=[csv,tensorboard]" in result.stderr
