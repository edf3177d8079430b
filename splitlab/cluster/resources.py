"""What one run asks of a cluster scheduler: its process count and GPUs, from its config.

    splitlab -m hydra/launcher=slurm +sweep=ring_cuts      (conf/hydra/launcher/slurm.yaml)
    .venv/bin/pytest tests/unit/test_cluster_resources.py -q

`conf/hydra/launcher/slurm.yaml` reads these through the `splitlab.num_processes` and
`splitlab.num_gpus` resolvers (registered in `splitlab.cli`), so each job of a sweep asks for
as many CPUs as its own config starts processes.
"""

from __future__ import annotations

from splitlab.config.schema import RingConfig, TwoStageConfig, UShapeConfig
from splitlab.errors import ConfigError

SFT_STUDY_CPUS = 2  # task=sft_rank: one process, its owner and worker threads


def num_processes(architecture: object, task: str | None = None) -> int:
    """Processes one run starts: a ring's stages; a coordinator, the workers and the owners;
    for `task=sft_rank` (one process training owner and worker in two threads) the cores those
    threads keep busy."""
    if task == "sft_rank":
        return SFT_STUDY_CPUS
    if isinstance(architecture, RingConfig):
        return len(architecture.cuts) + 1 if architecture.cuts else architecture.stages
    if isinstance(architecture, UShapeConfig | TwoStageConfig):
        return 1 + architecture.workers + architecture.owners
    raise ConfigError(f"architecture={architecture!r}: no process count for this architecture")


def num_gpus(device: str) -> int:
    """GPUs a job needs on its node for `device`: none for cpu, N + 1 for cuda:N.

    Slurm renumbers the GPUs it grants from 0, so `cuda:N` needs N + 1 of them to exist.
    """
    if device == "cpu":
        return 0
    if device == "cuda":
        return 1
    kind, _, index = device.partition(":")
    if kind == "cuda" and index.isdigit():
        return int(index) + 1
    raise ConfigError(f"device={device!r}: expected cpu, cuda or cuda:N")
