"""The ring's topology from the config: every stage's blocks and address, the same on every host.

`resolve_ring` fills what `architecture=ring` leaves to defaults (equal cuts from
`architecture.stages`, loopback addresses) and checks the rest, so the launcher and a stage
started by hand from the same config agree without passing copies around. Pure: no sockets.

    .venv/bin/pytest tests/unit/test_infer_launch.py -q
"""

from __future__ import annotations

import dataclasses

from splitlab.config.schema import Config, RingConfig
from splitlab.errors import ConfigError
from splitlab.models.plan import even_cuts

LOOPBACK = "127.0.0.1"


def resolve_ring(cfg: Config) -> RingConfig:
    """A copy of `cfg.architecture` with `cuts` and `peer_hosts` filled in and checked.

    Raises:
        ConfigError: not `architecture=ring`, or `architecture.peer_hosts` does not list one
            address per stage.
    """
    ring = cfg.architecture
    if not isinstance(ring, RingConfig):
        raise ConfigError(f"task=infer needs architecture=ring, got {ring.name.value}")
    cuts = list(ring.cuts) or even_cuts(num_layers=cfg.model.num_layers, stages=ring.stages)
    hosts = list(ring.peer_hosts) or [LOOPBACK] * (len(cuts) + 1)
    if len(hosts) != len(cuts) + 1:
        raise ConfigError(
            f"architecture.peer_hosts={hosts}: {len(hosts)} addresses for {len(cuts) + 1} stages"
        )
    return dataclasses.replace(ring, cuts=cuts, peer_hosts=hosts, stages=len(cuts) + 1)
