"""Bounded pools of reusable receive buffers, keyed by (dtype, shape).

A reader leases one buffer per tensor of a frame, `recv_into`s the raw bytes and hands the typed
views to the user inside a `Lease`; releasing the lease puts the buffers back. Buffers are made
lazily on a miss; when a new shape would push the pool over `pool_bytes`, idle buffers of other
shapes are evicted (least recently used first); when every byte is leased out, the reader waits
for a release up to `timeout_s` and then raises `PoolExhaustedError` instead of growing.

    .venv/bin/pytest tests/unit/test_wire_pool.py -q
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitlab.wire.errors import PoolExhaustedError

Key = tuple[torch.dtype, tuple[int, ...]]


def nbytes_of(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


class Buffer:
    """One reusable allocation: raw bytes, a memoryview for `recv_into`, and the typed view."""

    __slots__ = ("key", "nbytes", "raw", "view", "tensor")

    def __init__(self, key: Key, *, pin_memory: bool = False) -> None:
        dtype, shape = key
        self.key = key
        self.nbytes = nbytes_of(dtype, shape)
        self.raw = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.view = memoryview(self.raw.numpy()) if self.nbytes else memoryview(b"")
        self.tensor = self.raw.view(dtype).view(shape)


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    allocated_bytes: int = 0
    leased_bytes: int = 0
    leases_out: int = 0
    peak_leases: int = 0
    peak_leased_bytes: int = 0
    exhausted: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Lease:
    """Buffers lent for one message; `release()` (idempotent) returns them to their pool."""

    __slots__ = ("buffers", "_pool", "_released", "_before_release")

    def __init__(self, buffers: list[Buffer], _pool: BufferPool | None = None) -> None:
        self.buffers = buffers
        self._pool = _pool
        self._released = False
        self._before_release: list[Callable[[], None]] | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [b.tensor for b in self.buffers]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def on_release(self, hook: Callable[[], None]) -> None:
        """Run `hook` first on release (e.g. wait for a host-to-device copy to finish)."""
        if self._before_release is None:
            self._before_release = []
        self._before_release.append(hook)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._before_release is not None:
            for hook in self._before_release:
                hook()
        if self._pool is not None:
            self._pool._give_back(self.buffers)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def unpooled_lease(keys: Sequence[Key]) -> Lease:
    """Fresh buffers owned by the caller; releasing does nothing."""
    return Lease([Buffer(k) for k in keys])


class BufferPool:
    """Reusable receive buffers under a byte budget (see module docstring)."""

    def __init__(self, *, pool_bytes: int, name: str = "pool", pin_memory: bool = False) -> None:
        if pool_bytes <= 0:
            raise ValueError(f"pool_bytes must be positive, got {pool_bytes}")
        self.pool_bytes, self.name, self.pin_memory = pool_bytes, name, pin_memory
        self.stats = PoolStats()
        self._free: OrderedDict[Key, list[Buffer]] = OrderedDict()  # LRU order: oldest first
        self._cond = threading.Condition()
        self._waiting = 0  # leases blocked on a release (a release wakes them only if any)

    def lease(self, keys: Sequence[Key], *, timeout_s: float) -> Lease:
        """Lend one buffer per key; waits up to `timeout_s` for releases when over budget."""
        if len(keys) == 1:  # the common case: one tensor whose buffer is free
            with self._cond:
                free = self._free.get(keys[0])
                if free:
                    buf = free.pop()
                    self._free.move_to_end(keys[0])
                    self._count_lease(buf.nbytes, hits=1)
                    return Lease([buf], self)
        needed = sum(nbytes_of(d, s) for d, s in keys)
        if needed > self.pool_bytes:
            raise PoolExhaustedError(self.name, needed, self.pool_bytes, 0.0)
        deadline = None
        with self._cond:
            while True:
                got = self._try_take(keys)
                if got is not None:
                    break
                if deadline is None:
                    deadline = time.monotonic() + timeout_s
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats.exhausted += 1
                    raise PoolExhaustedError(self.name, needed, self.pool_bytes, timeout_s)
                self._waiting += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._waiting -= 1
            self._count_lease(needed)
        return Lease(got, self)

    def _count_lease(self, nbytes: int, hits: int = 0) -> None:
        st = self.stats
        st.hits += hits
        st.leases_out += 1
        st.leased_bytes += nbytes
        if st.leases_out > st.peak_leases:
            st.peak_leases = st.leases_out
        if st.leased_bytes > st.peak_leased_bytes:
            st.peak_leased_bytes = st.leased_bytes

    def _try_take(self, keys: Sequence[Key]) -> list[Buffer] | None:
        # Count what must be allocated before touching the free lists, so a failed attempt
        # leaves the pool as it was.
        wanted: dict[Key, int] = {}
        for k in keys:
            wanted[k] = wanted.get(k, 0) + 1
        new_bytes = 0
        for k, n in wanted.items():
            short = n - len(self._free.get(k, ()))
            if short > 0:
                new_bytes += short * nbytes_of(*k)
        if not self._make_room(new_bytes, keep=wanted):
            return None
        out: list[Buffer] = []
        for k in keys:
            free = self._free.get(k)
            if free:
                out.append(free.pop())
                self.stats.hits += 1
                self._free.move_to_end(k)
            else:
                buf = Buffer(k, pin_memory=self.pin_memory)
                self.stats.misses += 1
                self.stats.allocated_bytes += buf.nbytes
                out.append(buf)
        return out

    def _make_room(self, new_bytes: int, *, keep: dict[Key, int]) -> bool:
        if self.stats.allocated_bytes + new_bytes <= self.pool_bytes:
            return True
        idle = sum(b.nbytes for k, bs in self._free.items() if k not in keep for b in bs)
        if self.stats.allocated_bytes - idle + new_bytes > self.pool_bytes:
            return False
        for k in list(self._free):
            if self.stats.allocated_bytes + new_bytes <= self.pool_bytes:
                break
            if k in keep:
                continue
            for b in self._free.pop(k):
                self.stats.allocated_bytes -= b.nbytes
                self.stats.evictions += 1
        return True

    def _give_back(self, buffers: list[Buffer]) -> None:
        nbytes = 0
        with self._cond:
            for b in buffers:
                free = self._free.get(b.key)
                if free is None:
                    self._free[b.key] = [b]
                else:
                    free.append(b)
                    self._free.move_to_end(b.key)
                nbytes += b.nbytes
            self.stats.leases_out -= 1
            self.stats.leased_bytes -= nbytes
            if self._waiting:
                self._cond.notify_all()
