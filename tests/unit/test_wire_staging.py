"""CUDA staging: pinned probe and its fallback on CPU; device round trip where a GPU exists.

.venv/bin/pytest tests/unit/test_wire_staging.py -q
"""

from __future__ import annotations

import pytest
import torch

from splitlab.errors import ConfigError
from splitlab.wire.pool import BufferPool
from splitlab.wire.staging import Pinned, Stager, pinned_available, resolve_pinned

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_auto_falls_back_to_pageable_without_cuda() -> None:
    assert resolve_pinned(Pinned.AUTO) == pinned_available()
    assert resolve_pinned("off") is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_forcing_pinned_on_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="pinned=on"):
        resolve_pinned(Pinned.ON)


def test_cpu_tensors_pass_through_untouched() -> None:
    x = torch.arange(4)
    out, wait, lease = Stager(pinned="off").to_host({"x": x}, timeout_s=1)
    assert out["x"] is x and wait is None and lease is None


@pytest.mark.gpu
@needs_gpu
def test_device_round_trip_through_staging_is_bit_exact() -> None:
    stager = Stager(pinned="auto")
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16).t()
    host, wait, staging = stager.to_host({"x": x}, timeout_s=5)
    assert wait is not None and staging is not None
    wait()
    pool = BufferPool(pool_bytes=1 << 20, pin_memory=stager.pinned)
    lease = pool.lease([(host["x"].dtype, tuple(host["x"].shape))], timeout_s=1)
    lease.tensors[0].copy_(host["x"])
    staging.release()
    back = stager.to_device({"x": lease.tensors[0]}, lease, "cuda")
    lease.release()  # waits for the host-to-device copy first
    assert torch.equal(back["x"].view(torch.int16), x.contiguous().view(torch.int16))
