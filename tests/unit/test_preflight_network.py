"""Pre-spawn network checks that need no socket: what a testbed run can reach.

.venv/bin/pytest tests/unit/test_preflight_network.py -q
"""

from __future__ import annotations

import pytest

from splitlab.configure import compose_config
from splitlab.errors import ConfigError
from splitlab.preflight import check_network


def test_a_testbed_with_the_broker_transport_needs_the_broker_control() -> None:
    cfg = compose_config(["testbed=edge_cloud_wan", "transport=rabbitmq"])
    needs = r"testbed=edge_cloud_wan with transport=rabbitmq needs control=rabbitmq"
    with pytest.raises(ConfigError, match=needs):
        check_network(cfg)
