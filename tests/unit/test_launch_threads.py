"""How the fine-tuning launcher shares a host's cores among its node processes, and what the
launchers import before their nodes start.

.venv/bin/pytest tests/unit/test_launch_threads.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitlab.launch.train import WarmImports, role_threads, thread_env


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
    assert thread_env(2) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert thread_env(2) == {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"}


def test_the_launchers_start_nodes_without_importing_torch_or_pandas() -> None:
    """Importing them took ~4.6 s of one core before the first node started (the main job's
    nodes were up 3.4 s later); they load while the nodes train (`WarmImports`). The ring
    launcher imported torch (~1.3 s) for a file name."""
    code = (
        "import sys, splitlab.cli, splitlab.launch.train, splitlab.launch.ring\n"
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
