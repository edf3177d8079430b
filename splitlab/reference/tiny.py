"""Tiny random-init checkpoints on disk, the ring over one in this process, and the oracle's
tokens for it (tests and quick tools; the caller composes the model option's config).

.venv/bin/pytest tests/unit/test_infer_positions.py -q
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from splitlab.config.schema import ModelConfig
from splitlab.infer.compute import PartCompute
from splitlab.infer.local import run_local_ring
from splitlab.infer.parity import stage_versions
from splitlab.infer.ring import GenParams, RingResult, StageIdentity
from splitlab.models.load import load_model
from splitlab.models.plan import ring_plan
from splitlab.models.shard import load_part, open_checkpoint
from splitlab.reference.generate import generate_reference


def save_tiny(cfg: ModelConfig, folder: Path, *, seed: int = 0) -> Path:
    """A random-init model of `cfg` (seeded), saved as a transformers folder."""
    torch.manual_seed(seed)
    model, _ = load_model(cfg, load_tokenizer=False)
    model.save_pretrained(folder)
    return folder


def reference_tokens(folder: Path, prompt_ids: torch.Tensor, gen: GenParams) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return generate_reference(model, prompt_ids, gen).token_ids


def local_ring(folder: Path, cuts: list[int], prompt_ids: torch.Tensor, gen: GenParams,
               **ring_kwargs) -> tuple[RingResult, list[PartCompute]]:  # fmt: skip
    """An in-process ring over `folder`; `ring_kwargs` go to `run_local_ring` (window, planner...)."""
    index = open_checkpoint(folder)
    num_layers = index.family.num_layers(index.config)
    spans = ring_plan(num_layers, cuts)
    computes = [PartCompute(load_part(index, span)[0]) for span in spans]
    identities = [
        StageIdentity(
            stage=i,
            num_stages=len(spans),
            start=s.start,
            stop=s.stop,
            num_layers=num_layers,
            model={"model_type": index.config.model_type},
            versions=stage_versions(dtype="float32", device="cpu"),
        )  # fmt: skip
        for i, s in enumerate(spans)
    ]
    ring_kwargs.setdefault("timeout_s", 30.0)
    if ring_kwargs.get("window"):
        ring_kwargs.setdefault("index", index)
    return run_local_ring(computes, identities, prompt_ids, gen, **ring_kwargs), computes
