"""Sampling on the tail: greedy is argmax, seeded sampling repeats, top-k never leaves the top k."""

from __future__ import annotations

import pytest
import torch

from splitlab.errors import ConfigError
from splitlab.infer.sampling import check_sampling, new_generator, sample_token


def test_temperature_zero_is_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample_token(logits, temperature=0.0) == 1


def test_same_seed_same_tokens() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    draw = lambda g: [sample_token(logits, temperature=1.0, generator=g) for _ in range(20)]  # noqa: E731
    assert draw(new_generator(7)) == draw(new_generator(7))


def test_top_k_stays_in_top_k() -> None:
    logits = torch.arange(100, dtype=torch.float32)
    g = new_generator(1)
    picks = {sample_token(logits, temperature=5.0, top_k=3, generator=g) for _ in range(200)}
    assert picks <= {97, 98, 99}


@pytest.mark.parametrize(("temperature", "top_k"), [(-0.1, 0), (1.0, -1)])
def test_bad_settings_name_the_key(temperature: float, top_k: int) -> None:
    with pytest.raises(ConfigError, match="task\\."):
        check_sampling(temperature=temperature, top_k=top_k)
