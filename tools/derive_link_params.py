"""Per-link figures from a run's traces: ring alpha/beta, and a testbed's measured paths.

    .venv/bin/python tools/derive_link_params.py outputs/RUN/traces [--json]

For a run on a testbed (RUN/testbed.json), first one row per shaped path that carried large
frames: the rate its receiver timed and the delay its sender's delay line added, beside the
nominal figures (analysis/links.py `shaped_paths`; any run, fine-tuning or ring). Then, for a
ring, one row per link s-1 -> s: alpha/beta regressed from recv_wait[s] - compute[s-1] on bytes. A link whose stages sit on one host (loopback) prints
NOT A LINK MEASUREMENT and the reason instead of numbers: there recv_wait is scheduling delay
and memcpy, not a network. Exits 0 whenever the traces could be read.
"""

from __future__ import annotations

import argparse
import json

from splitlab.analysis.links import derive_link_params, format_estimate, format_path, shaped_paths
from splitlab.analysis.traces import load_traces, traces_dir
from splitlab.errors import tool_exit
from splitlab.telemetry.log import leave
from splitlab.testbed.placement import RECORD_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", help="a run folder or its traces/ folder")
    parser.add_argument("--json", action="store_true", help="one JSON object per link instead")
    args = parser.parse_args(argv)
    frame = load_traces(args.traces)
    testbed = traces_dir(args.traces).parent / RECORD_FILE
    paths = shaped_paths(frame, json.loads(testbed.read_text())) if testbed.is_file() else []
    for path in paths:
        print(json.dumps(path.to_dict()) if args.json else format_path(path))
    estimates = derive_link_params(frame)
    if not estimates and not paths:
        print(f"no links in {args.traces}: no timed testbed paths, no token records from two "
              "adjacent ring stages")  # fmt: skip
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
    leave(tool_exit("derive_link_params", main))
