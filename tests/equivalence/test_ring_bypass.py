"""A stage left without blocks is skipped and changes no token (`architecture.bypass`).

Tiny Llama, 9 blocks, 3 stages at cuts [3, 6], a barrier every 5 tokens: at token 10 stage 1
gives its three blocks to stage 0 (cuts [6, 6]); the ring then runs head -> tail directly
while stage 1 waits on the control star; at token 20 it takes them back (cuts [3, 6]). In
process (threads) and over TCP (three stage processes), against the ring that never moves.

    .venv/bin/pytest tests/equivalence/test_ring_bypass.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from splitlab.config.enums import DriftSource
from splitlab.config.schema import DriftConfig
from splitlab.configure import compose_config
from splitlab.drift.source import make_source
from splitlab.errors import ConfigError
from splitlab.infer.planners import Adaptive, Scripted
from splitlab.infer.ring import GenParams
from splitlab.launch.ring import run_ring
from splitlab.reference.tiny import local_ring
from splitlab.telemetry.trace import Tracer

PROMPT = torch.tensor([[464, 3290, 286, 4881, 318, 257, 1588, 1748]])
CUTS = [3, 6]
GEN = GenParams(max_new_tokens=30)
OUT_AND_BACK = [(10, 1, 3), (20, 1, -3)]  # (at token, boundary, k): empty stage 1, then refill


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def test_in_process_a_stage_emptied_and_refilled_keeps_every_token(
    tiny9, noshift, tmp_path
) -> None:
    tracers = [Tracer.open(tmp_path / f"stage-{i}.jsonl", role="stage", rank=i) for i in range(3)]
    planner = Scripted([*OUT_AND_BACK], bypass=True)
    result, computes = local_ring(tiny9, CUTS, PROMPT, GEN, window=5, tracers=tracers,
                                  planner=planner, bypass=True)  # fmt: skip
    for t in tracers:
        t.close()
    assert result.token_ids == noshift
    assert [w["cuts"] for w in result.windows] == [[3, 6], [6, 6], [6, 6], [3, 6], [3, 6]]
    assert [c.span.start for c in computes[1:]] == CUTS and computes[1].layer_ids == [3, 4, 5]
    tokens = [r["token"] for r in _records(tmp_path / "stage-1.jsonl") if r["kind"] == "token"]
    assert tokens == [*range(0, 11), *range(21, 30)]  # skipped for decode steps 11..20
    tail = [r["token"] for r in _records(tmp_path / "stage-2.jsonl") if r["kind"] == "token"]
    assert tail == list(range(30))
    stage1 = [r for r in _records(tmp_path / "stage-1.jsonl") if r["kind"] == "window"]
    assert [w["token"] for w in stage1] == [5, 10, 15, 20, 25]  # every barrier, skipped or not


def test_in_process_a_stage_left_empty_to_the_end_stops_with_the_ring(tiny9, noshift) -> None:
    result, computes = local_ring(tiny9, CUTS, PROMPT, GEN, window=5, bypass=True,
                                  planner=Scripted([(10, 2, -3)], bypass=True))  # fmt: skip
    assert result.token_ids == noshift
    assert computes[1].layer_ids == [] and computes[2].layer_ids == [3, 4, 5, 6, 7, 8]


def test_in_process_four_stages_a_skipped_stage_not_next_to_the_head_stops_with_the_ring(
    tiny9, noshift
) -> None:
    # stage 2 of 4 emptied into stage 1: the head sends to stage 1 as before, and at the end
    # (token 29, not a barrier) it must still CLOSE the star for stage 2 to stop
    result, computes = local_ring(tiny9, [2, 4, 6], PROMPT, GEN, window=5, bypass=True,
                                  planner=Scripted([(10, 2, 2)], bypass=True))  # fmt: skip
    assert result.token_ids == noshift
    assert [c.layer_ids for c in computes] == [[0, 1], [2, 3, 4, 5], [], [6, 7, 8]]


def test_without_bypass_a_shift_that_empties_a_stage_is_refused() -> None:
    with pytest.raises(ConfigError, match="leaves a stage without blocks"):
        Scripted([(10, 1, 3)]).decide(_view())


def _view():
    from splitlab.infer.planners import WindowView

    return WindowView(token=10, cuts=(3, 6), num_layers=9)


def test_adaptive_routes_around_a_stage_whose_link_degrades_and_keeps_every_token(
    tiny9, noshift
) -> None:
    drift = DriftConfig(name="link_degrade", source=DriftSource.replay, phi=20.0, slow_stage=1,
                        length_tokens=40)  # fmt: skip
    drifts = [make_source(drift, stage=s, num_stages=3, run_id="t", run_dir=None) for s in range(3)]
    result, computes = local_ring(tiny9, CUTS, PROMPT, GEN, window=5, drifts=drifts,
                                  planner=Adaptive(bypass=True), bypass=True)  # fmt: skip
    assert result.token_ids == noshift
    assert computes[1].layer_ids == [] and computes[0].layer_ids + computes[2].layer_ids == list(
        range(9)
    )
    around = [w for w in result.windows if "route around stage 1" in w["decision"]]
    assert len(around) == 1, [w["decision"] for w in result.windows]


def _tcp_ring(tiny9, cuts: list[int], script: str, run_dir, noshift: list[int]) -> None:
    """The ring over TCP, one stage process per loopback address, with `script`'s shifts;
    asserts it ran to the end with the unmoved ring's tokens."""
    hosts = [f"127.0.0.{i + 1}" for i in range(len(cuts) + 1)]
    cfg = compose_config([
        "task=infer", "model=tiny_llama", "model.num_layers=9", "model.source=hub",
        f"model.id={tiny9}", f"architecture.cuts=[{','.join(map(str, cuts))}]",
        "architecture.window=5", "architecture.bypass=true",
        f"architecture.peer_hosts=[{','.join(hosts)}]", f"task.max_new_tokens={GEN.max_new_tokens}",
        f"task.prompt_ids=[{','.join(map(str, PROMPT[0].tolist()))}]",
    ])  # fmt: skip
    group, result = run_ring(cfg, run_dir=run_dir, timeout_s=240,
                             stage_args={0: ["--scripted-shifts", script]})  # fmt: skip
    assert group.exit_code == 0, group.diagnosis()
    assert result is not None and result["token_ids"] == noshift


@pytest.mark.slow
def test_tcp_a_stage_emptied_and_refilled_keeps_every_token(tiny9, noshift, tmp_path) -> None:
    script = ",".join(f"{t}:{b}:{k}" for t, b, k in OUT_AND_BACK)
    _tcp_ring(tiny9, CUTS, script, tmp_path, noshift)
    head = [r for r in _records(tmp_path / "traces" / "stage-0.jsonl") if r["kind"] == "window"]
    assert [w["cuts"] for w in head] == [[3, 6], [6, 6], [6, 6], [3, 6], [3, 6]]
    skipped = [r["token"] for r in _records(tmp_path / "traces" / "stage-1.jsonl")
               if r["kind"] == "token"]  # fmt: skip
    assert skipped == [*range(0, 11), *range(21, 30)]


@pytest.mark.slow
def test_tcp_four_stages_route_over_a_connection_dialled_at_start(tiny9, noshift, tmp_path) -> None:
    # stage 2 of 4 emptied: stage 1 then sends to stage 3 over the connection bypass dials
    _tcp_ring(tiny9, [2, 4, 6], "10:2:2", tmp_path, noshift)
    tail = [r for r in _records(tmp_path / "traces" / "stage-3.jsonl") if r["kind"] == "transport"]
    assert tail and tail[-1]["activation.frames_recv"] > GEN.max_new_tokens
