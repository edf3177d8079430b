"""The sessions' vhosts and node users on the local RabbitMQ broker (`control.node_users`):
list them, or remove what a killed launcher left.

    python tools/broker_users.py                    # each splitlab session and its node users
    python tools/broker_users.py remove SESSION     # its vhost (queues included) and users
    python tools/broker_users.py remove --all       # every splitlab session's (none running!)

A launcher removes its own session's when its nodes have exited; a running session is listed
like a leftover, so remove only what you know is dead. Needs `rabbitmqctl` (root or the
`rabbitmq` user). Exit 0, or 3 when something could not be removed (named).
"""

from __future__ import annotations

import argparse
import sys

from splitlab.control import broker_users
from splitlab.errors import ExitCode, SplitlabError
from splitlab.telemetry.log import leave


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command")
    rm = sub.add_parser("remove", help="remove a session's vhost and node users")
    rm.add_argument("session", nargs="?")
    rm.add_argument("--all", action="store_true", help="every splitlab session's")
    args = p.parse_args(argv)
    try:
        found = broker_users.leftovers()
        if args.command != "remove":
            for session, users in sorted(found.items()):
                print(f"{session}: {len(users)} node users {' '.join(sorted(users))}")
            if not found:
                print("no splitlab session on this broker")
            return 0
        if args.all == bool(args.session):
            p.error("remove takes one SESSION or --all")
        targets = sorted(found) if args.all else [args.session]
        failed = []
        for session in targets:
            failed += broker_users.remove(session, found.get(session, []))
            print(f"removed session {session}")
    except SplitlabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    for failure in failed:
        print(f"not removed: {failure}", file=sys.stderr)
    return int(ExitCode.PEER_LOST) if failed else 0


if __name__ == "__main__":
    leave(main())
