"""What one run asks of Slurm: processes per architecture, GPUs per device.

.venv/bin/pytest tests/unit/test_cluster_resources.py -q
"""

from __future__ import annotations

import pytest

from splitlab.cluster.resources import num_gpus, num_processes
from splitlab.config.schema import RingConfig, TwoStageConfig, UShapeConfig
from splitlab.errors import ConfigError


@pytest.mark.parametrize(
    ("architecture", "expected"),
    [
        (RingConfig(cuts=[1, 2, 3]), 4),
        (RingConfig(cuts=[], stages=5), 5),
        (UShapeConfig(owners=2, workers=1), 4),
        (UShapeConfig(owners=4, workers=2), 7),
        (TwoStageConfig(owners=1, workers=1), 3),
    ],
)
def test_num_processes_counts_every_process_of_the_run(architecture, expected: int) -> None:
    assert num_processes(architecture) == expected


def test_the_sft_study_asks_for_its_two_threads_whatever_the_architecture() -> None:
    assert num_processes(UShapeConfig(owners=4, workers=2), "sft_rank") == 2
    assert num_processes(UShapeConfig(owners=4, workers=2), "finetune") == 7


def test_num_processes_names_an_unknown_architecture() -> None:
    with pytest.raises(ConfigError, match="architecture="):
        num_processes({"name": "mesh"})


@pytest.mark.parametrize(
    ("device", "gpus"), [("cpu", 0), ("cuda", 1), ("cuda:0", 1), ("cuda:3", 4)]
)
def test_num_gpus_per_device(device: str, gpus: int) -> None:
    assert num_gpus(device) == gpus


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "mps"])
def test_num_gpus_names_a_bad_device(device: str) -> None:
    with pytest.raises(ConfigError, match=f"device={device!r}"):
        num_gpus(device)
