"""Emulated hosts and links on this machine, by hand: up | status | exec HOST CMD | down.

    python tools/testbed.py up --testbed edge_cloud_wan           # build, probe, leave it up
    python tools/testbed.py up --testbed ring3_edge --hold        # ... and remove it on Ctrl-C
    python tools/testbed.py status                                # live sessions and leftovers
    python tools/testbed.py exec edge1 -- python -c 'print(1)'    # run inside a host
    python tools/testbed.py down [--session S]                    # remove one session (or all)

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 and ethtool; without them it exits 2
naming what is missing. `up` prints the session id; `exec` and `down` pick the only live
session when `--session` is not given. Exit 2 also when a link probes more than the
tolerance off its nominal rate (the message names the link).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from splitlab.errors import ExitCode, SplitlabError
from splitlab.telemetry.log import leave
from splitlab.testbed.netns import TestbedError, missing_privileges
from splitlab.testbed.session import (
    Testbed,
    host_command,
    load_state,
    sessions,
    teardown,
)
from splitlab.testbed.topology import Layout


def _require() -> None:
    missing = missing_privileges()
    if missing:
        raise TestbedError("tools/testbed.py needs " + "; ".join(missing))


def _one_session(given: str | None) -> str:
    if given:
        return given
    live = sorted(sessions())
    if len(live) != 1:
        raise TestbedError(f"--session is needed: live sessions are {live or 'none'}")
    return live[0]


def cmd_up(args: argparse.Namespace) -> int:
    from splitlab.configure import compose_config
    from splitlab.testbed.topology import topology_from_config

    _require()
    cfg = compose_config([f"testbed={args.testbed}", *args.overrides])
    tb = Testbed(topology_from_config(cfg.testbed), probe=not args.no_probe)
    if args.hold:
        with tb:
            print(json.dumps(tb.record()), flush=True)
            while True:  # SIGINT / SIGTERM unwind through Testbed.__exit__
                signal.pause()
    try:
        tb.up()
    except BaseException:
        if tb.layout is not None:
            tb.down()
        raise
    print(json.dumps(tb.record()), flush=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    for s in sorted([args.session] if args.session else sessions()):
        state = load_state(s)
        print(json.dumps(state) if state else json.dumps({"session": s, "state": "leftovers"}))
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    _require()
    session = _one_session(args.session)
    state = load_state(session)
    if state is None:
        raise TestbedError(f"session {session} has no state file: it is not live (run `down`)")
    if args.host not in state["hosts"]:
        raise TestbedError(
            f"session {session} has no host {args.host!r} ({sorted(state['hosts'])})"
        )
    layout = Layout(session=session, subnet=state["subnet"], hosts=tuple(state["hosts"]))
    argv = host_command(layout, args.host, state["hosts"][args.host]["threads"], args.cmd)
    os.execvp(argv[0], argv)
    return 0  # not reached


def cmd_down(args: argparse.Namespace) -> int:
    _require()
    targets = [args.session] if args.session else sorted(sessions())
    failed = {}
    for s in targets:
        left = teardown(s)
        if left:
            failed[s] = left
        print(f"session {s}: " + (f"left {left}" if left else "removed"))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build and probe a testbed preset")
    up.add_argument("--testbed", default="edge_cloud_wan", help="an option of conf/testbed/")
    up.add_argument("--hold", action="store_true", help="stay in the foreground; remove on exit")
    up.add_argument("--no-probe", action="store_true", help="skip the start-up link probes")
    up.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. testbed.probe_s=1")
    st = sub.add_parser("status", help="live sessions (state files) and leftovers")
    st.add_argument("--session")
    ex = sub.add_parser("exec", help="run a command inside a host")
    ex.add_argument("--session")
    ex.add_argument("host")
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    dn = sub.add_parser("down", help="remove a session (every session without --session)")
    dn.add_argument("--session")
    args = parser.parse_args(argv)
    if args.command == "exec":
        args.cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not args.cmd:
            parser.error("exec needs a command after the host")
    logging.basicConfig(level=logging.INFO, format="[testbed] %(message)s")
    handlers = {"up": cmd_up, "status": cmd_status, "exec": cmd_exec, "down": cmd_down}
    try:
        return handlers[args.command](args)
    except SplitlabError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    except SystemExit as exc:  # a signal while holding: Testbed.__exit__ already removed it
        return ExitCode.OK if exc.code in (128 + signal.SIGINT, 128 + signal.SIGTERM) else 1


if __name__ == "__main__":
    leave(main())
