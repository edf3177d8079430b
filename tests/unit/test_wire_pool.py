"""BufferPool: reuse, lazy allocation, eviction on shape change, budget and exhaustion.

.venv/bin/pytest tests/unit/test_wire_pool.py -q
"""

from __future__ import annotations

import threading

import pytest
import torch

from splitlab.wire.errors import PoolExhaustedError
from splitlab.wire.pool import BufferPool

F32_4x4 = (torch.float32, (4, 4))  # 64 bytes
BF16_8 = (torch.bfloat16, (8,))  # 16 bytes


def test_released_buffer_is_reused() -> None:
    pool = BufferPool(pool_bytes=1024)
    first = pool.lease([F32_4x4], timeout_s=0)
    ptr = first.tensors[0].data_ptr()
    first.release()
    second = pool.lease([F32_4x4], timeout_s=0)
    assert second.tensors[0].data_ptr() == ptr
    assert (pool.stats.hits, pool.stats.misses) == (1, 1)


def test_lease_gives_typed_views_of_requested_shape() -> None:
    pool = BufferPool(pool_bytes=1024)
    lease = pool.lease([F32_4x4, BF16_8], timeout_s=0)
    assert [(t.dtype, tuple(t.shape)) for t in lease.tensors] == [F32_4x4, BF16_8]
    assert pool.stats.peak_leases == 1 and pool.stats.leased_bytes == 80


def test_new_shape_evicts_idle_buffers_to_stay_in_budget() -> None:
    pool = BufferPool(pool_bytes=100)
    pool.lease([F32_4x4], timeout_s=0).release()
    lease = pool.lease([(torch.float32, (5, 5))], timeout_s=0)  # 100 bytes: needs the 64 back
    assert pool.stats.evictions == 1 and pool.stats.allocated_bytes == 100
    lease.release()


def test_exhaustion_times_out_with_clear_error() -> None:
    pool = BufferPool(pool_bytes=64, name="act")
    held = pool.lease([F32_4x4], timeout_s=0)
    with pytest.raises(PoolExhaustedError, match="act.*pool_bytes=64"):
        pool.lease([F32_4x4], timeout_s=0.05)
    assert pool.stats.allocated_bytes == 64
    held.release()


def test_waiting_lease_proceeds_when_another_is_released() -> None:
    pool = BufferPool(pool_bytes=64)
    held = pool.lease([F32_4x4], timeout_s=0)
    timer = threading.Timer(0.05, held.release)
    timer.start()
    pool.lease([F32_4x4], timeout_s=5).release()
    timer.join()


def test_request_larger_than_budget_fails_at_once() -> None:
    pool = BufferPool(pool_bytes=10)
    with pytest.raises(PoolExhaustedError):
        pool.lease([F32_4x4], timeout_s=60)


def test_release_is_idempotent_and_runs_hooks_once() -> None:
    pool = BufferPool(pool_bytes=64)
    calls: list[int] = []
    lease = pool.lease([F32_4x4], timeout_s=0)
    lease.on_release(lambda: calls.append(1))
    lease.release()
    lease.release()
    assert calls == [1] and pool.stats.leases_out == 0
