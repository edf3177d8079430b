"""Progress of a long phase: a tqdm bar on an interactive terminal, one log line everywhere.

A phase (final evaluation, a model load, an asset fetch, tokenising a data set) is one `Progress`:
on a terminal it draws a tqdm bar on stderr that vanishes when the phase ends; in a log file or
CI (stderr not a terminal, `task.progress=false` or `TQDM_DISABLE=1`) it draws nothing, so no
carriage-return redraws or escape codes reach the file. Either way the phase ends with one INFO
line: what it was, how much it did and how long it took.

    .venv/bin/pytest tests/unit/test_progress.py -q
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, redirect_stderr
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def interactive(enabled: bool = True) -> bool:
    """Whether a bar may draw: `enabled` (the config's `task.progress`), stderr a terminal and
    tqdm not disabled by its own `TQDM_DISABLE` (the launcher sets it for node processes)."""
    disabled = os.environ.get("TQDM_DISABLE", "").strip().lower() in {"1", "true", "yes", "on"}
    return enabled and not disabled and sys.stderr.isatty()


@contextmanager
def foreign_bars() -> Iterator[None]:
    """Inside, other libraries' tqdm bars that no switch reaches (transformers' GGUF
    dequantisation uses a bare tqdm) draw only on a terminal; elsewhere what they write to
    `sys.stderr` is dropped. Logging is unaffected: its handlers hold the real stream."""
    if interactive():
        yield
        return
    with redirect_stderr(io.StringIO()):
        yield


def end_line(desc: str, *, count: int, total: int | None, unit: str, elapsed_s: float) -> str:
    """The one line a phase ends with, e.g. `final evaluation: 32 batches in 151.9 s`."""
    done = f"{count}/{total}" if total is not None and count != total else str(count)
    return f"{desc}: {done} {unit} in {elapsed_s:.1f} s"


class Progress:
    """One phase. `update(n)` as work completes, `note(text)` for what runs now (shown beside
    the bar), `close(summary)` (or leave the `with`) to end it with its one line.

    Args:
        desc: what the phase is, e.g. "final evaluation".
        total: how many `unit`s it will do, when known (the bar shows a fraction and an ETA).
        unit: what one update counts, e.g. "batches".
        enabled: False never draws a bar (`task.progress`).
        logger: where the end line goes; None ends silently (a caller that reports the phase
            itself, like a training round).
    """

    def __init__(
        self,
        desc: str,
        *,
        total: int | None = None,
        unit: str = "steps",
        enabled: bool = True,
        logger: logging.Logger | None = log,
    ) -> None:
        self.desc, self.total, self.unit, self.logger = desc, total, unit, logger
        self.count = 0
        self._began = time.monotonic()
        self._bar: Any = None
        self._closed = False
        if interactive(enabled):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=f" {unit}", leave=False)

    def update(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def close(self, summary: str = "") -> None:
        """End the phase: remove the bar, log the one line (`summary` appended after a comma)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self.logger is not None:
            line = end_line(self.desc, count=self.count, total=self.total, unit=self.unit,
                            elapsed_s=time.monotonic() - self._began)  # fmt: skip
            self.logger.info("%s%s", line, f", {summary}" if summary else "")

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        elif self._bar is not None:  # a failed phase says so through its error, not a line
            self._closed = True
            self._bar.close()


def track(
    items: Iterable[T],
    desc: str,
    *,
    total: int | None = None,
    unit: str = "steps",
    enabled: bool = True,
    logger: logging.Logger | None = log,
) -> Iterator[T]:
    """`items` as they are consumed, counted by one `Progress` (its line when they run out)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(desc, total=total, unit=unit, enabled=enabled, logger=logger) as progress:
        for item in items:
            yield item
            progress.update()
