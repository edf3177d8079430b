"""Typed errors and the distinct process exit codes they map to.

Every failure that leaves a process carries one of these codes, so the launcher (and a
researcher reading `echo $?`) can tell a bad config from a lost peer from a NaN.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable, Mapping
from enum import IntEnum
from typing import TypeVar

T = TypeVar("T")


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1  # anything unclassified
    CONFIG = 2  # bad config key, value or combination
    PEER_LOST = 3  # a peer closed its connection or died
    TIMEOUT = 4  # a bounded wait ran out
    NON_FINITE = 5  # NaN/Inf in a tensor, loss or model update
    PROTOCOL = 6  # a malformed frame or message from a peer
    ASSETS = 7  # a packaged model or dataset could not be fetched
    ABORTED = 8  # the round was aborted because another node failed
    STORAGE = 9  # a file could not be written (disk full, read-only, no permission)


class SplitlabError(Exception):
    """Base class; `exit_code` tells the process how to exit."""

    exit_code: ExitCode = ExitCode.ERROR


class ConfigError(SplitlabError, ValueError):
    """A config key, value or combination is invalid; the message names them."""

    exit_code = ExitCode.CONFIG


class PeerLostError(SplitlabError, ConnectionError):
    exit_code = ExitCode.PEER_LOST


class WaitTimeoutError(SplitlabError, TimeoutError):
    exit_code = ExitCode.TIMEOUT


class NonFiniteError(SplitlabError, FloatingPointError):
    exit_code = ExitCode.NON_FINITE


class ProtocolError(SplitlabError):
    exit_code = ExitCode.PROTOCOL


class AssetError(SplitlabError, RuntimeError):
    exit_code = ExitCode.ASSETS


class AbortedError(SplitlabError):
    exit_code = ExitCode.ABORTED


class StorageError(SplitlabError, OSError):
    """A file could not be written; the message names the file and the cause."""

    exit_code = ExitCode.STORAGE


# What a disk or folder that cannot take a write says: an OSError with one of these is a
# storage failure wherever it surfaces (a lost connection or a missing file is not).
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES})


def as_storage_error(exc: OSError, where: str) -> StorageError | None:
    """`exc` as a StorageError naming its file (else `where`) when a write failed for want of
    room or permission; None for any other OSError."""
    if isinstance(exc, StorageError):
        return exc
    if exc.errno not in STORAGE_ERRNOS:
        return None
    target = exc.filename if exc.filename is not None else where
    return StorageError(f"{str(target)!r}: cannot be written: [Errno {exc.errno}] {exc.strerror}")


def registered(table: Mapping[str, T], name: str, key: str) -> T:
    """`table[name]`; else a ConfigError naming `key=name` and every registered name."""
    try:
        return table[name]
    except KeyError:
        raise ConfigError(f"{key}={name!r}: not registered (registered: {sorted(table)})") from None


def tool_exit(name: str, main: Callable[[], int]) -> int:
    """A tool's exit code from `main()`: a SplitlabError (a bad override, a testbed run
    without root, a lost peer) is one line on stderr naming the tool and its code, not a
    traceback."""
    try:
        return main()
    except SplitlabError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return int(exc.exit_code)
