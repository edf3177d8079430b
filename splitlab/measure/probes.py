"""Timing probes for calibration: decode and prefill of a few blocks, weight load, swap, link.

    .venv/bin/python tools/calibrate.py --quick --out /tmp/cal.json
    .venv/bin/pytest tests/integration/test_calibrate.py -q

The I/O shell of calibration (the fits are pure, in `splitlab.analysis.fits`, which reads
only what these return). Every probe
returns raw measurements; none invents a value for what it could not observe. Repetitions of
different sizes are interleaved (round-robin over the sizes, `repeats` times) so machine noise
hits every size alike; each size's figure is the median of its repetitions (decode: the
fastest batch, see `time_decode`).

- decode: a `Part` of `num_blocks` middle blocks; the KV cache is filled with random keys and
  values of context P (decode cost does not depend on their values), then a batch of `steps`
  one-token calls is timed and divided: ms per block per step at context P + steps / 2.
- prefill: one call of P tokens through the same part, ms per block.
- weight load: `load_blocks` of one block after asking the kernel to drop the checkpoint's
  pages (`posix_fadvise(DONTNEED)`); `mincore` says how much of the file was still resident,
  which decides whether the read was cold, warm, or unknown.
- L_n (`time_load_n`): `load_blocks` of n blocks for several n, read after dropping the pages
  (cold) and with them resident (warm), interleaved; the fastest per n.
- link: two `TcpTransport`s in this process over loopback; one echoes every frame; the median
  round trip / 2 per payload size is the one-way time the link fit regresses on.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from splitlab.models.parts import Part

_libc_name = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_libc_name, use_errno=True) if _libc_name else None


def _interleaved(
    sizes: Sequence[int],
    repeats: int,
    measure: Callable[[int], float],
    reduce: Callable[[list[float]], float] = statistics.median,
) -> dict[int, float]:
    samples: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(repeats):
        for size in sizes:
            samples[size].append(measure(size))
    return {size: reduce(values) for size, values in samples.items()}


def _kv_shape(part: Part, context: int) -> tuple[int, int, int, int]:
    config = part.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (1, heads, context, head_dim)


def _dtype(part: Part) -> torch.dtype:
    return next(part.parameters()).dtype


@torch.inference_mode()
def _decode_batch_ms(part: Part, context: int, steps: int, generator: torch.Generator) -> float:
    dtype, hidden_size = _dtype(part), part.config.hidden_size
    cache = part.new_cache()
    for layer_idx in part.span.layer_ids:
        shape = _kv_shape(part, context)
        keys = torch.randn(shape, generator=generator).to(dtype)
        values = torch.randn(shape, generator=generator).to(dtype)
        cache.update(keys, values, layer_idx)
    hidden = torch.randn(1, 1, hidden_size, generator=generator).to(dtype)
    t0 = time.perf_counter()
    for step in range(steps):
        pos = context + step
        mask = torch.ones(1, pos + 1, dtype=torch.long)
        positions = torch.tensor([[pos]])
        hidden = part(hidden, mask, positions, cache)
    return (time.perf_counter() - t0) * 1e3 / steps / part.span.num_blocks


def time_decode(
    part: Part, *, contexts: Sequence[int], steps: int, repeats: int, seed: int = 0
) -> list[tuple[float, float]]:
    """(P + t at the batch's middle step, ms per block per decode step) for each context P.

    Each context's figure is its fastest of `repeats` interleaved batches of `steps` steps.
    """
    generator = torch.Generator().manual_seed(seed)
    _decode_batch_ms(part, min(contexts), 2, generator)  # warm-up: first-call allocations
    # The fastest batch per context: a co-runner only ever adds time, and on a shared host a
    # burst of it lands on some contexts and not others, which a median of few batches keeps.
    fastest = _interleaved(contexts, repeats, lambda p: _decode_batch_ms(part, p, steps, generator),
                           reduce=min)  # fmt: skip
    return [(p + (steps - 1) / 2, ms) for p, ms in fastest.items()]


@torch.inference_mode()
def _prefill_ms(part: Part, length: int, generator: torch.Generator) -> float:
    hidden = torch.randn(1, length, part.config.hidden_size, generator=generator).to(_dtype(part))
    mask = torch.ones(1, length, dtype=torch.long)
    positions = torch.arange(length).unsqueeze(0)
    t0 = time.perf_counter()
    part(hidden, mask, positions, part.new_cache())
    return (time.perf_counter() - t0) * 1e3 / part.span.num_blocks


def time_prefill(
    part: Part, *, lengths: Sequence[int], repeats: int, seed: int = 0
) -> list[tuple[float, float]]:
    """(P, ms per block) for each prompt length P."""
    generator = torch.Generator().manual_seed(seed)
    _prefill_ms(part, min(lengths), generator)
    medians = _interleaved(lengths, repeats, lambda p: _prefill_ms(part, p, generator))
    return [(float(p), ms) for p, ms in medians.items()]


def resident_fraction(path: Path) -> float | None:
    """Fraction of `path`'s pages in the page cache (mincore), or None where it cannot be asked.

    Maps the file without touching it (mapping faults nothing in), asks, unmaps.
    """
    size = path.stat().st_size
    if _LIBC is None or size == 0:
        return None
    libc = _LIBC
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            code = libc.mincore(address, size, vec)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    if code != 0:
        return None
    return sum(b & 1 for b in vec) / pages


def drop_page_cache(path: Path) -> str:
    """Ask the kernel to drop `path`'s pages; "ok" or the error. Pages still mapped stay.

    Written back first (fsync): dirty pages, as a just-written checkpoint has, are not dropped.
    """
    if not hasattr(os, "posix_fadvise"):
        return "error: os.posix_fadvise is not available on this platform"
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"error: {exc}"
    return "ok"


def cache_state(fraction: float | None) -> str:
    """cold / warm / unknown from the resident fraction before a read."""
    if fraction is None:
        return "unknown"
    if fraction < 0.05:
        return "cold"
    if fraction > 0.95:
        return "warm"
    return "unknown"


def time_weight_load(
    load: Callable[[], Any], files: Sequence[Path], *, repeats: int = 3
) -> dict[str, Any]:
    """The first read of one block after dropping the files' pages, then warm re-reads."""
    statuses = {str(p): drop_page_cache(p) for p in files}
    fractions = [resident_fraction(p) for p in files]
    before = None if any(f is None for f in fractions) else min(fractions)  # type: ignore[type-var]
    t0 = time.perf_counter()
    load()
    first_ms = (time.perf_counter() - t0) * 1e3
    warm: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        load()
        warm.append((time.perf_counter() - t0) * 1e3)
    return {
        "ms": first_ms, "cache": cache_state(before), "resident_fraction_before": before,
        "fadvise_dontneed": statuses, "warm_ms": statistics.median(warm),
    }  # fmt: skip


def load_counts(num_layers: int) -> tuple[int, ...]:
    """Block counts n for L_n: 1, 2, 3, 4, 6, 8, 12, 16, ... up to `num_layers`."""
    out, n = [1, 2, 3, 4], 4
    while n * 3 // 2 <= num_layers:
        out += [n * 3 // 2, n * 2]
        n *= 2
    return tuple(c for c in dict.fromkeys(out) if c <= num_layers)


def time_load_n(
    load: Callable[[int], Any], counts: Sequence[int], files: Sequence[Path], *, repeats: int
) -> dict[str, Any]:
    """L_n points: per n, the fastest of `repeats` timings of `load(n)` after dropping `files`'
    pages (cold) and of `load(n)` straight after it, the pages resident (warm); cold and warm
    alternate, round-robin over n. The fastest, as for decode: a co-runner only adds time.

    Returns `{"cold": [(n, ms)], "warm": [(n, ms)], "cache": cold | warm | unknown}`, where
    `cache` is the state the "cold" reads really met (mincore before each), the warmest seen.
    """
    states: list[str] = []
    samples: dict[str, dict[int, list[float]]] = {"cold": {}, "warm": {}}
    load(counts[0])  # warm-up: first-call imports and allocations
    for _ in range(repeats):
        for n in counts:
            for path in files:
                drop_page_cache(path)
            fractions = [resident_fraction(p) for p in files]
            known = None if None in fractions else max(fractions)  # type: ignore[type-var]
            states.append(cache_state(known))
            samples["cold"].setdefault(n, []).append(_timed(load, n))
            samples["warm"].setdefault(n, []).append(_timed(load, n))
    worst = "cold" if set(states) == {"cold"} else "warm" if "warm" in states else "unknown"
    return {arm: [(float(n), min(ms)) for n, ms in by_n.items()] for arm, by_n in samples.items()
            } | {"cache": worst}  # fmt: skip


def _timed(fn: Callable[[int], Any], arg: int) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return (time.perf_counter() - t0) * 1e3


def time_swap(part: Part, device: str, *, repeats: int = 5) -> float | None:
    """Median ms to move the part's weights host -> `device` -> host; None on a CPU-only device."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        part.to(device)
        torch.cuda.synchronize()
        part.to("cpu")
        samples.append((time.perf_counter() - t0) * 1e3 / part.span.num_blocks)
    return statistics.median(samples)


def probe_link(
    *, sizes: Sequence[int], round_trips: int, host: str = "127.0.0.1"
) -> list[tuple[float, float]]:
    """(payload bytes, median one-way ms) over the framed-tensor TCP path, echoed in-process."""
    from splitlab.wire import Lane, TcpTransport

    key, session = os.urandom(32), f"calibrate-{os.getpid()}"
    pinger = TcpTransport("pinger", key=key, session=session, bind_host=host)
    echo = TcpTransport("echo", key=key, session=session, bind_host=host)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                msg = echo.recv(Lane.ACTIVATION, timeout_s=0.5)
            except Exception:  # noqa: BLE001 - timeouts while idle, closed at the end
                continue
            with msg:
                echo.send("pinger", Lane.ACTIVATION, "pong", dict(msg.tensors)).wait(30.0)

    thread = threading.Thread(target=serve, name="calibrate-echo", daemon=True)
    try:
        pinger.connect("echo", *echo.address)
        thread.start()
        channel = pinger.channel("echo", Lane.ACTIVATION, timeout_s=30.0)
        payloads = {size: torch.zeros(size, dtype=torch.uint8) for size in sizes}

        def round_trip(size: int) -> float:
            t0 = time.perf_counter()
            channel.send("ping", {"x": payloads[size]})
            channel.recv().release()
            return (time.perf_counter() - t0) * 1e3 / 2

        for size in sizes:  # warm-up: connection buffers and pools
            round_trip(size)
        medians = _interleaved(sizes, round_trips, round_trip)
    finally:
        stop.set()
        thread.join(timeout=2.0)
        pinger.close()
        echo.close()
    return [(float(size), ms) for size, ms in medians.items()]


_CORUNNER = (
    "import sys, time, torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(384, 384)\n"
    "print('ready', flush=True)\n"
    "end = time.time() + float(sys.argv[1])\n"
    "while time.time() < end:\n"
    "    a = torch.tanh(a @ a)\n"
)
CORUNNER_WHAT = "one process of single-thread fp32 matmuls"


@contextlib.contextmanager
def corunner(max_s: float) -> Iterator[subprocess.Popen | None]:
    """A busy process (`CORUNNER_WHAT`) for at most `max_s`, killed on exit; None when it did
    not start. `pause`/`resume` (SIGSTOP/SIGCONT) let a benchmark alternate loaded and idle."""
    proc = subprocess.Popen([sys.executable, "-c", _CORUNNER, str(max_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        ready = proc.stdout.readline().strip() if proc.stdout else ""
        yield proc if ready == "ready" else None
    finally:
        proc.kill()
        proc.wait(timeout=10)


def pause(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGSTOP)


def resume(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)


def read_thermal_c() -> dict[str, float] | None:
    """Every /sys thermal zone's temperature in degC, or None on a host without sensors."""
    zones = sorted(Path("/sys/class/thermal").glob("thermal_zone*/temp"))
    out: dict[str, float] = {}
    for zone in zones:
        try:
            out[zone.parent.name] = int(zone.read_text().strip()) / 1000.0
        except (OSError, ValueError):
            continue
    return out or None
