"""Node users on RabbitMQ, the pure parts: definitions, password hashes, logins, who may
send what (`splitlab.control.broker_users`, `splitlab.wire.broker_login`).

    .venv/bin/pytest tests/unit/test_broker_login.py -q
"""

from __future__ import annotations

import base64
import hashlib
import re
from types import SimpleNamespace

import pika
import pytest

from splitlab.control.broker_users import check_node_users, definitions, password_hash
from splitlab.errors import ConfigError
from splitlab.wire.broker_login import LOGIN_ENV, apply_login, sender_user, with_login

URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def test_password_hash_is_rabbitmq_sha256_of_salt_and_password() -> None:
    raw = base64.b64decode(password_hash("s3cret", b"\x01\x02\x03\x04"))

    assert raw[:4] == b"\x01\x02\x03\x04"
    assert raw[4:] == hashlib.sha256(b"\x01\x02\x03\x04s3cret").digest()


def test_each_node_may_configure_and_read_only_its_own_queues() -> None:
    d = definitions("ft-1", {"owner1": "pw-one!", "owner10": "pw-ten!"}, {"x-expires": 3_600_000})
    perms = {p["user"]: p for p in d["permissions"]}
    mine = re.compile(perms["splitlab.ft-1.owner1"]["read"])

    assert d["vhosts"] == [{"name": "splitlab.ft-1"}]
    assert perms["splitlab.ft-1.owner1"]["configure"] == perms["splitlab.ft-1.owner1"]["read"]
    assert mine.match("splitlab.ft-1.owner1")  # control queue
    assert mine.match("splitlab.ft-1.owner1.activation")  # its transport lanes
    assert not mine.match("splitlab.ft-1.owner10")  # a node whose id it prefixes
    assert not mine.match("splitlab.ft-1.owner10.kv")
    assert not mine.match("splitlab.ft-2.owner1")  # the same node id in another session
    assert perms["splitlab.ft-1.owner1"]["write"] == "^amq\\.default$"
    assert {q["name"] for q in d["queues"]} == {"splitlab.ft-1.owner1", "splitlab.ft-1.owner10"}
    assert all(q["arguments"] == {"x-expires": 3_600_000} for q in d["queues"])
    # only hashes travel to the broker (base64 never holds "-" or "!": no chance match)
    assert "pw-one!" not in str(d) and "pw-ten!" not in str(d)


def test_with_login_swaps_user_password_and_vhost_and_keeps_the_host() -> None:
    url = with_login("amqp://guest:guest@10.211.0.1:5673/%2F", "splitlab.s.o0:pw-_1@splitlab.s")
    params = pika.URLParameters(url)

    assert (params.host, params.port) == ("10.211.0.1", 5673)
    assert params.credentials.username == "splitlab.s.o0"
    assert params.credentials.password == "pw-_1"
    assert params.virtual_host == "splitlab.s"


@pytest.mark.parametrize("bad", ["", "user@vhost", "user:@vhost", "user:pw@", ":pw@v"])
def test_a_malformed_login_is_refused_naming_the_variable(bad: str) -> None:
    with pytest.raises(ConfigError, match=LOGIN_ENV):
        with_login(URL, bad)


def test_apply_login_sets_the_transport_url_only_over_rabbitmq() -> None:
    cfg = SimpleNamespace(control=SimpleNamespace(url=URL),
                          transport=SimpleNamespace(name="tcp", url=URL))  # fmt: skip

    assert not apply_login(cfg, {})
    assert apply_login(cfg, {LOGIN_ENV: "splitlab.s.o0:pw@splitlab.s"})
    assert pika.URLParameters(cfg.control.url).credentials.username == "splitlab.s.o0"
    assert cfg.transport.url == URL


def test_senders_are_checked_only_under_a_node_login() -> None:
    assert sender_user("s", "guest", "o0", "coordinator") is None
    assert sender_user("s", "splitlab.s.o0", "o0", "coordinator") == "splitlab.s.coordinator"
    assert sender_user("s", "splitlab.s.o1", "o0", "coordinator") is None  # not its own login


def _cfg(control: str = "rabbitmq", url: str = URL, transport: str = "tcp", turl: str = URL):
    return (SimpleNamespace(name=control, url=url, node_users=True),
            SimpleNamespace(name=transport, url=turl))  # fmt: skip


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("embedded",), "control=rabbitmq"),
        (("rabbitmq", "amqp://u:p@broker.example:5672/%2F"), "broker.example"),
        (("rabbitmq", URL, "rabbitmq", "amqp://guest:guest@127.0.0.1:5673/%2F"), "transport.url"),
    ],
)
def test_node_users_refuse_what_rabbitmqctl_cannot_administer(args: tuple, words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        check_node_users(*_cfg(*args))


def test_node_users_off_checks_nothing() -> None:
    control, transport = _cfg("embedded")
    control.node_users = False

    check_node_users(control, transport)
