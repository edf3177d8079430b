"""One CSV row per multirun job (overrides + key figures), one plot and a sweep report.html.

    .venv/bin/python tools/aggregate_sweep.py outputs/multirun/DATE/TIME
    .venv/bin/python tools/aggregate_sweep.py SWEEP --x finetune.sft.rank --y test_accuracy \
        --label architecture.cut_layers

Writes SWEEP/sweep.csv, SWEEP/sweep.png and SWEEP/report.html (the jobs side by side, formatted
as a run's report is); prints the paths and the table.
"""

from __future__ import annotations

import argparse

from splitlab.analysis.sweep import write_aggregate
from splitlab.errors import tool_exit
from splitlab.telemetry.log import leave


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", help="a multirun folder (hydra.sweep.dir)")
    parser.add_argument("--x", default=None, help="override on the x axis (default: first varying)")
    parser.add_argument("--y", default=None, help="metric (default: the first the jobs hold)")
    parser.add_argument("--label", default=None, help="override drawn as one line per value")
    args = parser.parse_args(argv)
    result = write_aggregate(args.sweep_dir, x=args.x, y=args.y, label=args.label)
    print(result.table.to_string(index=False, max_cols=12))
    print(f"csv: {result.csv}")
    print(f"plot: {result.plot}" if result.plot else f"plot: none (x={result.x}, y={result.y})")
    print(f"report: {result.report}")
    return 0


if __name__ == "__main__":
    leave(tool_exit("aggregate_sweep", main))
