"""Every experiment preset composes and validates, opens with its command, and changes only what
it names; a multirun over `experiment=glob(debug*)` runs the debug preset end to end; every
sweep grid composes.

.venv/bin/pytest tests/config/test_experiments.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from splitlab.configure import compose_config

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
SWEEPS = sorted(p.stem for p in (REPO / "conf" / "sweep").glob("*.yaml"))


def test_there_is_a_debug_preset_and_a_readme_row_per_preset() -> None:
    assert "debug" in PRESETS
    readme = (REPO / "experiments" / "README.md").read_text(encoding="utf-8")
    for name in PRESETS:
        assert f"experiment={name}" in readme, name
        assert (REPO / "experiments" / f"{name}.sh").is_file(), name


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_and_validates(name: str) -> None:
    cfg = compose_config([f"experiment={name}"])
    assert cfg.task.name.value in ("infer", "finetune", "calibrate", "analyze")


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_global_and_opens_with_its_command(name: str) -> None:
    lines = (REPO / "conf" / "experiment" / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_"
    assert lines[1].startswith(f"# splitlab experiment={name}")
    body = yaml.safe_load("\n".join(lines))
    assert all(str(d).startswith("{'override /") for d in body.get("defaults", []))


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_grid_composes_and_opens_with_its_command(name: str) -> None:
    text = (REPO / "conf" / "sweep" / f"{name}.yaml").read_text()
    assert text.splitlines()[1].startswith(f"# splitlab -m +sweep={name}")
    compose_config([f"+sweep={name}"])


@pytest.mark.slow
def test_multirun_over_debug_presets_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "splitlab", "-m", "experiment=glob(debug*)",
         f"hydra.sweep.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "0" / "traces" / "stage-0.jsonl").is_file()
