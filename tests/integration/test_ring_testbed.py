"""The ring on a 3-host testbed: each stage inside its host, the same tokens as one process.

Needs root (marker `testbed`): namespaces, shaped links and cgroups for real.

    .venv/bin/pytest tests/integration/test_ring_testbed.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from splitlab.configure import compose_config
from splitlab.infer.ring import GenParams
from splitlab.launch.ring import run_ring
from splitlab.reference.tiny import reference_tokens
from splitlab.testbed import cgroup, netns, placement, session

PROMPT_IDS = [464, 3290, 286, 4881, 318, 257, 1588, 1748]
TOKENS = 12


def _leftovers(s: str) -> list[str]:
    left = [f"netns {n}" for n in netns.list_netns() if n.startswith(f"sl-{s}-")]
    left += [f"link {n}" for n in netns.root_links(f"sl{s}")]
    left += [f"cgroup {c}" for c in cgroup.CONTROLLERS
             if (cgroup.CGROUP_ROOT / c / f"splitlab-{s}").exists()]  # fmt: skip
    return left + [f"pid {p}" for p in session.session_pids(s)]


def _records(run_dir, stage: int) -> list[dict]:
    path = run_dir / "traces" / f"stage-{stage}.jsonl"
    return [json.loads(line) for line in path.open()]


@pytest.mark.testbed
def test_ring_on_ring3_edge_matches_one_process_and_leaves_nothing(tmp_path) -> None:
    # a 2 ms delay on dev1's link: the stages' paths to and from dev1 go through a delay line;
    # the live drift source samples each host's kernel figures into its window records
    cfg = compose_config([
        "task=infer", "model=tiny_llama", "architecture.cuts=[1,3]", "testbed=ring3_edge",
        f"task.prompt_ids=[{','.join(map(str, PROMPT_IDS))}]", f"task.max_new_tokens={TOKENS}",
        "architecture.window=4", "testbed.links.dev1.delay_ms=2", "testbed.probe_s=0.3",
        "drift=live",
    ])  # fmt: skip
    group, result = run_ring(cfg, run_dir=tmp_path, timeout_s=240)
    assert group.exit_code == 0, group.diagnosis()
    assert result is not None
    ref = reference_tokens(tmp_path / "checkpoint", torch.tensor([PROMPT_IDS]),
                           GenParams(max_new_tokens=TOKENS))  # fmt: skip
    assert result["token_ids"] == ref

    record = json.loads((tmp_path / placement.RECORD_FILE).read_text())
    hosts = record["hosts"]
    for i, host in enumerate(["dev0", "dev1", "dev2"]):
        records = _records(tmp_path, i)
        meta = next(r for r in records if r["kind"] == "stage_meta")
        # the host's address exists only inside its namespace: binding it means running there
        assert (meta["testbed_host"], meta["host"]) == (host, hosts[host]["address"])
        links = next(r for r in records if r["kind"] == "links")
        assert links["down"].split(":")[0] == hosts[f"dev{(i + 1) % 3}"]["address"]
        windows = [r for r in records if r["kind"] == "window"]
        assert windows and all(w["kernel"]["cpu_quota_cores"] == 0.5 for w in windows)
        assert all(w["kernel"]["link_rate_mbit"] == 100.0 for w in windows)
        wire = next(r for r in records if r["kind"] == "transport")
        assert wire["activation.frames_sent"] > TOKENS  # per-frame counters reach the trace
        # every stage has a path to or from dev1, so every stage sends through a delay line
        assert wire["delay_source"] == "transport"
    assert record["links"]["dev1"]["delay_source"] == "transport"
    assert record["links"]["dev0"]["probed"]["up_mbit"] > 0
    # the control star crosses the same links: PROPOSE to dev1 and its ACK back each take the
    # 2 ms path delay, so the head reads stage 1's answer no sooner than 4 ms after proposing
    head_windows = [r for r in _records(tmp_path, 0) if r["kind"] == "window"]
    assert head_windows and all(w["answer_ms"]["1"] >= 4.0 for w in head_windows), head_windows
    assert _leftovers(record["session"]) == []


@pytest.mark.testbed
def test_cpu_throttle_cuts_the_hosts_quota_mid_run_and_keeps_the_tokens(tmp_path) -> None:
    # drift=cpu_throttle on a testbed is real: at token 4 the launcher writes dev1's cgroup
    # quota down to 0.5 / 5 = 0.1 core while the stages run, and puts it back afterwards
    tokens = 16
    cfg = compose_config([
        "task=infer", "model=tiny_llama", "architecture.cuts=[1,3]", "testbed=ring3_edge",
        f"task.prompt_ids=[{','.join(map(str, PROMPT_IDS))}]", f"task.max_new_tokens={tokens}",
        "architecture.window=4", "testbed.probe_s=0.3", "drift=cpu_throttle", "drift.phi=5",
        "drift.period_tokens=4", "drift.slow_stage=1", f"drift.length_tokens={tokens + 4}",
    ])  # fmt: skip
    with placement.testbed_for(cfg.testbed) as tb:
        assert tb is not None
        group, result = run_ring(cfg, run_dir=tmp_path, timeout_s=240, testbed=tb)
        assert group.exit_code == 0, group.diagnosis()
        assert tb.cpu("dev1") == pytest.approx(0.5)  # back to nominal for the next run
    assert result is not None
    ref = reference_tokens(tmp_path / "checkpoint", torch.tensor([PROMPT_IDS]),
                           GenParams(max_new_tokens=tokens))  # fmt: skip
    assert result["token_ids"] == ref

    applied = [json.loads(line) for line in (tmp_path / "drift" / "kernel.jsonl").open()]
    assert [(a["token"], a["host"], a["kind"]) for a in applied] == [(4, "dev1", "cpu")]
    assert applied[0]["cpu_readback"] == pytest.approx(0.1)  # the cgroup file, read back
    head = [r for r in _records(tmp_path, 0) if r["kind"] == "token"]
    # applied mid-run: the head decoded tokens both before and after the write
    stamps = [r["ts_us"] for r in head]
    assert min(stamps) < applied[0]["wall_s"] * 1e6 < max(stamps)
    for i in range(3):
        meta = next(r for r in _records(tmp_path, i) if r["kind"] == "stage_meta")
        assert meta["drift_applied"] == "kernel"
