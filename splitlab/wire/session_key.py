"""The run's one secret: `$SPLITLAB_SESSION_KEY`, hex, the same on every host of a run.

Every study reads it from here and nowhere else: the ring's data and control links, the
embedded control bus, and fine-tuning's data plane, whose key is derived from it and the
session id (`data_plane_key`) on every member, so no key ever travels over the bus. A launcher
generates one per run (`splitlab.control.membership.new_session_key_hex`) and passes it in
the children's environment, so no secret is ever on a command line; by hand, export the same
value on every host:

    export SPLITLAB_SESSION_KEY=$(python -c 'import secrets; print(secrets.token_hex(32))')

    .venv/bin/pytest tests/unit/test_node_args.py -q
"""

from __future__ import annotations

import hashlib
import hmac
import os

from splitlab.errors import ConfigError

SESSION_KEY_ENV = "SPLITLAB_SESSION_KEY"
MIN_KEY_BYTES = 16


def session_key() -> bytes:
    """The key from `$SPLITLAB_SESSION_KEY`.

    Raises:
        ConfigError: the variable is missing, not hex, or shorter than 16 bytes.
    """
    text = os.environ.get(SESSION_KEY_ENV, "")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"${SESSION_KEY_ENV} must be hex, got {len(text)} characters") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"${SESSION_KEY_ENV} is missing or shorter than {MIN_KEY_BYTES} bytes: export the same "
            "key on every host of the run (e.g. `export SPLITLAB_SESSION_KEY=$(python -c "
            "'import secrets; print(secrets.token_hex(32))')`)"
        )
    return key


def data_plane_key(session: str, key: bytes | None = None) -> bytes:
    """Fine-tuning's data-plane HMAC key: HMAC-SHA256 of the session key (`key`, else
    `session_key()`) over the session id. Every member derives the same key by itself, so it
    never crosses the control bus (which authenticates its frames but does not encrypt them,
    and a broker reads every message), and one run's data plane refuses another run's peers."""
    return hmac.new(key if key is not None else session_key(),
                    b"splitlab data plane " + session.encode(), hashlib.sha256).digest()  # fmt: skip
