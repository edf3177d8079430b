"""The run's one secret, `$SPLITLAB_SESSION_KEY` (hex, the same on every host of a run), and
the keys derived from it.

Every study reads its keys from here and nowhere else: the ring's data and control links, the
embedded control bus, and fine-tuning's data plane. A launcher generates one session key per
run (`splitlab.control.membership.new_session_key_hex`) and keeps it: each fine-tuning node
gets only what its identity needs, in its environment (never on a command line):
- `$SPLITLAB_NODE_KEY`, its bus credential `node_key(node id)`: the embedded bus derives the
  key of whichever node a connection claims to be, so a node's key opens that node's queue and
  no other (holding owner1's key does not make a process owner0);
- `$SPLITLAB_DATA_KEY`, the data plane's key `data_plane_key(session id)`, the same for every
  member of the run, so it never crosses the bus.
A process given the session key itself (by hand on every host, the ring's stages, the
coordinator hosting the bus on a testbed) derives both. By hand, export the same value on
every host:

    export SPLITLAB_SESSION_KEY=$(python -c 'import secrets; print(secrets.token_hex(32))')

    .venv/bin/pytest tests/unit/test_node_args.py -q
"""

from __future__ import annotations

import hashlib
import hmac
import os

from splitlab.errors import ConfigError

SESSION_KEY_ENV = "SPLITLAB_SESSION_KEY"
NODE_KEY_ENV = "SPLITLAB_NODE_KEY"  # one node's bus credential (`node_key`)
DATA_KEY_ENV = "SPLITLAB_DATA_KEY"  # the run's data-plane key (`data_plane_key`)
MIN_KEY_BYTES = 16


def session_key() -> bytes:
    """The key from `$SPLITLAB_SESSION_KEY`.

    Raises:
        ConfigError: the variable is missing, not hex, or shorter than 16 bytes.
    """
    text = os.environ.get(SESSION_KEY_ENV, "")
    key = _hex_key(SESSION_KEY_ENV, text)
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"${SESSION_KEY_ENV} is missing or shorter than {MIN_KEY_BYTES} bytes: export the same "
            "key on every host of the run (e.g. `export SPLITLAB_SESSION_KEY=$(python -c "
            "'import secrets; print(secrets.token_hex(32))')`)"
        )
    return key


def data_plane_key(session: str, key: bytes | None = None) -> bytes:
    """Fine-tuning's data-plane HMAC key: HMAC-SHA256 of the session key (`key`, else
    `$SPLITLAB_DATA_KEY` as the launcher hands it, else `session_key()`) over the session id.
    No member receives it over the control bus (which authenticates its frames but does not
    encrypt them, and a broker reads every message), and one run's data plane refuses another
    run's peers."""
    if key is None and (handed := _env_key(DATA_KEY_ENV)) is not None:
        return handed
    return hmac.new(key if key is not None else session_key(),
                    b"splitlab data plane " + session.encode(), hashlib.sha256).digest()  # fmt: skip


def node_key(node_id: str, key: bytes | None = None) -> bytes:
    """One node's credential on the embedded control bus: HMAC-SHA256 of the session key
    (`key`, else `session_key()`) over the node id. The bus, which holds the session key,
    derives it for the node a connection names; nobody derives one node's key from another's."""
    return hmac.new(key if key is not None else session_key(),
                    b"splitlab node " + node_id.encode(), hashlib.sha256).digest()  # fmt: skip


def own_node_key(node_id: str) -> bytes:
    """This process's bus credential: `$SPLITLAB_NODE_KEY` as the launcher hands it, else
    derived from `$SPLITLAB_SESSION_KEY` (a process holding the session key may be any node).

    Raises:
        ConfigError: neither is set (or not hex).
    """
    handed = _env_key(NODE_KEY_ENV)
    return handed if handed is not None else node_key(node_id)


def _env_key(name: str) -> bytes | None:
    text = os.environ.get(name)
    return None if text is None else _hex_key(name, text)


def _hex_key(name: str, text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"${name} must be hex, got {len(text)} characters") from None
