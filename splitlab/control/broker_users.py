"""One RabbitMQ user per node in a vhost of the session's own (`control.node_users=true`).

On a shared broker login (`guest`, say) RabbitMQ lets any process read any node's queue and
publish as anyone. With node users the launcher first imports, in one `rabbitmqctl
import_definitions` call (`definitions`):

- a vhost `splitlab.<session>`: the URL's own user and every other session's users are
  refused at the door;
- per node a user `splitlab.<session>.<node>` with a fresh random password, allowed to
  configure and read only `^splitlab\\.<session>\\.<node>(\\.<lane>)?$` (its control queue and
  its tensor transport's lanes) and to write only the default exchange (a message to any
  member's queue);
- every node's control queue, declared in advance, since no node may declare another's.

Each node gets its login in its environment (`$SPLITLAB_BROKER_LOGIN`, never on a command
line), which `splitlab.wire.broker_login` puts into its broker URLs. Every publish carries the
AMQP `user_id`, which the broker refuses unless it is the connection's own user, and a node
logged in as a node user drops any message whose `user_id` is not the user of the node it
names as sender: a member can neither read another's queue nor speak for another. Once every
node has exited the launcher deletes the vhost (queues included) and the users; a killed
launcher's leftovers are listed and removed with `python tools/broker_users.py`.

`rabbitmqctl` administers the broker of the machine it runs on, so node users need the
broker on the launcher's machine (a loopback `control.url`; testbed hosts reach it through the
relay) and a launcher allowed to run `rabbitmqctl` (root, or the `rabbitmq` user).

    SPLITLAB_REQUIRE_BROKER=1 .venv/bin/pytest tests/integration/test_broker_users.py -q
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from splitlab.control.bus import queue_name
from splitlab.errors import ConfigError, PeerLostError
from splitlab.wire.broker_login import PREFIX, login, node_user, vhost, with_login

HASHING = "rabbit_password_hashing_sha256"
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
CTL_TIMEOUT_S = 60.0  # one rabbitmqctl call (an Erlang VM start: ~1 s of one core)
READY_TIMEOUT_S = 10.0  # the import is asynchronous: until every node user can log in


def own_queues(session: str, node_id: str) -> str:
    """The queue names `node_id` may configure and read: its control queue
    (`splitlab.control.bus.queue_name`) and its transport lanes (`splitlab.wire.amqp`)."""
    return f"^{re.escape(queue_name(session, node_id))}(\\.[a-z]+)?$"


def password_hash(password: str, salt: bytes) -> str:
    """RabbitMQ's `rabbit_password_hashing_sha256`: base64(salt + sha256(salt + password))."""
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def definitions(
    session: str, passwords: Mapping[str, str], queue_args: Mapping[str, Any]
) -> dict[str, Any]:
    """The vhost, node users, permissions and control queues of `session` as RabbitMQ
    definitions; `passwords` is {node id: password}, `queue_args` the control queues'
    arguments (they must equal what a node declares)."""
    host = vhost(session)
    users, permissions, queues = [], [], []
    for node, password in passwords.items():
        user = node_user(session, node)
        users.append({"name": user, "password_hash": password_hash(password, os.urandom(4)),
                      "hashing_algorithm": HASHING, "tags": []})  # fmt: skip
        mine = own_queues(session, node)
        permissions.append({"user": user, "vhost": host, "configure": mine,
                            "write": "^amq\\.default$", "read": mine})  # fmt: skip
        queues.append({"name": queue_name(session, node), "vhost": host, "durable": False,
                       "auto_delete": False, "arguments": dict(queue_args)})  # fmt: skip
    return {"vhosts": [{"name": host}], "users": users, "permissions": permissions,
            "queues": queues}  # fmt: skip


def check_node_users(control: Any, transport: Any) -> None:
    """`control.node_users=true` can be honoured here: control=rabbitmq, the broker on this
    machine and `rabbitmqctl` on PATH, and a RabbitMQ data plane on the same broker.

    Raises:
        ConfigError: naming the key and what is missing.
    """
    if not control.node_users:
        return
    if control.name != "rabbitmq":
        raise ConfigError(f"control.node_users=true is for control=rabbitmq (control="
                          f"{control.name}: the embedded bus always authenticates each node)")  # fmt: skip
    where = urlsplit(control.url)
    if where.hostname not in LOCAL_HOSTS:
        raise ConfigError(
            f"control.node_users=true needs the broker on this machine (rabbitmqctl administers "
            f"the local one); control.url names {where.hostname!r}"
        )
    if transport.name == "rabbitmq":
        there = urlsplit(transport.url)
        if (there.hostname, there.port) != (where.hostname, where.port):
            raise ConfigError(
                f"control.node_users=true needs transport.url on the broker of control.url "
                f"({there.hostname}:{there.port} vs {where.hostname}:{where.port})"
            )
    if shutil.which("rabbitmqctl") is None:
        raise ConfigError("control.node_users=true needs rabbitmqctl on PATH (the RabbitMQ "
                          "server's tools) to create the session's users")  # fmt: skip


