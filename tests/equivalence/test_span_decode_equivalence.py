"""Ring spans with per-span KV caches decode greedily exactly like the unsplit model.

Each decode step's logits are checked against a cache-free forward of the whole sequence so
far, so a stage that restarted positions at 0, or a cache that lost or misplaced a layer,
shows up at the step where it first matters.

    .venv/bin/pytest tests/equivalence/test_span_decode_equivalence.py
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import padded_batch, tiny_model
from transformers import PreTrainedModel

from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import Part, build_stages
from splitlab.models.plan import even_cuts, ring_plan
from splitlab.models.tokens import positions_from_pad_mask

NEW_TOKENS = 6


def ring_greedy(
    stages: list[Part],
    ids_BT: torch.Tensor,
    pad_mask_BT: torch.Tensor,
    *,
    zero_positions_after: int = -1,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decode through the stages; returns new tokens B x N and each step's last logits.

    `zero_positions_after` >= 0 hands stages after that index positions restarted at 0 (the
    predecessor's bug), to show the check can fail.
    """
    caches = [stage.new_cache() for stage in stages]
    x_step, pad_mask = ids_BT, pad_mask_BT
    tokens, step_logits = [], []
    for _ in range(NEW_TOKENS):
        positions = positions_from_pad_mask(pad_mask, query_len=x_step.shape[1])
        x = x_step
        for i, (stage, cache) in enumerate(zip(stages, caches, strict=True)):
            stage_positions = positions
            if 0 <= zero_positions_after < i:
                stage_positions = torch.arange(x.shape[1]).expand_as(positions)
            x = stage(x, pad_mask, stage_positions, cache)
        last_BV = x[:, -1, :]
        step_logits.append(last_BV)
        next_B1 = last_BV.argmax(dim=-1, keepdim=True)
        tokens.append(next_B1)
        x_step = next_B1
        pad_mask = torch.cat([pad_mask, torch.ones_like(next_B1)], dim=1)
    return torch.cat(tokens, dim=1), step_logits


def reference_greedy(
    model: PreTrainedModel, ids_BT: torch.Tensor, pad_mask_BT: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The unsplit model, no cache: the whole sequence is re-run at every step."""
    ids, pad_mask = ids_BT, pad_mask_BT
    tokens, step_logits = [], []
    for _ in range(NEW_TOKENS):
        logits = model(
            input_ids=ids, attention_mask=pad_mask, position_ids=positions_from_pad_mask(pad_mask)
        ).logits
        last_BV = logits[:, -1, :]
        step_logits.append(last_BV)
        next_B1 = last_BV.argmax(dim=-1, keepdim=True)
        tokens.append(next_B1)
        ids = torch.cat([ids, next_B1], dim=1)
        pad_mask = torch.cat([pad_mask, torch.ones_like(next_B1)], dim=1)
    return torch.cat(tokens, dim=1), step_logits


@pytest.mark.parametrize("cuts", [[1, 3], [2], [1, 2, 3]], ids=["3-stages", "2-stages", "4-stages"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@torch.no_grad()
def test_ring_decode_matches_unsplit_every_step(family: str, cuts: list[int]) -> None:
    model = tiny_model(family)
    batch = padded_batch(family, lengths=(6, 4, 2), left=True)
    stages = build_stages(model, ring_plan(4, cuts))

    ring_tokens, ring_logits = ring_greedy(stages, batch[INPUT_IDS], batch[PAD_MASK])
    ref_tokens, ref_logits = reference_greedy(model, batch[INPUT_IDS], batch[PAD_MASK])

    for step, (got, want) in enumerate(zip(ring_logits, ref_logits, strict=True)):
        torch.testing.assert_close(got, want, msg=lambda m, s=step: f"decode step {s}: {m}")
    assert torch.equal(ring_tokens, ref_tokens)


@torch.no_grad()
def test_ring_decode_matches_generate_for_one_prompt() -> None:
    model = tiny_model("llama", tied=True)
    ids = torch.tensor([[5, 17, 42, 8, 23]])
    pad_mask = torch.ones_like(ids)
    stages = build_stages(model, ring_plan(4, even_cuts(num_layers=4, stages=3)))

    ring_tokens, _ = ring_greedy(stages, ids, pad_mask)
    generated = model.generate(
        ids, attention_mask=pad_mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )

    assert torch.equal(ring_tokens, generated[:, ids.shape[1] :])


@torch.no_grad()
def test_positions_restarted_on_a_later_stage_are_caught() -> None:
    model = tiny_model("llama")
    batch = padded_batch("llama", lengths=(6, 6), left=True)
    stages = build_stages(model, ring_plan(4, [2]))

    _, wrong_logits = ring_greedy(stages, batch[INPUT_IDS], batch[PAD_MASK], zero_positions_after=0)
    _, ref_logits = reference_greedy(model, batch[INPUT_IDS], batch[PAD_MASK])

    # Prefill happens to use 0..T-1 anyway; the first decode step is where it goes wrong.
    torch.testing.assert_close(wrong_logits[0], ref_logits[0])
    assert not torch.allclose(wrong_logits[1], ref_logits[1])
