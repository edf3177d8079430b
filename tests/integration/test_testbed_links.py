"""derive_link_params on a short fine-tuning run on a testbed: each shaped path's measured rate
is within 10% of the nominal one, and the delay line's measured hold within 10% of its delay.

Needs root (marker `testbed`; fails rather than skips under SPLITLAB_REQUIRE_TESTBED=1).

    .venv/bin/pytest tests/integration/test_testbed_links.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_finetune_task import TINY

from splitlab.configure import compose_config
from splitlab.launch.train import run_finetune

ROOT = Path(__file__).resolve().parents[2]
# activations of ~1 MiB per microbatch (16 x 64 x 256 floats), so frames outlast the bucket's
# burst; edge1 at 20 Mbit/s, edge2 at 30 Mbit/s and 10 ms, to tell the paths apart
BIG_CUT = ["model.hidden_size=256", "model.intermediate_size=256", "finetune.batch_size=16",
           "data.samples_per_owner=32", "task.rounds=1", "data.max_length=64"]  # fmt: skip
SHAPED = ["testbed=edge_cloud_wan", "testbed.links.edge2.up_mbit=30",
          "testbed.links.edge2.down_mbit=30", "testbed.links.edge2.delay_ms=10.0"]  # fmt: skip
EXPECTED = {("edge1", "cloud"): 20.0, ("cloud", "edge1"): 20.0,
            ("edge2", "cloud"): 30.0, ("cloud", "edge2"): 30.0}  # fmt: skip


@pytest.mark.testbed
def test_derive_link_params_recovers_each_shaped_rate_from_a_testbed_run(tmp_path: Path) -> None:
    cfg = compose_config([*TINY, *BIG_CUT, *SHAPED])
    cfg.run_dir = str(tmp_path / "run")
    assert run_finetune(cfg) == 0

    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "derive_link_params.py"), cfg.run_dir, "--json"],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    print(out.stdout)  # the measured paths, shown with -s or on failure
    assert "NOT A LINK MEASUREMENT" not in out.stdout
    paths = [json.loads(line) for line in out.stdout.splitlines()]
    seen = {(p["src_host"], p["dst_host"]): p for p in paths}
    assert set(seen) == set(EXPECTED), out.stdout
    for hosts, nominal in EXPECTED.items():
        path = seen[hosts]
        assert path["nominal_mbit"] == nominal
        assert path["rate_mbit"] == pytest.approx(nominal, rel=0.1), path
        assert path["delay_ms"] == pytest.approx(path["nominal_delay_ms"], rel=0.1), path
