"""Shared test policy: markers that skip (or fail) by what the machine offers.

- `rabbitmq`: needs a broker on 127.0.0.1:5672; fails instead of skipping when
  SPLITLAB_REQUIRE_BROKER=1 (CI), so a missing broker can never pass silently.
- `gpu`: skips cleanly without CUDA.
- `assets`: runs (fetching into the cache once) unless SPLITLAB_SKIP_ASSETS=1.
"""

from __future__ import annotations

import os
import socket

import pytest

BROKER_HOST, BROKER_PORT = "127.0.0.1", 5672


def broker_reachable(
    host: str = BROKER_HOST, port: int = BROKER_PORT, timeout_s: float = 1.0
) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("rabbitmq") and not broker_reachable():
        message = f"RabbitMQ is not answering on {BROKER_HOST}:{BROKER_PORT}"
        if os.environ.get("SPLITLAB_REQUIRE_BROKER") == "1":
            pytest.fail(message + " and SPLITLAB_REQUIRE_BROKER=1", pytrace=False)
        pytest.skip(message)
    if item.get_closest_marker("gpu"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device on this machine")
    if item.get_closest_marker("assets") and os.environ.get("SPLITLAB_SKIP_ASSETS") == "1":
        pytest.skip("SPLITLAB_SKIP_ASSETS=1")
