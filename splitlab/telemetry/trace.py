"""JSONL trace writer: one typed record per event, with automatic `ts_us`, `role` and `rank`.

Records (`splitlab.telemetry.records`) are queued with their timestamp and serialised by a
background thread, so `write` never blocks compute on encoding or file I/O. A disabled tracer
(`Tracer.null()`) is a no-op. A trace that cannot be written (a full disk, a read-only run
folder) is a `StorageError` naming the file and the cause (exit code 9): raised by the next
`write` (or `close`) in the caller's thread, not a traceback in the writer's; the records
before it stay in the file and the writer drops the rest instead of queueing them forever.

    python -c "from splitlab.telemetry.trace import Tracer; from splitlab.telemetry.records import AbortRecord; t = Tracer.open('/tmp/t.jsonl', role='x', rank=0); t.write(AbortRecord(reason='demo')); t.close()"
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

from splitlab.errors import StorageError
from splitlab.telemetry.schema import Record, stamp

_STOP = object()


def now_us() -> int:
    """Wall-clock microseconds since the epoch (comparable across processes on one host)."""
    return time.time_ns() // 1000


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return _jsonable(value.item())
        except (ValueError, RuntimeError):
            return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class Tracer:
    """Append-only JSONL writer owned by one process."""

    def __init__(self, path: Path | None, *, role: str, rank: int) -> None:
        self.path = path
        self.role, self.rank = role, rank
        self._queue: queue.SimpleQueue[Any] | None = None
        self._thread: threading.Thread | None = None
        self.error: StorageError | None = None  # the write that failed, once raised to the caller
        self._raised = False
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            except OSError as exc:
                raise StorageError(f"trace {str(path)!r}: cannot be opened: {exc}") from exc
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._drain, name=f"trace-{role}-{rank}", daemon=True
            )
            self._thread.start()

    @classmethod
    def open(cls, path: str | Path, *, role: str, rank: int) -> Tracer:
        return cls(Path(path), role=role, rank=rank)

    @classmethod
    def for_run(cls, run_dir: str | Path | None, *, role: str, rank: int) -> Tracer:
        """`RUN/traces/<role>-<rank>.jsonl`, or a no-op tracer when run_dir is None."""
        if run_dir is None:
            return cls.null()
        return cls(Path(run_dir) / "traces" / f"{role}-{rank}.jsonl", role=role, rank=rank)

    @classmethod
    def null(cls) -> Tracer:
        return cls(None, role="", rank=0)

    @property
    def enabled(self) -> bool:
        return self._queue is not None

    def write(self, record: Record) -> None:
        """Queue `record`, stamped now; the caller must not mutate the values it holds."""
        if self._queue is None:
            return
        if self.error is not None:
            self._raised = True
            raise self.error
        self._queue.put((now_us(), record))

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            if self.error is not None:
                continue  # dropped: the caller hears of the failure at its next write
            ts_us, record = item
            line = stamp(record, ts_us=ts_us, role=self.role, rank=self.rank)
            try:
                self._file.write(json.dumps(_jsonable(line), separators=(",", ":")) + "\n")
                if self._queue.empty():
                    self._file.flush()
            except OSError as exc:
                self._failed(exc)
        if self.error is None:
            try:
                self._file.flush()
            except OSError as exc:
                self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        self.error = StorageError(
            f"trace {str(self.path)!r}: cannot be written: {exc}; the records before it are in "
            "the file, this node's later ones are dropped"
        )
        self.error.__cause__ = exc

    def close(self) -> None:
        """Flush every queued record and close the file (idempotent); raises the
        `StorageError` of a failed write that no `write` has raised yet."""
        if self._queue is None or self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout=10)
        self._queue = None
        try:
            self._file.close()
        except OSError as exc:  # the last buffered bytes did not fit either
            if self.error is None:
                self._failed(exc)
        if self.error is not None and not self._raised:
            self._raised = True
            raise self.error

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