def _ctl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["rabbitmqctl", *args], input=stdin, capture_output=True,
                              text=True, timeout=CTL_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerLostError(f"rabbitmqctl {args[0]} failed: {exc}") from None


def create(
    url: str, session: str, nodes: Iterable[str], queue_args: Mapping[str, Any]
) -> dict[str, str]:
    """Create `session`'s vhost, node users and control queues on the local broker; returns
    {node id: login for `$SPLITLAB_BROKER_LOGIN`} once every node user can log in.

    Raises:
        PeerLostError: rabbitmqctl failed (its words), or a user could not log in in time.
    """
    passwords = {node: secrets.token_urlsafe(24) for node in nodes}
    done = _ctl("import_definitions", "--format", "json",
                stdin=json.dumps(definitions(session, passwords, queue_args)))  # fmt: skip
    if done.returncode != 0:
        remove(session, passwords)
        raise PeerLostError(f"rabbitmqctl import_definitions for session {session} exited "
                            f"{done.returncode}: {(done.stderr or done.stdout).strip()[-400:]}")  # fmt: skip
    logins = {n: login(node_user(session, n), p, vhost(session)) for n, p in passwords.items()}
    try:
        _wait_ready(url, session, logins)
    except PeerLostError:
        remove(session, passwords)
        raise
    return logins


def _wait_ready(url: str, session: str, logins: Mapping[str, str]) -> None:
    """The import runs asynchronously in the broker: wait until each node user logs in and
    sees its control queue."""
    import pika  # the launcher imports pika only when it runs node users
    import pika.exceptions

    deadline = time.monotonic() + READY_TIMEOUT_S
    for node, text in logins.items():
        params = pika.URLParameters(with_login(url, text))
        params.connection_attempts, params.socket_timeout = 1, 2.0
        while True:
            try:
                conn = pika.BlockingConnection(params)
                try:
                    conn.channel().queue_declare(queue_name(session, node), passive=True)
                finally:
                    conn.close()
                break
            except pika.exceptions.AMQPError as exc:
                if time.monotonic() > deadline:
                    raise PeerLostError(
                        f"node user {node_user(session, node)} cannot log in to the broker "
                        f"{READY_TIMEOUT_S:.0f} s after its creation: {exc!r}"
                    ) from None
                time.sleep(0.05)


def remove(session: str, nodes: Iterable[str]) -> list[str]:
    """Delete `session`'s vhost (its queues with it) and its node users, in parallel
    rabbitmqctl calls (~1.5 s on 2 cores); returns what could not be deleted, with why
    (a name that is already gone is no failure)."""
    calls = [("delete_vhost", vhost(session))]
    calls += [("delete_user", node_user(session, node)) for node in nodes]
    running = []
    for verb, name in calls:
        try:
            proc = subprocess.Popen(["rabbitmqctl", verb, name], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)  # fmt: skip
        except OSError as exc:
            return [f"{name}: {exc}"]
        running.append((name, proc))
    failed = []
    for name, proc in running:
        try:
            _, err = proc.communicate(timeout=CTL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            failed.append(f"{name}: rabbitmqctl timed out")
            continue
        if proc.returncode != 0 and "not found" not in err.lower():
            failed.append(f"{name}: {err.strip()[-200:]}")
    return failed


def leftovers() -> dict[str, list[str]]:
    """{session: its node users} of every `splitlab.*` vhost and user on the local broker
    (a killed launcher's, or a running one's: check before removing)."""
    found: dict[str, list[str]] = {}
    for verb in ("list_vhosts", "list_users"):
        done = _ctl(verb, "--quiet", "--formatter", "json")
        if done.returncode != 0:
            raise PeerLostError(f"rabbitmqctl {verb} exited {done.returncode}: "
                                f"{(done.stderr or done.stdout).strip()[-400:]}")  # fmt: skip
        for row in json.loads(done.stdout or "[]"):
            parts = str(row.get("name") or row.get("user") or "").split(".")
            if parts[0] != PREFIX or len(parts) not in (2, 3):
                continue
            users = found.setdefault(parts[1], [])
            if len(parts) == 3:
                users.append(parts[2])
    return found
