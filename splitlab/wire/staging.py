"""Host staging of CUDA tensors for the wire: pinned buffers, copy streams and events.

Send side: `to_host` records an event on the producer's stream, makes a copy stream wait on it
and starts the device-to-host copies there into staging buffers (pinned when available), then
returns a `wait` callable; only the sender thread calls it, so compute never blocks on the copy.
Receive side: `to_device` copies pooled host buffers to the device on a receive stream and makes
the caller's current stream wait on it; the receive lease waits for the copy before its buffers
are reused. On a machine without CUDA, CPU tensors pass straight through.

    .venv/bin/pytest tests/unit/test_wire_staging.py -q
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from enum import StrEnum

import torch

from splitlab.errors import ConfigError
from splitlab.wire.counters import WireCounters
from splitlab.wire.pool import BufferPool, Lease

_PINNED_PROBE: bool | None = None


class Pinned(StrEnum):
    AUTO = "auto"  # probe pinned allocation; fall back to pageable memory
    ON = "on"
    OFF = "off"


def pinned_available() -> bool:
    """Whether page-locked host memory can be allocated here (probed once)."""
    global _PINNED_PROBE
    if _PINNED_PROBE is None:
        _PINNED_PROBE = False
        if torch.cuda.is_available():
            try:
                _PINNED_PROBE = bool(torch.empty(1, pin_memory=True).is_pinned())
            except RuntimeError:
                _PINNED_PROBE = False
    return _PINNED_PROBE


def resolve_pinned(mode: Pinned | str) -> bool:
    mode = Pinned(mode)
    if mode is Pinned.OFF:
        return False
    if mode is Pinned.ON and not pinned_available():
        raise ConfigError("transport pinned=on but pinned host memory is unavailable (no CUDA?)")
    return pinned_available()


class Stager:
    """Moves tensors between CUDA devices and host staging buffers (see module docstring)."""

    def __init__(self, *, pinned: Pinned | str = Pinned.AUTO, pool_bytes: int = 256 << 20,
                 counters: WireCounters | None = None) -> None:  # fmt: skip
        self.pinned = resolve_pinned(pinned)
        self.counters = counters or WireCounters()
        self._pool_bytes = pool_bytes
        self._send_pool: BufferPool | None = None
        self._streams: dict[tuple[str, int], torch.cuda.Stream] = {}

    @property
    def send_pool(self) -> BufferPool:
        if self._send_pool is None:
            self._send_pool = BufferPool(
                pool_bytes=self._pool_bytes, name="d2h", pin_memory=self.pinned
            )
        return self._send_pool

    def _stream(self, role: str, device: torch.device) -> torch.cuda.Stream:
        key = (role, device.index or 0)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=device)
        return self._streams[key]

    def to_host(
        self, tensors: Mapping[str, torch.Tensor], *, timeout_s: float
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None] | None, Lease | None]:
        """Host tensors, a wait that blocks until their copies finished, and the staging lease."""
        cuda = {k: t for k, t in tensors.items() if t.device.type == "cuda"}
        if not cuda:
            return dict(tensors), None, None
        keys = [(t.dtype, tuple(t.shape)) for t in cuda.values()]
        lease = self.send_pool.lease(keys, timeout_s=timeout_s)
        out = dict(tensors)
        start = time.perf_counter()
        done: list[torch.cuda.Event] = []
        for (name, t), host in zip(cuda.items(), lease.tensors, strict=True):
            stream = self._stream("d2h", t.device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                host.copy_(t.detach(), non_blocking=self.pinned)
                t.record_stream(stream)  # keep the source alive until the copy ran
                event = torch.cuda.Event()
                event.record(stream)
                done.append(event)
            out[name] = host

        def wait() -> None:
            for event in done:
                event.synchronize()
            self.counters.add("d2h_ms", (time.perf_counter() - start) * 1e3)

        return out, wait, lease

    def to_device(self, tensors: Mapping[str, torch.Tensor], lease: Lease,
                  device: torch.device | str) -> dict[str, torch.Tensor]:  # fmt: skip
        """Copy received host tensors to `device`; the current stream waits for the copies."""
        device = torch.device(device)
        if device.type != "cuda":
            return {k: t.to(device) for k, t in tensors.items()}
        start = time.perf_counter()
        stream = self._stream("h2d", device)
        compute = torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            out = {k: t.to(device, non_blocking=True) for k, t in tensors.items()}
            event = torch.cuda.Event()
            event.record(stream)
        compute.wait_event(event)
        for t in out.values():
            t.record_stream(compute)
        lease.on_release(event.synchronize)  # the host buffers are read until the copy ends
        self.counters.add("h2d_ms", (time.perf_counter() - start) * 1e3)
        return out
