"""The run's one secret: `$SPLITLAB_SESSION_KEY`, hex, the same on every host of a run.

Every study reads it from here and nowhere else: the ring's data and control links, the
embedded control bus, and fine-tuning members that run without a coordinator (with one, the
coordinator hands out a fresh data-plane key in START over the authenticated bus). A launcher
generates one per run (`splitlab.control.membership.new_session_key_hex`) and passes it in
the children's environment, so no secret is ever on a command line; by hand, export the same
value on every host:

    export SPLITLAB_SESSION_KEY=$(python -c 'import secrets; print(secrets.token_hex(32))')

    .venv/bin/pytest tests/unit/test_node_args.py -q
"""

from __future__ import annotations

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
