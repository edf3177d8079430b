"""Hydra's compose errors exit 2 with one line naming the key; `--help` lists every group and
option of conf/ with a one-liner and hides the internal schema groups.

pytest tests/config/test_cli_errors.py -q
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from splitlab.cli import CONF_DIR
from splitlab.config.help import GROUP_HELP, config_groups, option_help
from splitlab.config.load import closest_first
from splitlab.configure import compose_config
from splitlab.errors import ConfigError, ExitCode

MODEL_OPTIONS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def _cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _splitlab(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """The finished command and the CPU seconds it took: on a shared 2-core box the wall clock
    measures the neighbours (12.7 s of wall at load 17-19 for a refusal that takes ~4 s)."""
    cpu_before = _cpu_s()
    done = subprocess.run([sys.executable, "-m", "splitlab", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    return done, _cpu_s() - cpu_before


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("transport.prot=1", ["transport.prot", "known keys of transport, closest first: port,"]),
        # Hydra's own hint for the line above: it appended the key, which then ran silently
        ("+transport.prot=1", ["transport.prot", "known keys of transport, closest first: port,"]),
        ("model=nope", ["model=nope", "known options of model: " + ", ".join(MODEL_OPTIONS)]),
        ("transport.port=abc", ["transport.port", "'abc'"]),
    ],
)
def test_compose_error_exits_2_naming_the_key(
    override: str, named: list[str], tmp_path: Path
) -> None:
    # Prepare: a run folder that only a started job would create
    run_dir = tmp_path / "run"

    # Execute
    done, cpu_s = _splitlab(override, f"hydra.run.dir={run_dir}", cwd=tmp_path)

    # Assert: exit 2 within 10 s of CPU, one line naming the key, no hint, no run folder
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert cpu_s < 10.0, f"took {cpu_s:.1f} s of CPU"
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("config error: ")
    for text in named:
        assert text in lines[0], lines[0]
    assert "+transport" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr
    assert not run_dir.exists()
    assert not (tmp_path / "outputs").exists()


def test_help_lists_every_group_and_option_with_a_line(tmp_path: Path) -> None:
    done, _ = _splitlab("--help", cwd=tmp_path)

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    groups = config_groups(CONF_DIR)
    assert {"task", "model", "experiment", "sweep", "hydra/launcher"} <= set(groups)
    for group, options in groups.items():
        header = [ln for ln in lines if ln.startswith(f"{group}: ")]
        assert header and header[0][len(group) + 2 :].strip(), f"group {group} has no line"
        for option in options:
            row = [ln.split(None, 1) for ln in lines if ln.startswith("    ")]
            texts = [parts[1].strip() for parts in row if parts[0] == option and len(parts) == 2]
            assert texts, f"{group}={option} has no non-empty line in --help"
    assert "schema" not in done.stdout


def test_every_option_yaml_has_a_one_liner() -> None:
    for group, options in config_groups(CONF_DIR).items():
        assert GROUP_HELP.get(group), f"GROUP_HELP has no line for conf/{group}/"
        for option, text in options.items():
            assert text, f"conf/{group}/{option}.yaml: first command line ends in no '(...)'"


def test_option_help_reads_the_first_command_lines_parenthesis() -> None:
    text = "# @package _global_\n# splitlab x=y   (what (it) does)\n# later (not this)\n"
    assert option_help(text) == "what (it) does"
    assert option_help("# splitlab x=y\n# (not this)\n") == ""
    assert option_help("a: 1\n") == ""


def test_closest_first_puts_close_matches_ahead_in_order() -> None:
    known = ["name", "bind_host", "port", "pool_bytes", "url"]
    assert closest_first("prot", known) == ["port", "name", "bind_host", "pool_bytes", "url"]
    assert closest_first("zzz", known) == known


def test_a_key_appended_to_a_schema_is_refused_where_it_is_composed() -> None:
    with pytest.raises(ConfigError, match=r"^architecture.cut_layer: .*closest first: cut_layers,"):
        compose_config(["+architecture.cut_layer=2"])
