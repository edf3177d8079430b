"""Shared test policy: markers that skip (or fail) by what the machine offers.

- `rabbitmq`: needs a broker on 127.0.0.1:5672; fails instead of skipping when
  SPLITLAB_REQUIRE_BROKER=1 (CI), so a missing broker can never pass silently.
- `slurm`: needs the local Slurm cluster (`tools/slurm_local.sh up`); fails instead of skipping
  when SPLITLAB_REQUIRE_SLURM=1 (CI). SLURM_CONF defaults to that cluster's config.
- `gpu`: skips cleanly without CUDA.
- `assets`: runs (fetching into the cache once) unless SPLITLAB_SKIP_ASSETS=1.
- `testbed`: needs root (namespaces, shaping, cgroups), iproute2 and ethtool; skips without
  them, fails instead under SPLITLAB_REQUIRE_TESTBED=1 (CI runs as root).
- `chromium`: needs a headless Chromium (Debian's `chromium`); skips without it, fails instead
  under SPLITLAB_REQUIRE_CHROMIUM=1 (CI installs it).

Tests run on 2 pytest-xdist workers (`-n auto`, `--dist loadgroup` in pyproject.toml;
SPLITLAB_TEST_WORKERS sets the count, `-n 0` runs in one process). A test file runs whole on
one worker, so its module fixtures run once; every `testbed` test shares one worker (their
hosts, links and cgroups are root's, one testbed at a time) and so does every `slurm` test
(one takes the cluster down and up). Much of the suite waits (a Slurm job's time limit, a
peer's timeout, a shaped link), which the other worker fills.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

BROKER_HOST, BROKER_PORT = "127.0.0.1", 5672
SLURM_DIR = Path(os.environ.get("SPLITLAB_SLURM_DIR", "/var/tmp/splitlab-slurm"))
if (SLURM_DIR / "etc" / "slurm.conf").is_file():
    os.environ.setdefault("SLURM_CONF", str(SLURM_DIR / "etc" / "slurm.conf"))


def broker_reachable(
    host: str = BROKER_HOST, port: int = BROKER_PORT, timeout_s: float = 1.0
) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_binary() -> str | None:
    """The first headless-capable Chromium on PATH, or None."""
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


@pytest.fixture
def chromium() -> str:
    """The Chromium binary for a test marked `chromium` (the marker skips or fails without one)."""
    path = chromium_binary()
    assert path is not None, "mark the test `chromium`"
    return path


@functools.cache
def slurm_problem() -> str | None:
    """Why the Slurm tests cannot run here, or None when a node takes jobs."""
    if shutil.which("sbatch") is None or shutil.which("sacct") is None:
        return "Slurm's client commands (sbatch, sacct) are not installed"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                              timeout=15, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 15 s"
    if not any(s.rstrip("*~#") in ("idle", "mix", "alloc") for s in done.stdout.split()):
        return f"no Slurm node takes jobs (sinfo: {(done.stdout + done.stderr).strip()[:200]!r})"
    return None


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: SPLITLAB_TEST_WORKERS, else 2 (1 on one core): the suite's processes already
    use several cores each, so more workers would only crowd them."""
    wanted = os.environ.get("SPLITLAB_TEST_WORKERS")
    if wanted is not None:
        if not wanted.isdigit():
            raise pytest.UsageError(f"SPLITLAB_TEST_WORKERS must be a whole number, got {wanted!r}")
        return int(wanted)
    return min(2, os.cpu_count() or 1)


EXCLUSIVE = ("testbed", "slurm")  # markers whose tests share one machine-wide resource


@pytest.hookimpl(tryfirst=True)  # before xdist's worker turns the groups into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group each test for `--dist loadgroup`: its marker's group if it needs an exclusive
    resource, else its file. On an xdist worker, also order the groups (`--no-loadscope-reorder`
    keeps the order): `slurm` first, the longest (a job's time limit), so it is not the run's
    tail; then by their count of `slow` tests, with `testbed` third. xdist hands the first two
    groups out at the start and the next to the first worker nearly done, which is most often
    the Slurm one: the testbed's rates and timings then do not share the cores with the Slurm
    sweeps' processes, and its ~2.5 minutes are not the run's tail (last, they were)."""
    groups: dict[str, str] = {}
    for item in items:
        if (mark := item.get_closest_marker("xdist_group")) is None:
            exclusive = next((m for m in EXCLUSIVE if item.get_closest_marker(m)), None)
            decorator = pytest.mark.xdist_group(exclusive or item.nodeid.split("::")[0])
            item.add_marker(decorator)
            mark = decorator.mark
        groups[item.nodeid] = str(mark.args[0] if mark.args else mark.kwargs.get("name"))
    if hasattr(config, "workerinput"):
        slow: dict[str, int] = {}
        for item in items:
            slow[groups[item.nodeid]] = slow.get(groups[item.nodeid], 0) + bool(
                item.get_closest_marker("slow")
            )
        order = sorted(slow, key=lambda g: (g != "slurm", g == "testbed", -slow[g]))
        if "testbed" in slow:
            order.remove("testbed")
            order.insert(min(2, len(order)), "testbed")
        rank = {g: i for i, g in enumerate(order)}
        items.sort(key=lambda item: rank[groups[item.nodeid]])  # stable: file order kept


def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """Under `--dist loadgroup` every node id a worker collected must carry its group: if a
    pytest or xdist upgrade stops that, the slurm and testbed tests would run side by side."""
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid]
    if node.config.getvalue("dist") == "loadgroup" and ungrouped:
        raise pytest.UsageError(
            f"--dist loadgroup did not group {ungrouped[0]}: pytest-xdist names a group through "
            "Item._nodeid, which pytest 9.2 no longer reads (keep pytest<9.2, pyproject.toml)"
        )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("rabbitmq") and not broker_reachable():
        message = f"RabbitMQ is not answering on {BROKER_HOST}:{BROKER_PORT}"
        if os.environ.get("SPLITLAB_REQUIRE_BROKER") == "1":
            pytest.fail(message + " and SPLITLAB_REQUIRE_BROKER=1", pytrace=False)
        pytest.skip(message)
    if item.get_closest_marker("slurm") and (problem := slurm_problem()) is not None:
        message = f"{problem} (tools/slurm_local.sh up starts a local cluster)"
        if os.environ.get("SPLITLAB_REQUIRE_SLURM") == "1":
            pytest.fail(message + " and SPLITLAB_REQUIRE_SLURM=1", pytrace=False)
        pytest.skip(message)
    if item.get_closest_marker("chromium") and chromium_binary() is None:
        message = f"no headless Chromium on PATH (any of {', '.join(CHROMIUM_NAMES)})"
        if os.environ.get("SPLITLAB_REQUIRE_CHROMIUM") == "1":
            pytest.fail(message + " and SPLITLAB_REQUIRE_CHROMIUM=1", pytrace=False)
        pytest.skip(message)
    if item.get_closest_marker("gpu"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device on this machine")
    if item.get_closest_marker("assets") and os.environ.get("SPLITLAB_SKIP_ASSETS") == "1":
        pytest.skip("SPLITLAB_SKIP_ASSETS=1")
    if item.get_closest_marker("testbed"):
        from splitlab.testbed.netns import missing_privileges

        missing = missing_privileges()
        if missing:
            message = "a testbed needs " + "; ".join(missing)
            if os.environ.get("SPLITLAB_REQUIRE_TESTBED") == "1":
                pytest.fail(message + " and SPLITLAB_REQUIRE_TESTBED=1", pytrace=False)
            pytest.skip(message)
