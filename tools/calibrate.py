"""Per-block decode/prefill cost models, weight load, swap, link and contention on this machine.

    .venv/bin/python tools/calibrate.py --quick --threads 1 --out /tmp/cal.json      # ~30 s
    .venv/bin/python tools/calibrate.py --out calibration.json                       # to 8192, ~1 min
    .venv/bin/python tools/calibrate.py --quick --schema_from other_device.json

A thin wrapper over `splitlab task=calibrate` (same code, same config): flags become
`task.*` overrides, `--model` and `--device` pick the model option and device. Prints the fits
with r^2 and every warning; the JSON is versioned and keyed by model|device|dtype.
"""

from __future__ import annotations

import argparse
import sys

from splitlab.analysis.calibrate import run_calibrate
from splitlab.cli import compose_config
from splitlab.telemetry.log import setup_logging


def overrides(args: argparse.Namespace) -> list[str]:
    out = ["task=calibrate", f"model={args.model}", f"device={args.device}"]
    if args.dtype:
        out.append(f"model.dtype={args.dtype}")
    for name in ("out", "max_context", "decode_steps", "prefill_min_tokens",
                 "probe_round_trips", "schema_from", "threads", "blocks"):  # fmt: skip
        value = getattr(args, name)
        if value is not None:
            out.append(f"task.{name}={value}")
    if args.quick:
        out.append("task.quick=true")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="auto, fp32 or bf16 (default: the model's)")
    parser.add_argument("--out", default=None, help="JSON path (default: RUN/calibration.json)")
    parser.add_argument("--quick", action="store_true", help="contexts to 2048, fewer sizes")
    parser.add_argument("--max_context", type=int, default=None)
    parser.add_argument("--decode_steps", type=int, default=None)
    parser.add_argument("--prefill_min_tokens", type=int, default=None)
    parser.add_argument("--probe_round_trips", type=int, default=None)
    parser.add_argument("--schema_from", default=None, help="diff keys against this file")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (0 = default)")
    parser.add_argument("--blocks", type=int, default=None, help="blocks timed together")
    args = parser.parse_args(argv)
    setup_logging("calibrate", 0)
    cfg = compose_config(overrides(args))
    if args.out is None:
        cfg.run_dir = "outputs/calibrate"
    return run_calibrate(cfg)


if __name__ == "__main__":
    sys.exit(main())
