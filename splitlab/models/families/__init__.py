"""Model family adapters and their registry; importing this package registers the built-ins.

.venv/bin/pytest tests/unit/test_models_registry.py
"""

from __future__ import annotations

from splitlab.models.families.base import INPUT_IDS, LABELS, PAD_MASK, FamilyAdapter
from splitlab.models.families.bert import BertAdapter
from splitlab.models.families.gpt2 import GPT2Adapter
from splitlab.models.families.llama import LlamaAdapter
from splitlab.models.families.registry import (
    families,
    family_for_model,
    get_family,
    register_family,
    unregister_family,
)

register_family("bert", BertAdapter())
register_family("gpt2", GPT2Adapter())
register_family("llama", LlamaAdapter())

__all__ = [
    "INPUT_IDS",
    "LABELS",
    "PAD_MASK",
    "BertAdapter",
    "FamilyAdapter",
    "GPT2Adapter",
    "LlamaAdapter",
    "families",
    "family_for_model",
    "get_family",
    "register_family",
    "unregister_family",
]
