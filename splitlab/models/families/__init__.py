"""Model family adapters and their registry; importing this package registers the built-ins.

The registry and the built-ins' names, tasks and model types load without torch, so config
validation (`splitlab.choices`) imports neither torch nor transformers. The adapters and the
batch keys below load on first use, from the modules that import torch.

.venv/bin/pytest tests/unit/test_models_registry.py
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from splitlab.config.enums import TaskKind
from splitlab.models.families.registry import (
    FamilyKind,
    families,
    family_for_model,
    family_for_model_type,
    family_kind,
    get_family,
    register_family,
    unregister_family,
)

if TYPE_CHECKING:
    from splitlab.models.families.base import INPUT_IDS, LABELS, PAD_MASK, FamilyAdapter
    from splitlab.models.families.bert import BertAdapter
    from splitlab.models.families.gpt2 import GPT2Adapter
    from splitlab.models.families.llama import LlamaAdapter

register_family("bert", "splitlab.models.families.bert:BertAdapter",
                task=TaskKind.classification, model_types={"bert"})  # fmt: skip
register_family("gpt2", "splitlab.models.families.gpt2:GPT2Adapter",
                task=TaskKind.causal_lm, model_types={"gpt2"}, ties_head=True)  # fmt: skip
register_family("llama", "splitlab.models.families.llama:LlamaAdapter",
                task=TaskKind.causal_lm, model_types={"llama", "qwen2"})  # fmt: skip

_EXPORTS = {
    "INPUT_IDS": "base", "LABELS": "base", "PAD_MASK": "base", "FamilyAdapter": "base",
    "BertAdapter": "bert", "GPT2Adapter": "gpt2", "LlamaAdapter": "llama",
}  # fmt: skip

__all__ = [
    "INPUT_IDS",
    "LABELS",
    "PAD_MASK",
    "BertAdapter",
    "FamilyAdapter",
    "FamilyKind",
    "GPT2Adapter",
    "LlamaAdapter",
    "families",
    "family_for_model",
    "family_for_model_type",
    "family_kind",
    "get_family",
    "register_family",
    "unregister_family",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'splitlab.models.families' has no attribute {name!r}")
    return getattr(import_module(f"splitlab.models.families.{module}"), name)
