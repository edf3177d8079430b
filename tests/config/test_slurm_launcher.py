"""The Slurm launcher preset: per-job resources resolve from each job's own config.

pytest tests/config/test_slurm_launcher.py -q
"""

from __future__ import annotations

import importlib.util

import hydra
import pytest
from omegaconf import OmegaConf

from splitlab.cli import register_resolvers
from splitlab.config.load import CONF_DIR, register_configs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="hydra-submitit-launcher is not installed (the `cluster` extra)",
)


def launcher(*overrides: str) -> dict:
    register_configs()
    register_resolvers()
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config", overrides=["hydra/launcher=slurm", *overrides],
                            return_hydra_config=True)  # fmt: skip
        return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


@pytest.mark.parametrize(
    ("overrides", "cpus"),
    [
        ((), 4),  # coordinator, 1 worker, 2 owners
        (("architecture.owners=4", "architecture.workers=2"), 7),
        (("+sweep=ring_cuts", "architecture.cuts=[1,2,3]"), 4),
        (("task=infer", "architecture.stages=2"), 2),
    ],
)
def test_cpus_follow_the_runs_process_count(overrides: tuple[str, ...], cpus: int) -> None:
    assert launcher(*overrides)["cpus_per_task"] == cpus


def test_gpus_follow_the_device() -> None:
    assert launcher()["gpus_per_node"] == 0
    assert launcher("device=cuda:1")["gpus_per_node"] == 2


def test_the_preset_targets_splitlabs_launcher_with_settable_limits() -> None:
    params = launcher("hydra.launcher.timeout_min=5", "hydra.launcher.partition=gpu")
    assert params["_target_"].endswith("splitlab_slurm.slurm_launcher.SplitlabSlurmLauncher")
    assert (params["timeout_min"], params["partition"], params["name"]) == (
        5,
        "gpu",
        "splitlab-finetune",
    )
