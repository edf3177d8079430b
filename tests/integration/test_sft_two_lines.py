"""The two-line SFT API between two processes over real TCP, for BERT, GPT-2 and Llama.

- training over the wire matches the same split trained in one process (loss per step);
- bytes at a compressed cut, read from the edge's transport counters, drop by ~H/R against
  the same cut uncompressed; residual=keep costs more than no compression at all.

The cloud is a spawned process that serves a list of sessions one after the other.

.venv/bin/pytest tests/integration/test_sft_two_lines.py -q
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from model_helpers import adapter_of, padded_batch, tiny_config, tiny_model

from splitlab import sft
from splitlab.models.families import INPUT_IDS, LABELS, PAD_MASK
from splitlab.models.load import load_model
from splitlab.models.lowrank import decompose_plan
from splitlab.models.parts import build_parts, group
from splitlab.models.tokens import positions_from_pad_mask

KEY = b"s" * 32
LR = 1e-2
WIDE = {"hidden_size": 64, "intermediate_size": 128}  # H/R = 16 at R = 4


def make_model(family: str, wide: bool) -> torch.nn.Module:
    if not wide:
        return tiny_model(family)
    cfg = tiny_config(family)
    for name, value in WIDE.items():
        setattr(cfg, name, value)
    torch.manual_seed(0)
    return load_model(cfg, load_tokenizer=False)[0]


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def cloud_main(paths: list[str], family: str, wide: bool, sessions: int, addresses: Any) -> None:
    sys.path[:0] = paths
    for _ in range(sessions):
        sft.serve(make_model(family, wide), key=KEY, make_optimizer=optimizer,
                  on_ready=addresses.put, timeout_s=60)  # fmt: skip


@pytest.fixture
def cloud(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Start a cloud process: `cloud(family, wide, sessions)` -> a queue of its addresses."""
    procs: list[mp.Process] = []
    ctx = mp.get_context("spawn")

    def start(family: str, wide: bool, sessions: int) -> Any:
        addresses = ctx.Queue()
        proc = ctx.Process(
            target=cloud_main, args=(list(sys.path), family, wide, sessions, addresses)
        )
        proc.start()
        procs.append(proc)
        return addresses

    yield start
    for proc in procs:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
        assert proc.exitcode == 0, f"cloud exited with {proc.exitcode}"


def train(model: Any, batch: dict[str, torch.Tensor], labels: torch.Tensor, steps: int) -> list:
    """The user's loop: nothing in it knows about the split."""
    opt = sft.SFTOptimizer(optimizer(model.parameters()), model)
    losses = []
    for _ in range(steps):
        loss = model(batch[INPUT_IDS], batch[PAD_MASK], labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def reference(family: str, spec: sft.SplitSpec, batch: dict, labels: torch.Tensor, steps: int):
    """The same split in one process, parts chained, one optimizer over every part."""
    model = tiny_model(family)
    plan = spec.plan()
    decompose_plan(model, plan)
    parts = build_parts(model, plan)
    opt = optimizer(group(parts).parameters())
    positions = positions_from_pad_mask(batch[PAD_MASK])
    losses = []
    for _ in range(steps):
        x: Any = batch[INPUT_IDS]
        for part in parts:
            x = part(x, batch[PAD_MASK], positions)
        loss = parts[0].adapter.loss(x, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    ("family", "factors"), [("bert", "two"), ("gpt2", "two"), ("llama", "two"), ("llama", "three")]
)
def test_two_process_u_shape_training_matches_one_process(
    family: str, factors: str, cloud: Any
) -> None:
    addresses = cloud(family, False, 1)
    batch = padded_batch(family)
    labels = adapter_of(family).labels(batch)
    split = {"layer": 0, "rank": 4, "residual": "drop", "cuts": "both", "tail_blocks": 1,
             "factors": factors}  # fmt: skip
    spec = sft.SplitSpec(family=adapter_of(family).name, num_layers=4, **split)

    model = sft.split(tiny_model(family), peer=addresses.get(timeout=120), key=KEY, **split)
    try:
        losses = train(model, batch, labels, steps=4)
    finally:
        model.close()
    expected = reference(family, spec, batch, labels, steps=4)

    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]


def cut_bytes_per_step(model: Any, batch: dict, labels: torch.Tensor, steps: int) -> float:
    """Bytes at the front cut per step, from the edge's counters: the frames it sends
    forward (code or hidden, + padding mask) and the gradients it gets back for them."""
    train(model, batch, labels, steps=1)  # the hello and the first step's warm-up
    before = model.counters()
    train(model, batch, labels, steps=steps)
    after = model.counters()
    keys = ("activation.bytes_sent", "gradient.bytes_recv")
    return sum(after[k] - before[k] for k in keys) / steps


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_bytes_at_a_low_rank_cut_drop_by_h_over_r(family: str, cloud: Any) -> None:
    rank, hidden = 4, WIDE["hidden_size"]
    addresses = cloud(family, True, 3)
    gen = torch.Generator().manual_seed(0)
    batch = {
        INPUT_IDS: torch.randint(0, 90, (8, 64), generator=gen),
        PAD_MASK: torch.ones(8, 64, dtype=torch.long),
        LABELS: torch.randint(0, 3, (8,), generator=gen),
    }
    labels = adapter_of(family).labels(batch)
    measured = {}
    for name, kwargs in {
        "uncompressed": {"rank": None},
        "drop": {"rank": rank, "residual": "drop"},
        "keep": {"rank": rank, "residual": "keep"},
    }.items():
        model = sft.split(make_model(family, True), peer=addresses.get(timeout=120), key=KEY,
                          layer=1, **kwargs)  # fmt: skip
        try:
            measured[name] = cut_bytes_per_step(model, batch, labels, steps=3)
        finally:
            model.close()

    ratio = measured["uncompressed"] / measured["drop"]
    # Per step: 2 frames of B x T x H (or R) float32, plus a 1-byte-per-token padding mask
    # and two JSON headers; the mask is what keeps the ratio a little under H/R.
    assert 0.85 * hidden / rank <= ratio <= hidden / rank, measured
    assert measured["keep"] > measured["uncompressed"], measured
