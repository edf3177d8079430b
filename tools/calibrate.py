"""Per-block decode/prefill cost models, weight load, swap, link and contention on this machine.

    .venv/bin/python tools/calibrate.py --quick --threads 1 --out /tmp/cal.json      # ~30 s
    .venv/bin/python tools/calibrate.py --out calibration.json                       # to 8192, ~1 min
    .venv/bin/python tools/calibrate.py --quick --schema_from other_device.json
    .venv/bin/python tools/calibrate.py --only decode,load --contexts 128,2048,8192 --out cal.json
    .venv/bin/python tools/calibrate.py --quick --testbed edge_cloud_wan --host edge1   (root)

A thin wrapper over `splitlab task=calibrate` (same code, same config): flags become
`task.*` overrides, `--model` and `--device` pick the model option and device. Prints the fits
with r^2 and every warning; the JSON is versioned and keyed by model|device|dtype.

With `--testbed NAME --host HOST` the tool builds the testbed (probing its links), re-runs
itself inside HOST (its namespace, CPU budget and threads) and turns that record into the
calibration of the emulated device (`splitlab.measure.calibrate.on_testbed`): the link is the
host's probed link, and `calibrated` is true. The record also names the testbed and host.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from splitlab.analysis.fits import CalibrationResult
from splitlab.configure import compose_config
from splitlab.errors import ConfigError, tool_exit
from splitlab.measure.calibrate import (
    PROBES,
    CalibrateOutcome,
    on_testbed,
    run_calibrate,
    summary_lines,
    write_record,
)
from splitlab.telemetry.log import leave, setup_logging


def overrides(args: argparse.Namespace) -> list[str]:
    out = ["task=calibrate", f"model={args.model}", f"device={args.device}"]
    if args.dtype:
        out.append(f"model.dtype={args.dtype}")
    for name in ("out", "max_context", "decode_steps", "prefill_min_tokens",
                 "probe_round_trips", "schema_from", "threads", "blocks"):  # fmt: skip
        value = getattr(args, name)
        if value is not None:
            out.append(f"task.{name}={value}")
    for name in ("only", "contexts"):
        values = getattr(args, name)
        if values:
            out.append(f"task.{name}=[{','.join(map(str, values))}]")
    if args.quick:
        out.append("task.quick=true")
    return out


def probe_list(text: str) -> list[str]:
    """`--only decode,load`: probe names, each one of `PROBES`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PROBES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(PROBES)}")
    return names


def int_list(text: str) -> list[int]:
    """`--contexts 128,2048,8192`: positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers >= 1")
    return values


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` less each `--flag VALUE` / `--flag=VALUE` of `flags`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f"{f}=" for f in flags)):
            out.append(arg)
    return out


def run_on_testbed(args: argparse.Namespace, argv: list[str]) -> int:
    """Calibrate inside testbed host `args.host`; see the module docstring."""
    from splitlab.testbed.placement import fetch_node_assets, testbed_for

    cfg = compose_config([f"testbed={args.testbed}", f"model={args.model}"])
    if args.host not in (cfg.testbed.hosts or {}):
        hosts = sorted(cfg.testbed.hosts or {})
        raise ConfigError(f"--host {args.host!r}: not a host of testbed {args.testbed} {hosts}")
    fetch_node_assets(cfg)  # here: a testbed host has no route to the package registry
    out = Path(args.out or "outputs/calibrate/calibration.json")
    with testbed_for(cfg.testbed) as tb:
        assert tb is not None  # the testbed has hosts: --host is one
        with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
            inner = [sys.executable, str(Path(__file__).resolve()),
                     *_without(argv, ("--testbed", "--host", "--out")), "--out", f"{tmp}/cal.json"]  # fmt: skip
            code = tb.spawn(args.host, inner).wait()
            if code != 0:
                return code
            (raw,) = json.loads(Path(tmp, "cal.json").read_text())["records"].values()
        testbed = tb.record()
    result = on_testbed(CalibrationResult.from_dict(raw), host=args.host, testbed=testbed)
    extra = {k: v for k, v in raw.items() if k not in result.to_dict()}
    extra["testbed"] = {"name": testbed["testbed"], "host": args.host, "hosts": testbed["hosts"],
                        "links": testbed["links"]}  # fmt: skip
    write_record(out, result, extra)
    for line in summary_lines(CalibrateOutcome(path=out, result=result)):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="auto, fp32 or bf16 (default: the model's)")
    parser.add_argument("--out", default=None, help="JSON path (default: RUN/calibration.json)")
    parser.add_argument("--quick", action="store_true", help="contexts to 2048, fewer sizes")
    parser.add_argument(
        "--only",
        type=probe_list,
        default=None,
        help=f"comma-separated probes to run, of {','.join(PROBES)} (default: all)",
    )
    parser.add_argument("--contexts", type=int_list, default=None,
                        help="comma-separated decode contexts in tokens (>= 3; replaces the "
                        "geometric set up to --max_context)")  # fmt: skip
    parser.add_argument("--max_context", type=int, default=None)
    parser.add_argument("--decode_steps", type=int, default=None)
    parser.add_argument("--prefill_min_tokens", type=int, default=None)
    parser.add_argument("--probe_round_trips", type=int, default=None)
    parser.add_argument("--schema_from", default=None, help="diff keys against this file")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (0 = default)")
    parser.add_argument("--blocks", type=int, default=None, help="blocks timed together")
    parser.add_argument("--testbed", default=None, help="calibrate inside a host of this testbed")
    parser.add_argument("--host", default=None, help="the testbed host (with --testbed)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The tool; a SplitlabError (a bad key, a testbed without root) is one line and its code."""
    return tool_exit("calibrate", lambda: _calibrate(sys.argv[1:] if argv is None else argv))


def _calibrate(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("calibrate", 0)
    if args.testbed:
        if not args.host:
            parser.error("--testbed needs --host")
        return run_on_testbed(args, argv)
    cfg = compose_config(overrides(args))
    if args.out is None:
        cfg.run_dir = "outputs/calibrate"
    return run_calibrate(cfg)


if __name__ == "__main__":
    leave(main())
