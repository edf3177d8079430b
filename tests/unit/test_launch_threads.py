"""How the fine-tuning launcher shares a host's cores among its node processes.

.venv/bin/pytest tests/unit/test_launch_threads.py -q
"""

from __future__ import annotations

import pytest

from splitlab.launch.train import role_threads, thread_env


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
