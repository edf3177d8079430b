"""Owner shards and the held-out set: disjoint, seeded, refreshed per round, batched.

.venv/bin/pytest tests/unit/test_data_owners.py
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from data_helpers import file_data_config, sentiment_frame, word_tokenizer, write_table

from splitlab.config.enums import DataDistribution, DataSource, TaskKind
from splitlab.config.schema import DataConfig
from splitlab.data.owners import build_owner_datasets, build_test_shard
from splitlab.data.split import owner_counts
from splitlab.errors import ConfigError
from splitlab.train.feed import OwnerFeed


@pytest.fixture
def csv_path(tmp_path: Path) -> Path:
    return write_table(sentiment_frame(200), tmp_path / "reviews.csv")


def _cfg(path: Path, **overrides: object) -> DataConfig:
    sizes: dict[str, object] = {"samples_per_owner": 40, "val_samples": 30, "max_length": 6}
    return file_data_config(path, **{**sizes, **overrides})


def _ids(cfg: DataConfig, num_owners: int = 3, round_index: int = 0) -> list[list[int]]:
    owners, val = build_owner_datasets(
        cfg, word_tokenizer(), num_owners=num_owners, round_index=round_index
    )
    return [s.example_ids for s in owners] + [val.example_ids]


def test_shards_are_disjoint_and_sized(csv_path: Path) -> None:
    groups = _ids(_cfg(csv_path))
    flat = [i for g in groups for i in g]
    assert [len(g) for g in groups] == [40, 40, 40, 30]
    assert len(flat) == len(set(flat))


def test_test_set_is_apart_from_owners_and_validation_and_keeps_validation(csv_path: Path) -> None:
    cfg = _cfg(csv_path, test_samples=25)
    groups = _ids(cfg)
    test = build_test_shard(cfg, word_tokenizer(), num_owners=3)
    assert test is not None and test.name == "test" and len(test) == 25
    assert not set(test.example_ids) & {i for g in groups for i in g}
    assert groups[3] == _ids(_cfg(csv_path))[3]  # adding a test set never moves validation
    assert build_test_shard(_cfg(csv_path), word_tokenizer(), num_owners=3) is None


@pytest.mark.parametrize("distribution", list(DataDistribution))
def test_split_is_fixed_across_rounds_without_refresh(csv_path: Path, distribution: str) -> None:
    cfg = _cfg(csv_path, distribution=distribution)
    assert _ids(cfg, round_index=0) == _ids(cfg, round_index=5)


def test_refresh_draws_a_new_owner_split_but_keeps_validation(csv_path: Path) -> None:
    cfg = _cfg(csv_path, refresh_each_round=True)
    first, second = _ids(cfg, round_index=0), _ids(cfg, round_index=1)
    assert first[:3] != second[:3]
    assert first[3] == second[3]


def test_batches_pad_to_their_own_longest_row(csv_path: Path) -> None:
    owners, _ = build_owner_datasets(_cfg(csv_path), word_tokenizer(), num_owners=2)
    shard = owners[0]
    batches = list(shard.batches(8, seed=0))
    assert sum(b["input_ids"].shape[0] for b in batches) == len(shard)
    for b in batches:
        lengths = b["attention_mask"].sum(dim=1)
        assert b["input_ids"].shape[1] == int(lengths.max()) <= 6
        assert b["labels"].shape == (b["input_ids"].shape[0],)


def test_label_counts_follow_the_labels(csv_path: Path) -> None:
    owners, val = build_owner_datasets(_cfg(csv_path), word_tokenizer(), num_owners=2)
    for shard in [*owners, val]:
        assert sum(shard.label_counts()) == len(shard)
        assert shard.label_names == ["neg", "pos"]


def test_gpt2_style_tokenizer_gets_eos_as_pad(csv_path: Path) -> None:
    tok = word_tokenizer(with_pad=False)
    owners, _ = build_owner_datasets(_cfg(csv_path), tok, num_owners=1)
    assert owners[0].pad_id == tok.eos_token_id


def test_too_few_examples_names_the_fields(csv_path: Path) -> None:
    with pytest.raises(ConfigError, match="samples_per_owner=40"):
        build_owner_datasets(_cfg(csv_path), word_tokenizer(), num_owners=5)


def test_dirichlet_without_labels_asks_for_iid(tmp_path: Path) -> None:
    path = write_table(pd.DataFrame({"text": ["the film"] * 20}), tmp_path / "lm.csv")
    cfg = _cfg(path, task=TaskKind.causal_lm, label_column=None, samples_per_owner=5, val_samples=2)
    with pytest.raises(ConfigError, match="distribution=iid"):
        build_owner_datasets(cfg, word_tokenizer(), num_owners=2)


def test_causal_lm_shards_batch_with_token_labels(tmp_path: Path) -> None:
    path = write_table(pd.DataFrame({"text": ["the film was good"] * 20}), tmp_path / "lm.csv")
    cfg = _cfg(
        path,
        task=TaskKind.causal_lm,
        label_column=None,
        samples_per_owner=5,
        val_samples=2,
        distribution=DataDistribution.iid,
    )
    owners, _ = build_owner_datasets(cfg, word_tokenizer(), num_owners=2)
    batch = next(owners[0].batches(4, seed=0))
    assert batch["labels"].shape == batch["input_ids"].shape


def test_gsm_symbolic_builds_iid_and_dirichlet_shards() -> None:
    pytest.importorskip("reasoning_gym")
    for distribution in DataDistribution:
        cfg = DataConfig(
            name="gsm_symbolic",
            source=DataSource.generator,
            task=TaskKind.causal_lm,
            label_column=None,
            samples_per_owner=8,
            val_samples=4,
            max_length=32,
            distribution=distribution,
        )
        owners, val = build_owner_datasets(cfg, word_tokenizer(), num_owners=2)
        assert [len(s) for s in owners] == [8, 8] and len(val) == 4


@pytest.mark.assets
def test_rotten_tomatoes_with_the_gpt2_tokenizer_batches() -> None:
    from transformers import AutoTokenizer

    from splitlab.assets import fetch

    cfg = DataConfig(
        name="rotten_tomatoes", source=DataSource.packaged, task=TaskKind.classification
    )
    tokenizer = AutoTokenizer.from_pretrained(fetch("gpt2_tokenizer"))
    owners, val = build_owner_datasets(cfg, tokenizer, num_owners=2)
    batch = next(owners[0].batches(16, seed=0))
    assert [len(s) for s in owners] == [512, 512] and len(val) == 256
    assert batch["input_ids"].shape[1] <= cfg.max_length
    assert owners[0].pad_id == tokenizer.eos_token_id == 50256


@pytest.mark.parametrize("distribution", ["iid", "dirichlet"])
def test_one_count_per_owner_and_an_empty_owner(csv_path: Path, distribution: str) -> None:
    cfg = _cfg(csv_path, samples_per_owner=[50, 20, 0], distribution=DataDistribution(distribution))
    groups = _ids(cfg)
    assert [len(g) for g in groups] == [50, 20, 0, 30]
    feed = OwnerFeed(cfg, word_tokenizer(), owner_index=2, num_owners=3, batch_size=4)
    assert feed.round_batches(0) == []  # nothing to train on, but a shard to stand on
    assert len(feed.val_batches(0)) == 8  # it still validates on the shared held-out set


def test_quantity_skew_is_seeded_and_keeps_the_total(csv_path: Path) -> None:
    cfg = _cfg(csv_path, quantity_skew_alpha=0.5)
    sizes = [len(g) for g in _ids(cfg)[:3]]
    assert sum(sizes) == 120 and len(set(sizes)) > 1
    assert owner_counts(cfg, 3) == sizes
    assert owner_counts(_cfg(csv_path, quantity_skew_alpha=0.5, seed=2), 3) != sizes
