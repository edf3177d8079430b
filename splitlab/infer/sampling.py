"""Next-token choice on the tail stage: greedy at temperature 0, else seeded top-k sampling.

Greedy is the reproducible mode every equivalence check uses. Sampling draws from a
`torch.Generator` seeded once per run, so the same seed gives the same tokens.

    .venv/bin/pytest tests/unit/test_infer_sampling.py -q
"""

from __future__ import annotations

import torch

from splitlab.errors import ConfigError


def check_sampling(*, temperature: float, top_k: int) -> None:
    """Validate sampling settings where they enter (config or the START frame)."""
    if not temperature >= 0.0:
        raise ConfigError(f"task.temperature={temperature}: must be >= 0 (0 = greedy)")
    if top_k < 0:
        raise ConfigError(f"task.top_k={top_k}: must be >= 0 (0 = no top-k filtering)")


def new_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(int(seed))


def sample_token(
    logits_V: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> int:
    """One token id from the last position's logits (a 1-D tensor of V scores)."""
    logits_V = logits_V.reshape(-1).float()
    if temperature == 0.0:
        return int(torch.argmax(logits_V))
    scaled = logits_V / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))
