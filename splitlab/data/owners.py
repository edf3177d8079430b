"""Per-owner training shards and the shared held-out set, ready to batch.

`build_owner_datasets` is what schedulers call: it loads the configured source, holds out
`val_samples` examples (fixed by `data.seed` alone, so validation never moves between rounds),
splits the rest across owners (IID or Dirichlet over the labels, re-drawn each round when
`refresh_each_round`; `splitlab.data.split.owner_counts` examples each: one count, one per
owner, or a seeded Dirichlet quantity skew, fixed for the run), and tokenises each shard. A
`Shard` then yields padded microbatches, length-bucketed when `bucket_by_length`.

    .venv/bin/pytest tests/unit/test_data_owners.py
    .venv/bin/python -m splitlab.data.owners   # rotten_tomatoes with the GPT-2 tokenizer
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from splitlab.config.enums import DataDistribution, DataSource, TaskKind
from splitlab.config.schema import DataConfig
from splitlab.data.buckets import bucket_batches
from splitlab.data.sources import Examples, load_examples
from splitlab.data.split import dirichlet_split, holdout_sets, iid_split, owner_counts, round_seed
from splitlab.data.tokenize import Encoded, collate, encode, ensure_pad_token
from splitlab.errors import ConfigError

GENERATOR_SPARE = 2  # generators make this many times the owners' need, so skewed splits can pick


@dataclass(frozen=True)
class Shard:
    """One owner's (or the held-out) tokenised examples."""

    name: str  # "owner0", "owner1", ..., "val" or "test"
    example_ids: list[int]  # indices into the loaded source (disjoint across shards)
    encoded: Encoded  # unpadded token ids (+ class ids)
    pad_id: int  # the tokenizer's pad id (GPT-2: EOS)
    task: TaskKind
    label_names: list[str] = field(default_factory=list)  # class names in id order

    def __len__(self) -> int:
        return len(self.encoded)

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.encoded.input_ids]

    def label_counts(self) -> list[int]:
        counts = [0] * len(self.label_names)
        for label in self.encoded.labels:
            counts[label] += 1
        return counts

    def batch_indices(self, batch_size: int, *, seed: int, bucket: bool = True) -> list[list[int]]:
        """Row indices of each microbatch, in the order they are served."""
        return bucket_batches(self.lengths, batch_size, seed, bucket=bucket)

    def batches(
        self, batch_size: int, *, seed: int, bucket: bool = True
    ) -> Iterator[dict[str, torch.Tensor]]:
        """One pass over the shard: dict batches padded to each batch's longest row."""
        labels = self.encoded.labels
        for rows in self.batch_indices(batch_size, seed=seed, bucket=bucket):
            yield collate(
                [self.encoded.input_ids[r] for r in rows],
                [labels[r] for r in rows] if labels else None,
                pad_id=self.pad_id,
                task=self.task,
            )


def build_owner_datasets(
    cfg: DataConfig, tokenizer: Any, *, num_owners: int, round_index: int = 0
) -> tuple[list[Shard], Shard]:
    """Training shards for `num_owners` owners and the held-out validation shard.

    Args:
        cfg: the data config.
        tokenizer: a transformers tokenizer; one without a pad token gets pad = EOS.
        num_owners: data owners to fill with `owner_counts(cfg, num_owners)` examples.
        round_index: the training round; changes the split only when `cfg.refresh_each_round`.
    """
    task = TaskKind(cfg.task)
    examples = _load(cfg, num_owners)
    owner_ids, val_ids, _ = split_examples(
        examples, cfg, num_owners=num_owners, round_index=round_index
    )
    pad_id = ensure_pad_token(tokenizer)

    def shard(name: str, ids: list[int]) -> Shard:
        encoded = encode(examples, ids, tokenizer, task=task, max_length=cfg.max_length)
        return Shard(name, ids, encoded, pad_id, task, list(examples.label_names))

    owners = [shard(f"owner{k}", ids) for k, ids in enumerate(owner_ids)]
    return owners, shard("val", val_ids)


