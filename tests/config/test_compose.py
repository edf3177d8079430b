"""Every option of every config group composes, converts to dataclasses and validates.

pytest tests/config -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from splitlab.cli import CONF_DIR, compose_config, load_resolved_config
from splitlab.config import schema
from splitlab.config.enums import ArchitectureName, Family, TaskName

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
]

# Options that only make sense with a different companion choice.
COMPANIONS: dict[tuple[str, str], list[str]] = {
    ("architecture", "ring"): ["task=infer"],
    ("task", "analyze"): ["task.run_dir=/tmp/some-run"],
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
    assert cfg.model.name == "minilm" and cfg.model.family is Family.bert
    assert isinstance(cfg.architecture, schema.UShapeConfig)
    assert (cfg.architecture.owners, cfg.architecture.workers) == (2, 1)
    assert cfg.transport.name.value == "tcp" and cfg.control.name.value == "embedded"
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
        ("transport.name=carrier_pigeon", "transport.name"),
    ],
)
def test_cli_refuses_bad_keys_naming_them(override: str, named: str) -> None:
    result = _cli(override, "--cfg", "job")
    assert result.returncode != 0
    assert named in result.stdout + result.stderr
