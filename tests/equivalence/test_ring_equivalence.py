"""The ring generates exactly the tokens of one process (shard loader vs whole-model oracle)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_helpers import model_option

from splitlab.infer.compute import PartCompute
from splitlab.infer.local import decode_in_turn
from splitlab.infer.ring import GenParams
from splitlab.models.plan import ring_plan
from splitlab.models.shard import load_part, open_checkpoint
from splitlab.reference.tiny import local_ring, reference_tokens, save_tiny

PROMPT = torch.tensor([[464, 3290, 286, 4881, 318, 257, 1588, 1748]])
CUTS = {
    "three-stages": [1, 3],
    "two-stages": [2],
    "one-block-each": [1, 2, 3],
    "one-block-head": [1],
    "one-block-tail": [3],
}


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gpt2"])
def checkpoint(request, tmp_path_factory):
    return save_tiny(model_option(request.param), tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("cuts", CUTS.values(), ids=CUTS.keys())
def test_greedy_tokens_identical(checkpoint, cuts: list[int]) -> None:
    gen = GenParams(max_new_tokens=24)
    ring, _ = local_ring(checkpoint, cuts, PROMPT, gen)
    assert ring.token_ids == reference_tokens(checkpoint, PROMPT, gen)


def test_seeded_sampling_identical(checkpoint) -> None:
    gen = GenParams(max_new_tokens=16, temperature=0.9, top_k=50, seed=3)
    ring, _ = local_ring(checkpoint, [1, 3], PROMPT, gen)
    assert ring.token_ids == reference_tokens(checkpoint, PROMPT, gen)


def test_stops_at_eos(checkpoint) -> None:
    first = reference_tokens(checkpoint, PROMPT, GenParams(max_new_tokens=4))
    gen = GenParams(max_new_tokens=20, eos_ids=(first[2],))
    ring, _ = local_ring(checkpoint, [1, 3], PROMPT, gen)
    assert ring.stop_reason == "eos"
    assert ring.token_ids == first[: first.index(first[2]) + 1]


def test_stages_in_turn_decode_the_reference_tokens(checkpoint) -> None:
    """bench_ring's middle arm: the ring's parts called in turn, no ring, same tokens."""
    index = open_checkpoint(checkpoint)
    spans = ring_plan(index.family.num_layers(index.config), [1, 3])
    parts = [PartCompute(load_part(index, span)[0]) for span in spans]
    gen = GenParams(max_new_tokens=12)
    result, compute = decode_in_turn(parts, PROMPT, gen)
    assert result.token_ids == reference_tokens(checkpoint, PROMPT, gen)
    assert len(compute) == 11 and all(len(c) == 3 and min(c) > 0 for c in compute)


@pytest.mark.assets
@pytest.mark.slow
def test_smollm2_three_hosts_64_tokens() -> None:
    """SmolLM2, 3 stage processes bound to 127.0.0.1/.2/.3, 64 new tokens, every id identical."""
    tool = Path(__file__).resolve().parents[2] / "tools" / "check_equivalence.py"
    argv = [sys.executable, str(tool), "task.max_new_tokens=64", "architecture.cuts=[10,20]",
            "architecture.peer_hosts=[127.0.0.1,127.0.0.2,127.0.0.3]"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "OK: 64 of 64 token ids identical" in done.stdout
