"""Logging set up once per process with a `[role:rank]` prefix.

python -c "from splitlab.telemetry.log import setup_logging; setup_logging('owner', 0)"
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

_FORMAT = "%(asctime)s [%(role)s:%(rank)s] %(levelname)s %(name)s: %(message)s"


class _RoleFilter(logging.Filter):
    def __init__(self, role: str, rank: int | str) -> None:
        super().__init__()
        self.role, self.rank = role, rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.role, record.rank = self.role, self.rank
        return True


def setup_logging(role: str, rank: int | str = 0, *, level: str | int | None = None) -> None:
    """Route the root logger to stderr with a `[role:rank]` prefix (idempotent)."""
    root = logging.getLogger()
    for handler in list(root.handlers):  # one process, one format: drop Hydra's and ours
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RoleFilter(role, rank))
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level or os.environ.get("SPLITLAB_LOG_LEVEL", "INFO"))
    for noisy in ("pika", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own logging at ERROR inside (its LOAD REPORT table is a WARNING; `load_line`
    says what matters in one line instead), and its progress bars off unless stderr is a
    terminal (carriage-return redraws are noise in a log file)."""
    from transformers.utils import logging as hf_logging  # only where transformers loads

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def exit_now(code: int) -> NoReturn:
    """Leave with `code` once logs and output are flushed, skipping the interpreter's
    finalisation: tearing down torch's and transformers' module graph is a full GC pass per
    phase, which a loaded host stretches into seconds between a process's last line and its
    exit (every launcher and test waits for that exit). The caller has closed its traces,
    sockets and files by then; daemon threads would be stopped either way."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


def leave(code: int) -> NoReturn:
    """How a process's entry point ends (`splitlab`, the tools): `exit_now(code)`, or the
    normal exit, which waits for them, while a non-daemon thread it started still runs."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):  # fmt: skip
        sys.exit(code)
    exit_now(code)
