"""splitlab.data: sources, owner splits, tokenisation and length-bucketed microbatches.

Schedulers need only `build_owner_datasets(cfg, tokenizer, num_owners=..., round_index=...)`,
which returns one `Shard` per owner plus the held-out `Shard`; each yields dict batches.

    .venv/bin/python -m splitlab.data.owners
"""

from splitlab.data.owners import Shard, build_owner_datasets
from splitlab.data.sources import Examples, load_examples

__all__ = ["Examples", "Shard", "build_owner_datasets", "load_examples"]