def build_test_shard(cfg: DataConfig, tokenizer: Any, *, num_owners: int) -> Shard | None:
    """The `data.test_samples` examples no owner trains on and no round validates on (the
    final evaluation of a run); None when `test_samples` is 0."""
    if cfg.test_samples <= 0:
        return None
    examples = _load(cfg, num_owners)
    _, _, test_ids = split_examples(examples, cfg, num_owners=num_owners)
    pad_id = ensure_pad_token(tokenizer)
    encoded = encode(
        examples, test_ids, tokenizer, task=TaskKind(cfg.task), max_length=cfg.max_length
    )
    return Shard("test", test_ids, encoded, pad_id, TaskKind(cfg.task), list(examples.label_names))


def _load(cfg: DataConfig, num_owners: int) -> Examples:
    """The examples every split of `cfg` draws from (validation, test, then the owners)."""
    wanted = cfg.val_samples + cfg.test_samples + sum(owner_counts(cfg, num_owners))
    if DataSource(cfg.source) is DataSource.generator:
        wanted *= GENERATOR_SPARE
    return load_examples(cfg, num_wanted=wanted)


def split_examples(
    examples: Examples, cfg: DataConfig, *, num_owners: int, round_index: int = 0
) -> tuple[list[list[int]], list[int], list[int]]:
    """Example indices per owner, validated on each round, and tested on at the end."""
    if min(cfg.val_samples, cfg.test_samples) < 0:
        raise ConfigError(
            f"need data.val_samples >= 0 and data.test_samples >= 0; got {cfg.val_samples}, "
            f"{cfg.test_samples}"
        )
    counts = owner_counts(cfg, num_owners)
    need = cfg.val_samples + cfg.test_samples + sum(counts)
    if need > len(examples):
        raise ConfigError(
            f"data {cfg.name!r} has {len(examples)} examples; data.val_samples={cfg.val_samples} "
            f"+ data.test_samples={cfg.test_samples} + the owners' {counts} "
            f"(data.samples_per_owner={cfg.samples_per_owner}) = {need}"
        )
    (val, test), rest = holdout_sets(len(examples), [cfg.val_samples, cfg.test_samples], cfg.seed)
    seed = round_seed(cfg.seed, round_index if cfg.refresh_each_round else 0)
    if DataDistribution(cfg.distribution) is DataDistribution.iid:
        positions = iid_split(len(rest), num_owners, counts, seed)
    else:
        if not examples.strata:
            raise ConfigError(
                f"data.distribution=dirichlet needs labels, and data {cfg.name!r} has none; "
                "set data.distribution=iid"
            )
        strata = [examples.strata[i] for i in rest]
        positions = dirichlet_split(
            strata, num_owners, cfg.alpha, counts, seed,
            keep_global_mix=cfg.keep_global_mix,
        )  # fmt: skip
    return [[rest[p] for p in owner] for owner in positions], val, test


def main() -> None:
    """Print shard sizes, label counts and padding savings for the default data option."""
    from transformers import AutoTokenizer

    from splitlab.assets import fetch
    from splitlab.data.buckets import padded_tokens

    cfg = DataConfig(
        name="rotten_tomatoes", source=DataSource.packaged, task=TaskKind.classification
    )
    tokenizer = AutoTokenizer.from_pretrained(fetch("gpt2_tokenizer"))
    owners, val = build_owner_datasets(cfg, tokenizer, num_owners=3)
    for s in [*owners, val]:
        bucketed = padded_tokens(s.lengths, s.batch_indices(16, seed=0))
        plain = padded_tokens(s.lengths, s.batch_indices(16, seed=0, bucket=False))
        print(
            f"{s.name}: {len(s)} examples, labels {s.label_counts()}, real tokens "
            f"{sum(s.lengths)}, padded cells bucketed {bucketed} vs shuffled {plain}"
        )


if __name__ == "__main__":
    main()
