"""planner=model on a live in-process ring: blocks leave the slow stage, tokens do not change.

Tiny Llama (9 blocks, cuts 3/6), stage 1 slowed 4x by a replayed `one_slow_node` trace, window 5.

    .venv/bin/pytest tests/equivalence/test_planner_model_ring.py -q
"""

from __future__ import annotations

import json

import torch

from splitlab.config.enums import DriftSource
from splitlab.config.schema import DriftConfig
from splitlab.drift.source import make_source
from splitlab.infer.planners import Calibration, ModelPlanner
from splitlab.infer.ring import GenParams
from splitlab.reference.tiny import local_ring

PROMPT = torch.tensor([[464, 3290, 286, 4881, 318, 257, 1588, 1748]])
CUTS = [3, 6]
GEN = GenParams(max_new_tokens=30)


def test_model_planner_moves_off_the_slow_stage_and_keeps_every_token(tiny9) -> None:
    plain, _ = local_ring(tiny9, CUTS, PROMPT, GEN)
    drift = DriftConfig(name="one_slow_node", source=DriftSource.replay, phi=4.0, length_tokens=40)
    drifts = [make_source(drift, stage=s, num_stages=3, run_id="t", run_dir=None) for s in range(3)]
    planner = ModelPlanner(calibration=Calibration(load_c1_ms=0.1, defaults=()), hysteresis=0.05)
    result, computes = local_ring(tiny9, CUTS, PROMPT, GEN, window=5, planner=planner,
                                  drifts=drifts)  # fmt: skip
    assert result.token_ids == plain.token_ids
    slow = computes[1]
    assert slow.span.stop - slow.span.start < 3
    moved = [w for w in result.windows if w["decision"].startswith("model: to")]
    assert moved, [w["decision"] for w in result.windows]
    # what the planner weighs a hop and a move with, from every stage's ACK
    hidden = 4 * json.loads((tiny9 / "config.json").read_text())["hidden_size"]  # fp32
    stats = result.windows[-1]["stats"]
    assert [stats[s]["send_bytes"] for s in ("0", "1", "2")] == [hidden, hidden, 8]
    kv = computes[0].bytes_per_token_kv()
    assert kv > 0 and all(stats[s]["kv_bytes_per_block_token"] == kv for s in ("0", "1", "2"))
    # each link's trend, from the first barrier on (the observation at decode start): flat here
    first = next(w["stats"] for w in result.windows if w["stats"])
    assert all(w[s]["link_rise_per_token"] == 0.0 for w in (first, stats) for s in ("0", "1", "2"))
    assert all(first[s]["link_obs_token"] == 5 for s in ("0", "1", "2"))  # the first barrier
