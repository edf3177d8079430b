"""Registries drive config: names are checked against them and each option says which tasks run it.

.venv/bin/pytest tests/unit/test_registries.py -q
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from splitlab.choices import check_registered
from splitlab.config.schema import ControlConfig, TransportConfig
from splitlab.configure import compose_config
from splitlab.control import bus
from splitlab.drift import profiles
from splitlab.errors import ConfigError
from splitlab.wire import registry
from splitlab.wire.registry import TransportFacts, open_transport, register_transport


@pytest.fixture
def pigeon() -> Iterator[str]:
    register_transport("pigeon", None, tasks=frozenset({"infer"}))
    yield "pigeon"
    registry._TRANSPORTS.pop("pigeon")


def test_a_registered_transport_is_a_config_name_for_its_tasks_only(pigeon: str) -> None:
    cfg = compose_config(["task=infer"])
    cfg.transport.name = pigeon
    check_registered(cfg)
    cfg = compose_config()
    cfg.transport.name = pigeon
    with pytest.raises(ConfigError, match="transport=pigeon is not run by task=finetune"):
        check_registered(cfg)


def test_refusal_lists_what_the_task_does_run() -> None:
    cfg = compose_config(["task=infer"])
    cfg.control.name = "rabbitmq"
    with pytest.raises(ConfigError, match=r"task=infer runs control in \['embedded'\]"):
        check_registered(cfg)


def test_unknown_transport_and_bus_list_the_registered_names() -> None:
    with pytest.raises(ConfigError, match=r"transport.name='x'.*'inproc', 'rabbitmq', 'tcp'"):
        registry.transport_kind("x")
    with pytest.raises(ConfigError, match=r"control.name='x'.*'embedded', 'rabbitmq'"):
        bus.bus_kind("x")


def test_a_registered_drift_profile_is_a_config_name() -> None:
    cfg = compose_config(["task=infer"])
    cfg.drift.name = "solar_flare"
    with pytest.raises(ConfigError, match="drift.name='solar_flare'"):
        check_registered(cfg)
    profiles.register_profile("solar_flare", profiles.PROFILES["steady"])
    try:
        check_registered(cfg)
    finally:
        profiles.PROFILES.pop("solar_flare")


def test_tcp_opens_from_the_transport_config_with_its_queue_bound() -> None:
    cfg = TransportConfig(name="tcp", send_queue_frames=5, pool_bytes=1 << 20, spin_us=30.0)
    facts = TransportFacts(node_id="n0", session="s0", key=os.urandom(32), timeout_s=5.0)
    transport = open_transport(cfg, facts)
    try:
        assert transport.send_queue_frames == 5 and transport.peer_id == "n0"
        assert transport.spin_s == pytest.approx(30e-6)
    finally:
        transport.close()


def test_inproc_is_not_opened_by_a_process() -> None:
    facts = TransportFacts(node_id="n0", session="s0", key=b"k", timeout_s=1.0)
    with pytest.raises(ConfigError, match="transport=inproc is in-process only"):
        open_transport(TransportConfig(name="inproc"), facts)


def test_bus_settings_come_from_the_control_config() -> None:
    cfg = ControlConfig(name="rabbitmq", url="amqp://u:p@h:1/%2F", prefetch=7, heartbeat_s=9)
    assert bus.bus_kind("rabbitmq").settings(cfg) == {
        "url": "amqp://u:p@h:1/%2F", "prefetch": 7, "heartbeat_s": 9,
    }  # fmt: skip
