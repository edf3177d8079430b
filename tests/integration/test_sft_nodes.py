"""Low-rank cuts (SFT) in the fine-tuning node processes: `splitlab` with `finetune.sft.enabled`,
real processes over loopback TCP and the embedded bus, one round, for BERT, GPT-2 and Llama.

Each run's checkpoint holds the trained factors under their own keys (`...lowrank_in.weight`,
`...lowrank_out.*`, and `...lowrank_out.sigma` in the three-factor form), FedAvg'd like every other trained tensor, and loads strictly into the
model the same config builds (`checkpoint_model`). Bytes on the front -> body lane, read from
the owner's transport counters in its trace, drop against the same run without the cut.

    .venv/bin/pytest tests/integration/test_sft_nodes.py -q
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from splitlab.configure import compose_config
from splitlab.launch.train import run_finetune
from splitlab.train.checkpoint import latest_checkpoint
from splitlab.train.final_eval import checkpoint_model

ONE_BY_ONE = [
    "architecture.owners=1",
    "architecture.workers=1",
    "data.samples_per_owner=8",
    "data.val_samples=8",
    "data.test_samples=0",  # the final evaluation on the held-out split
    "task.steps_per_round=0",  # one pass over the tiny shard
    "finetune.batch_size=4",
    "task.rounds=1",
]
FAMILIES = {
    "tiny_bert": ["model=tiny_bert"],
    "tiny_gpt2": ["model=tiny_gpt2", "data=gsm_symbolic", "data.max_length=64"],
    "tiny_llama": ["model=tiny_llama", "data=gsm_symbolic", "data.max_length=64"],
}
SFT = ["finetune.sft.enabled=true", "finetune.sft.rank=4", "finetune.sft.residual=drop"]


def run(tmp_path: Path, name: str, *overrides: str):
    cfg = compose_config([*ONE_BY_ONE, *overrides])
    cfg.run_dir = str(tmp_path / name)
    assert run_finetune(cfg) == 0
    return cfg, Path(cfg.run_dir)


def owner_counters(run_dir: Path) -> dict[str, int]:
    lines = (run_dir / "traces" / "owner-0.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "transport"][-1]


@pytest.mark.slow
@pytest.mark.assets
@pytest.mark.parametrize(
    ("model", "form"), [*((m, "two") for m in sorted(FAMILIES)), ("tiny_bert", "three")]
)
def test_sft_nodes_train_and_checkpoint_the_factors(tmp_path: Path, model: str, form: str) -> None:
    cfg, run_dir = run(tmp_path, "sft", *FAMILIES[model], *SFT, f"finetune.sft.factors={form}")

    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [(r["round"], r["owner"], r["samples"]) for r in rows] == [("1", "owner0", "8")]
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None
    factors = sorted(k for k in checkpoint.state if ".lowrank_" in k)
    assert factors and any(k.endswith("lowrank_in.weight") for k in factors), factors
    fresh, _ = checkpoint_model(cfg)  # the SVD initialisation the same config builds
    initial = {k: t.clone() for k, t in fresh.state_dict().items()}
    fresh.load_state_dict(checkpoint.state, strict=True)
    assert all(torch.isfinite(t).all() for t in checkpoint.state.values())
    code = next(k for k in factors if k.endswith("lowrank_in.weight"))
    assert checkpoint.state[code].shape[0] == 4  # R x H
    assert not torch.equal(checkpoint.state[code], initial[code])  # trained, averaged, saved
    sigmas = [k for k in factors if k.endswith("lowrank_out.sigma")]  # S_R on the receiver
    assert len(sigmas) == (1 if form == "three" else 0), factors
    assert all(not torch.equal(checkpoint.state[k], initial[k]) for k in sigmas)


@pytest.mark.slow
@pytest.mark.assets
def test_sft_cut_shrinks_the_front_to_body_lane(tmp_path: Path) -> None:
    _, plain = run(tmp_path, "plain", *FAMILIES["tiny_bert"])
    _, compressed = run(tmp_path, "sft", *FAMILIES["tiny_bert"], *SFT)

    before, after = owner_counters(plain), owner_counters(compressed)
    # owner -> worker activations (training and validation frames) carry code_BTR (R=4) and
    # the padding mask instead of hidden_BTH (H=32); the body -> tail lane is not cut.
    assert after["activation.bytes_sent"] * 3 < before["activation.bytes_sent"], (before, after)
    ratio = after["activation.bytes_recv"] / before["activation.bytes_recv"]
    assert 0.9 < ratio < 1.1, (before, after)
