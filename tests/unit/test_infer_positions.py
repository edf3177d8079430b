"""Per-stage KV cache and positions: every stage sees the true offset, never a restart at 0.

The published predecessor read the sequence length from cache layer 0, which a non-head stage
never fills, so its positions restarted at 0 every decode step. These tests pin that down.
"""

from __future__ import annotations

import torch
from model_helpers import model_option

from splitlab.infer.ring import GenParams
from splitlab.reference.tiny import local_ring, save_tiny


def test_every_stage_sees_absolute_positions(tmp_path) -> None:
    folder = save_tiny(model_option("tiny_llama"), tmp_path / "m")
    prompt = torch.arange(5, 12).unsqueeze(0)
    _, computes = local_ring(folder, [1, 3], prompt, GenParams(max_new_tokens=6))
    expected = [0, 7, 8, 9, 10, 11]
    for compute in computes:
        assert compute.positions_seen == expected


def test_non_head_cache_layer_zero_stays_empty_but_owned_blocks_fill(tmp_path) -> None:
    folder = save_tiny(model_option("tiny_llama"), tmp_path / "m")
    prompt = torch.arange(5, 12).unsqueeze(0)
    _, computes = local_ring(folder, [2], prompt, GenParams(max_new_tokens=4))
    tail = computes[1]
    # The trap: the cache's default length (layer 0) reads 0 on a stage that does not own it.
    assert tail.cache.get_seq_length() == 0
    # Prefill 7 + 3 decode steps are cached on each block the tail owns.
    assert tail.kv_lengths() == {2: 10, 3: 10}


def _replay(computes, prompt, tokens, *, buggy: bool) -> list[torch.Tensor]:
    """Teacher-forced head -> tail pass; the tail's positions from the frame or (bug) its cache."""
    head, tail = computes
    head.reset()
    tail.reset()
    x, pos, out = prompt, 0, []
    for token in tokens:
        hidden = head.forward(x, pos)
        tail_pos = tail.cache.get_seq_length() if buggy else pos  # layer 0: never filled here
        pad = torch.ones(1, pos + x.shape[1], dtype=torch.long)
        positions = torch.arange(tail_pos, tail_pos + x.shape[1]).unsqueeze(0)
        with torch.inference_mode():
            out.append(tail.part(hidden, pad, positions, tail.cache)[0, -1].clone())
        pos += x.shape[1]
        x = torch.tensor([[token]])
    return out


def test_position_restart_changes_decode_logits_only(tmp_path) -> None:
    """The predecessor's bug is not benign: prefill agrees, every decode step after it differs."""
    folder = save_tiny(model_option("tiny_llama", "model.hidden_size=64"), tmp_path / "m")
    prompt = torch.arange(5, 12).unsqueeze(0)
    good, computes = local_ring(folder, [2], prompt, GenParams(max_new_tokens=5))
    right = _replay(computes, prompt, good.token_ids, buggy=False)
    wrong = _replay(computes, prompt, good.token_ids, buggy=True)
    torch.testing.assert_close(right[0], wrong[0])
    for step in range(1, 5):
        assert (right[step] - wrong[step]).abs().max() > 1e-3, step
