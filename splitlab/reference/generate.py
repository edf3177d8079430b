"""The single-process ring oracle: the unsplit model generating with its own forward and cache.

Deliberately shares nothing with the ring but the sampling rule: it runs the transformers model
class end to end (`model(input_ids, past_key_values=cache)`), so a bug in parts, masks, rotary
offsets or per-stage caches cannot cancel out.

    .venv/bin/pytest tests/equivalence/test_ring_equivalence.py -q
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel

from splitlab.infer.ring import GenParams, RingResult
from splitlab.infer.sampling import new_generator, sample_token


@torch.inference_mode()
def generate_reference(
    model: PreTrainedModel, prompt_ids: torch.Tensor, gen: GenParams
) -> RingResult:
    """Prefill then decode one token at a time, stopping like the ring (max or EOS)."""
    generator = new_generator(gen.seed)
    device = next(model.parameters()).device
    x = prompt_ids.reshape(1, -1).to(device)
    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    tpot: list[float] = []
    ttft_ms, reason, seen = 0.0, "max_new_tokens", 0
    for step in range(gen.max_new_tokens):
        t0 = time.perf_counter()
        num_tokens = x.shape[1]
        mask = torch.ones(1, seen + num_tokens, dtype=torch.long, device=device)
        out = model(input_ids=x, attention_mask=mask, cache=cache, use_cache=True)
        seen += num_tokens
        token = sample_token(
            out.logits[0, -1], temperature=gen.temperature, top_k=gen.top_k, generator=generator
        )
        trip_ms = (time.perf_counter() - t0) * 1e3
        if step == 0:
            ttft_ms = trip_ms
        else:
            tpot.append(trip_ms)
        tokens.append(token)
        if token in gen.eos_ids:
            reason = "eos"
            break
        x = torch.tensor([[token]], dtype=torch.long, device=device)
    return RingResult(tokens, prompt_ids.shape[-1], reason, ttft_ms, tpot)
