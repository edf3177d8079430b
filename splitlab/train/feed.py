"""An owner's data for each round: its Dirichlet (or IID) shard, length-bucketed microbatches,
and the held-out split it validates on.

Every owner process builds the same split from the same data config and seed
(`splitlab.data.owners.build_owner_datasets`) and keeps only its own shard, so no example
crosses a process boundary. With `data.refresh_each_round` the split is drawn again per round.

    .venv/bin/pytest tests/integration/test_finetune_task.py -q
"""

from __future__ import annotations

from typing import Any

import torch

from splitlab.config.schema import DataConfig
from splitlab.data.buckets import microbatches_per_round
from splitlab.data.owners import Shard, build_owner_datasets
from splitlab.train.nodes import Batch


class OwnerFeed:
    """One owner's microbatches per round and its validation batches."""

    def __init__(
        self,
        data: DataConfig,
        tokenizer: Any,
        *,
        owner_index: int,
        num_owners: int,
        batch_size: int,
        steps_per_round: int = 0,
        seed: int = 0,
        device: str = "cpu",
    ) -> None:
        self.data, self.tokenizer = data, tokenizer
        self.owner_index, self.num_owners = owner_index, num_owners
        self.batch_size, self.steps_per_round = batch_size, steps_per_round
        self.seed, self.device = seed, torch.device(device)
        self._split: tuple[int, Shard, Shard] | None = None  # (round drawn for, shard, val)

    def _shards(self, round_id: int) -> tuple[Shard, Shard]:
        drawn_for = round_id if self.data.refresh_each_round else 0
        if self._split is None or self._split[0] != drawn_for:
            owners, val = build_owner_datasets(
                self.data, self.tokenizer, num_owners=self.num_owners, round_index=drawn_for
            )
            self._split = (drawn_for, owners[self.owner_index], val)
        return self._split[1], self._split[2]

    def _to_device(self, batch: dict[str, torch.Tensor]) -> Batch:
        return {k: t.to(self.device) for k, t in batch.items()}

    def round_batches(self, round_id: int) -> list[Batch]:
        """This round's microbatches: passes over the shard (a fresh shuffle per pass, buckets
        of similar lengths) until `steps_per_round` (0 = exactly one pass)."""
        shard, _ = self._shards(round_id)
        if len(shard) == 0:
            return []
        wanted = microbatches_per_round(
            samples_per_owner=len(shard),
            batch_size=self.batch_size,
            steps_per_round=self.steps_per_round,
        )
        out: list[Batch] = []
        passes = 0
        while len(out) < wanted:
            seed = self.seed * 1_000_003 + round_id * 1009 + passes
            for batch in shard.batches(
                self.batch_size, seed=seed, bucket=self.data.bucket_by_length
            ):
                out.append(self._to_device(batch))
                if len(out) == wanted:
                    break
            passes += 1
        return out

    def val_batches(self, round_id: int) -> list[Batch]:
        _, val = self._shards(round_id)
        return [self._to_device(b) for b in val.batches(self.batch_size, seed=0, bucket=True)]
