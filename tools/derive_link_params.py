"""Per-link alpha/beta from a ring run's traces: regress recv_wait[s] - compute[s-1] on bytes.

    .venv/bin/python tools/derive_link_params.py outputs/RUN/traces [--json]

Prints one row per link s-1 -> s. A link whose stages sit on one host (loopback) prints
NOT A LINK MEASUREMENT and the reason instead of numbers: there recv_wait is scheduling delay
and memcpy, not a network. Exits 0 whenever the traces could be read.
"""

from __future__ import annotations

import argparse
import json
import sys

from splitlab.analysis.links import derive_link_params, format_estimate
from splitlab.analysis.traces import load_traces


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", help="a run folder or its traces/ folder")
    parser.add_argument("--json", action="store_true", help="one JSON object per link instead")
    args = parser.parse_args(argv)
    estimates = derive_link_params(load_traces(args.traces))
    if not estimates:
        print(f"no ring links in {args.traces}: no token records from two adjacent stages")
    for estimate in estimates:
        if args.json:
            record = estimate.to_dict()
            if estimate.loopback:  # never hand a loopback number to a consumer that skims
                record.update(
                    alpha_ms=None, beta_ms_per_byte=None, warning="NOT A LINK MEASUREMENT"
                )
            print(json.dumps(record))
        else:
            print(format_estimate(estimate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
