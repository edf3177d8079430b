"""Shared fixtures of the ring equivalence tests: one 9-block tiny Llama checkpoint per session
and the tokens its 3-stage ring (cuts [3, 6], a barrier every 5 tokens) decodes unmoved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_helpers import model_option

from splitlab.infer.ring import GenParams
from splitlab.reference.tiny import local_ring, save_tiny

RING_PROMPT = torch.tensor([[464, 3290, 286, 4881, 318, 257, 1588, 1748]])
RING_CUTS = [3, 6]
RING_GEN = GenParams(max_new_tokens=30)


@pytest.fixture(scope="session")
def tiny9(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny9")
    return save_tiny(model_option("tiny_llama", "model.num_layers=9"), folder)


@pytest.fixture(scope="session")
def noshift(tiny9: Path) -> list[int]:
    """The tokens of the ring that never moves (RING_PROMPT, RING_CUTS, RING_GEN, W = 5)."""
    result, _ = local_ring(tiny9, RING_CUTS, RING_PROMPT, RING_GEN, window=5)
    assert all(not w["aborted"] for w in result.windows)
    return result.token_ids
