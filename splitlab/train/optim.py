"""AdamW as every node, study and test reference builds it.

PyTorch picks the per-tensor Python loop for CPU parameters unless asked (`foreach` and
`fused` default to CUDA only). A fully fine-tuned owner holds the embedding matrix, whose
dense update every step dominated the loop; the fused kernel does each tensor in one
vectorised pass. It is the same update up to rounding (`tools/bench_adamw.py` measures both).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

FUSED_DEVICES = frozenset({"cpu", "cuda"})


def _tensors(params: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            out.extend(item["params"])
        else:
            out.append(item)
    return out


def can_fuse(params: Iterable[torch.Tensor]) -> bool:
    """Whether PyTorch's fused AdamW takes every tensor: floating point on a device it has the
    kernel for (an empty list: no)."""
    tensors = list(params)
    return bool(tensors) and all(
        t.is_floating_point() and t.device.type in FUSED_DEVICES for t in tensors
    )


def adamw(
    params: Iterable[Any], *, lr: float = 1e-3, weight_decay: float = 0.01, eps: float = 1e-8
) -> torch.optim.AdamW:
    """`torch.optim.AdamW` over `params` (tensors or param-group dicts), fused where it can be.

    Raises:
        ValueError: from `torch.optim.AdamW` (an empty parameter list, a negative rate).
    """
    items = list(params)
    if isinstance(items[0] if items else None, dict):
        items = [dict(group, params=list(group["params"])) for group in items]
    fused = can_fuse(_tensors(items))
    return torch.optim.AdamW(items, lr=lr, weight_decay=weight_decay, eps=eps, fused=fused or None)
