"""How the fine-tuning launcher shares a host's cores among its node processes, which secrets
each node gets, and what the launchers import before their nodes start.

.venv/bin/pytest tests/unit/test_launch_threads.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from splitlab.launch.threads import role_threads, stage_threads, thread_env
from splitlab.launch.train import WarmImports, node_secrets


@pytest.mark.parametrize(
    ("owners", "workers", "cores", "owner", "worker"),
    [(2, 1, 2, 1, 2), (2, 1, 16, 5, 16), (4, 2, 16, 2, 8), (8, 2, 2, 1, 1), (2, 0, 4, 2, 4)],
)
def test_workers_share_every_core_and_owners_their_part(
    owners: int, workers: int, cores: int, owner: int, worker: int
) -> None:
    threads = role_threads(owners=owners, workers=workers, cores=cores)
    assert threads == {"coordinator": owner, "owner": owner, "worker": worker}


def test_a_users_omp_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert thread_env(2) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE",
                             "GOMP_SPINCOUNT": "20000"}  # fmt: skip
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert thread_env(2) == {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"}
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert thread_env(2)["GOMP_SPINCOUNT"] == "5"


@pytest.mark.parametrize(
    ("stages", "cores", "threads"), [(3, 2, 1), (3, 16, 5), (2, 2, 1), (1, 2, 2), (4, 1, 1)]
)
def test_ring_stages_share_the_hosts_cores(stages: int, cores: int, threads: int) -> None:
    assert stage_threads(stages=stages, cores=cores) == threads


def test_each_local_stage_gets_its_share_unless_the_user_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from splitlab.launch.ring import stage_children

    for var in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    children = stage_children(tmp_path / "config.yaml", 3, run_dir=tmp_path, session="s",
                              key_hex="ab" * 32)  # fmt: skip
    assert {c.env["OMP_NUM_THREADS"] for c in children} == {"5"}
    assert all(c.env["GOMP_SPINCOUNT"] == "20000" for c in children)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    children = stage_children(tmp_path / "config.yaml", 3, run_dir=tmp_path, session="s",
                              key_hex="ab" * 32)  # fmt: skip
    assert {c.env["OMP_NUM_THREADS"] for c in children} == {"3"}


def test_the_launchers_start_nodes_without_importing_torch_or_pandas() -> None:
    """Importing them took ~4.6 s of one core before the first node started (the main job's
    nodes were up 3.4 s later); they load while the nodes train (`WarmImports`). The ring
    launcher imported torch (~1.3 s) for a file name, and every launcher pandas (~0.25 s) through
    its loggers (`loggers.points` -> `analysis.rounds` -> `analysis.traces`)."""
    code = (
        "import sys, splitlab.cli, splitlab.launch.train, splitlab.launch.ring\n"
        "import splitlab.loggers.write, splitlab.loggers.points\n"
        "heavy = sorted({'torch', 'transformers', 'pandas', 'matplotlib'} & set(sys.modules))\n"
        "sys.exit(f'imported {heavy}' if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_warm_imports_loads_its_modules_and_survives_a_broken_one() -> None:
    assert "wave" not in sys.modules
    warm = WarmImports(("splitlab.no_such_module", "wave"))
    warm.join()  # not started: returns at once
    warm.start()
    warm.join()
    assert not warm.thread.is_alive()
    assert "wave" in sys.modules


def test_each_node_gets_its_own_secrets_and_not_the_session_key(tmp_path: Path) -> None:
    from splitlab.configure import compose_config
    from splitlab.launch.train import node_children
    from splitlab.wire.session_key import (
        DATA_KEY_ENV,
        NODE_KEY_ENV,
        SESSION_KEY_ENV,
        data_plane_key,
        node_key,
    )

    key = bytes(range(32))
    cfg = compose_config(["model=tiny_bert"])
    children = node_children(cfg, tmp_path / "config.yaml", run_dir=tmp_path, session="ft-1",
                             control=("127.0.0.1", 1), env={SESSION_KEY_ENV: key.hex(), "A": "1"})  # fmt: skip
    assert {c.name for c in children} == {"coordinator", "worker0", "owner0", "owner1"}
    for child in children:
        assert SESSION_KEY_ENV not in child.env and child.env["A"] == "1"
        assert child.env[NODE_KEY_ENV] == node_key(child.name, key).hex()
        assert child.env[DATA_KEY_ENV] == data_plane_key("ft-1", key).hex()
    # the node hosting the bus (the coordinator on a testbed) derives every credential
    assert node_secrets({SESSION_KEY_ENV: "ab"}, "ft-1", "coordinator", hosts_bus=True) == {
        SESSION_KEY_ENV: "ab"
    }
