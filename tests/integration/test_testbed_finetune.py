"""The main job's launcher on a testbed: every role inside its host, over shaped links.

Needs root (marker `testbed`; fails rather than skips under SPLITLAB_REQUIRE_TESTBED=1).

    .venv/bin/pytest tests/integration/test_testbed_finetune.py -q
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from test_finetune_task import TINY
from test_testbed import _leftovers

from splitlab.configure import compose_config
from splitlab.launch.train import run_finetune
from splitlab.testbed import placement, session

# edge_cloud_wan's placement with a faster link, so the tiny job stays short; the delay stays
SHAPED = [
    "testbed=edge_cloud_wan",
    "testbed.links.edge1.up_mbit=50", "testbed.links.edge1.down_mbit=50",
    "testbed.links.edge2.up_mbit=50", "testbed.links.edge2.down_mbit=50",
    "testbed.links.edge2.delay_ms=10.0",
]  # fmt: skip


def _records(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


@pytest.mark.slow
@pytest.mark.testbed
def test_finetune_runs_each_role_inside_its_host_and_leaves_nothing(tmp_path: Path) -> None:
    cfg = compose_config([*TINY, *SHAPED])
    cfg.run_dir = str(tmp_path / "run")
    before = session.sessions()

    code = run_finetune(cfg)

    run_dir = Path(cfg.run_dir)
    assert code == 0, (run_dir / "logs" / "owner0.log").read_text()[-2000:]
    record = json.loads((run_dir / placement.RECORD_FILE).read_text())
    s = record["session"]
    assert s not in before and s not in session.sessions()
    assert _leftovers(s) == []
    addr = {h: record["hosts"][h]["address"] for h in ("edge1", "edge2", "cloud")}
    assert record["links"]["edge1"]["nominal"]["up_mbit"] == 50
    assert record["links"]["edge1"]["probed"]["up_mbit"] == pytest.approx(50, rel=0.1)
    assert record["links"]["edge2"]["delay_source"] == "transport"
    # each role bound (or dialled) its host's address: only possible inside that namespace
    logs = run_dir / "logs"
    worker_at = f"worker0: data plane at {addr['cloud']}:"
    assert worker_at in (logs / "worker0.log").read_text()
    for rank, host in enumerate(("edge1", "edge2")):
        text = (logs / f"owner{rank}.log").read_text()
        assert f"owner{rank}: data plane at {addr[host]}:" in text
        assert f"owner{rank}: dialling worker0 at {addr['cloud']}:" in text
    # the delay line of each owner's path to the cloud is the topology's (edge1 25 ms, edge2 10)
    for rank, delay_ms in ((0, 25.0), (1, 10.0)):
        (wire,) = _records(run_dir / "traces" / f"owner-{rank}.jsonl", "transport")
        assert wire["delay_source"] == "transport"
        assert wire["path_delay_ms"]["worker0"] == delay_ms
    (wire,) = _records(run_dir / "traces" / "worker-0.jsonl", "transport")
    assert wire["path_delay_ms"] == {"owner0": 25.0, "owner1": 10.0}
    # control crosses the same links: each owner's bus requests and replies wait out its path
    for rank, delay_ms in ((0, 25.0), (1, 10.0)):
        (ctl,) = _records(run_dir / "traces" / f"owner-{rank}.jsonl", "control_link")
        assert ctl["via"] == "bus delay line" and ctl["delay_source"] == "transport"
        assert ctl["path_delay_ms"] == {"bus": delay_ms}
        assert ctl["held_ms"]["bus"]["min_ms"] >= delay_ms
    (ctl,) = _records(run_dir / "traces" / "worker-0.jsonl", "control_link")
    assert ctl.get("delay_source") is None  # the worker shares the coordinator's (the bus's) host
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert len(rows) == 4 and all(int(r["bytes"]) > 0 for r in rows)
