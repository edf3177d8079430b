"""A node's RabbitMQ login under `control.node_users` (`splitlab.control.broker_users`
creates them): the names of a session's vhost and node users, the login a node reads from
`$SPLITLAB_BROKER_LOGIN` into its broker URLs, and the `user_id` a message from a given sender
must carry (`sender_user`). Pure: no broker, no pika; the control bus and the tensor transport
over RabbitMQ both check senders with it.

    .venv/bin/pytest tests/unit/test_broker_login.py -q
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from splitlab.errors import ConfigError

LOGIN_ENV = "SPLITLAB_BROKER_LOGIN"  # "USER:PASSWORD@VHOST" of this node (URL-safe parts)
PREFIX = "splitlab"


def vhost(session: str) -> str:
    return f"{PREFIX}.{session}"


def node_user(session: str, node_id: str) -> str:
    return f"{PREFIX}.{session}.{node_id}"


def login(user: str, password: str, host: str) -> str:
    return f"{user}:{password}@{host}"


def with_login(url: str, login_text: str) -> str:
    """`url` (an AMQP URL) with the user, password and vhost of `login_text`; host and port
    kept.

    Raises:
        ConfigError: `login_text` is not USER:PASSWORD@VHOST.
    """
    creds, at, host = login_text.rpartition("@")
    user, colon, password = creds.partition(":")
    if not (at and colon and user and password and host):
        raise ConfigError(f"${LOGIN_ENV} must be USER:PASSWORD@VHOST, got {len(login_text)} "
                          "characters without that form")  # fmt: skip
    parts = urlsplit(url)
    where = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{where}"
    return urlunsplit(parts._replace(netloc=netloc, path="/" + quote(host, safe="")))


def apply_login(cfg: Any, environ: Mapping[str, str] = os.environ) -> bool:
    """Put `$SPLITLAB_BROKER_LOGIN` into `cfg.control.url` (and `cfg.transport.url` with
    transport=rabbitmq); False when the variable is not set."""
    text = environ.get(LOGIN_ENV)
    if not text:
        return False
    cfg.control.url = with_login(cfg.control.url, text)
    if cfg.transport.name == "rabbitmq":
        cfg.transport.url = with_login(cfg.transport.url, text)
    return True


def sender_user(session: str, url_user: str, node_id: str, sender: str) -> str | None:
    """The `user_id` a message from `sender` must carry to be delivered to `node_id`, or None
    when `node_id` is not logged in as its node user (a shared login: nothing to check)."""
    if unquote(url_user) != node_user(session, node_id):
        return None
    return node_user(session, sender)
