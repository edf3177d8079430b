"""splitlab.data: sources, owner splits, tokenisation and length-bucketed microbatches.

Schedulers need only `build_owner_datasets(cfg, tokenizer, num_owners=..., round_index=...)`,
which returns one `Shard` per owner plus the held-out `Shard`; each yields dict batches.

    .venv/bin/python -m splitlab.data.owners
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitlab.data.owners import Shard, build_owner_datasets
    from splitlab.data.sources import Examples, load_examples

# Loaded on first access: the launcher's preflight reads data files through
# splitlab.data.sources, which must not pull in owners (torch) on the way.
_EXPORTS = {"Examples": "sources", "load_examples": "sources", "Shard": "owners",
            "build_owner_datasets": "owners"}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'splitlab.data' has no attribute {name!r}")
    return getattr(import_module(f"splitlab.data.{module}"), name)


__all__ = ["Examples", "Shard", "build_owner_datasets", "load_examples"]
