"""Which OSErrors are storage failures (exit code 9), and how they are named.

.venv/bin/pytest tests/unit/test_errors.py -q
"""

from __future__ import annotations

import errno

from splitlab.errors import ExitCode, StorageError, as_storage_error


def test_a_full_disk_is_a_storage_error_naming_the_file_or_the_place() -> None:
    named = as_storage_error(OSError(errno.ENOSPC, "No space left on device", "/r/a.csv"), "RUN")
    assert isinstance(named, StorageError) and named.exit_code == ExitCode.STORAGE
    assert str(named) == "'/r/a.csv': cannot be written: [Errno 28] No space left on device"
    unnamed = as_storage_error(OSError(errno.EROFS, "Read-only file system"), "the run folder R")
    assert unnamed is not None and str(unnamed).startswith("'the run folder R': cannot be written")


def test_other_os_errors_are_not_storage_failures() -> None:
    assert as_storage_error(ConnectionResetError(errno.ECONNRESET, "reset"), "RUN") is None
    assert as_storage_error(FileNotFoundError(errno.ENOENT, "missing", "x"), "RUN") is None
    already = StorageError("checkpoint 'c': cannot be written")
    assert as_storage_error(already, "RUN") is already
