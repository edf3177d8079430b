"""Raw example sources: file readers, label mapping, hub copies, generators, packaged data.

.venv/bin/pytest tests/unit/test_data_sources.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
from data_helpers import file_data_config, sentiment_frame, write_table

from splitlab.config.enums import DataSource, TaskKind
from splitlab.config.schema import DataConfig
from splitlab.data.sources import label_ids, load_examples, usable_rows
from splitlab.errors import ConfigError


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".parquet"])
def test_file_readers_give_the_same_examples(tmp_path: Path, suffix: str) -> None:
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    path = write_table(sentiment_frame(10), tmp_path / f"d{suffix}")
    ex = load_examples(file_data_config(path, labels=["neg", "pos"]))
    assert ex.texts == sentiment_frame(10)["text"].tolist()
    assert ex.labels == [1, 0] * 5
    assert ex.label_names == ["neg", "pos"]
    assert ex.strata == ex.labels


def test_parquet_without_pyarrow_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ConfigError, match=r"splitlab\[parquet\]"):
        load_examples(file_data_config(path))


def test_labels_are_inferred_sorted_when_not_named(tmp_path: Path) -> None:
    path = write_table(sentiment_frame(4), tmp_path / "d.csv")
    ex = load_examples(file_data_config(path))
    assert ex.label_names == ["neg", "pos"]
    assert ex.labels == [1, 0, 1, 0]


def test_config_label_order_sets_the_ids(tmp_path: Path) -> None:
    path = write_table(sentiment_frame(4), tmp_path / "d.csv")
    assert load_examples(file_data_config(path, labels=["pos", "neg"])).labels == [0, 1, 0, 1]


def test_integer_labels_keep_their_ids_with_named_classes() -> None:
    assert label_ids([2, 0, 1], ["a", "b", "c"]) == ([2, 0, 1], ["a", "b", "c"])


def test_integer_labels_outside_the_names_are_rejected() -> None:
    with pytest.raises(ConfigError, match="outside data.labels"):
        label_ids([0, 5], ["a", "b"])


def test_unnamed_integer_labels_are_ranked() -> None:
    assert label_ids([10, 30, 10], []) == ([0, 1, 0], ["10", "30"])


def test_unknown_string_label_names_the_value(tmp_path: Path) -> None:
    path = write_table(sentiment_frame(4), tmp_path / "d.csv")
    with pytest.raises(ConfigError, match="'pos'"):
        load_examples(file_data_config(path, labels=["neg", "meh"]))


def test_missing_column_names_the_key_and_the_columns(tmp_path: Path) -> None:
    path = write_table(sentiment_frame(4), tmp_path / "d.csv")
    with pytest.raises(ConfigError, match=r"data.text_column='sentence'.*\['text', 'label'\]"):
        load_examples(file_data_config(path, text_column="sentence"))


def test_rows_with_missing_text_are_dropped(tmp_path: Path) -> None:
    frame = pd.DataFrame({"text": ["good", None, "bad"], "label": ["pos", "pos", "neg"]})
    ex = load_examples(file_data_config(write_table(frame, tmp_path / "d.csv")))
    assert ex.texts == ["good", "bad"]


def test_blank_and_whitespace_labels_are_dropped_and_counted() -> None:
    frame = pd.DataFrame({"text": ["a", "b", "c", "d", None],
                          "label": ["pos", None, " ", "neg", "pos"]})  # fmt: skip
    kept, dropped = usable_rows(frame, file_data_config(Path("d.csv")))
    assert kept["text"].tolist() == ["a", "d"]
    assert dropped == 3


@pytest.mark.parametrize(
    ("name", "content", "named"),
    [
        ("empty.csv", b"", "is empty (0 bytes)"),
        ("latin1.csv", b"text,label\ncaf\xe9,pos\n", "is not UTF-8 text (byte 0xe9"),
        ("latin1.jsonl", b'{"text": "caf\xe9", "label": "pos"}\n', "is not UTF-8 text"),
        ("broken.jsonl", b'{"text": "a", "label"\n', "cannot read it as .jsonl"),
    ],
)
def test_unreadable_file_names_it(tmp_path: Path, name: str, content: bytes, named: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_examples(file_data_config(path))
    assert f"data.path={str(path)!r}" in str(info.value) and named in str(info.value)


def test_causal_lm_file_keeps_answers_as_targets(tmp_path: Path) -> None:
    frame = pd.DataFrame({"question": ["1+1?", "2+2?"], "answer": ["1+1=2\n#### 2", "#### 4"]})
    path = write_table(frame, tmp_path / "gsm8k.jsonl")
    cfg = file_data_config(
        path, task=TaskKind.causal_lm, text_column="question", label_column="answer"
    )
    ex = load_examples(cfg)
    assert ex.texts == ["1+1?", "2+2?"]
    assert ex.targets == ["1+1=2\n#### 2", "#### 4"]
    assert ex.labels == [] and ex.strata == []


def test_unknown_file_format_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "d.xlsx"
    path.write_text("x")
    with pytest.raises(ConfigError, match="unknown format"):
        load_examples(file_data_config(path))


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.csv"):
        load_examples(file_data_config(tmp_path / "nope.csv"))


def test_hub_reads_a_saved_copy_with_class_label_names(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    names = ["sadness", "joy", "love", "anger", "fear", "surprise"]
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)}
    )
    train = datasets.Dataset.from_dict(
        {"text": ["i feel sad", "so happy", "scared"], "label": [0, 1, 4]}, features=features
    )
    datasets.DatasetDict({"train": train}).save_to_disk(str(tmp_path / "emotion"))
    cfg = DataConfig(
        name="emotion",
        source=DataSource.hub,
        task=TaskKind.classification,
        hub_id=str(tmp_path / "emotion"),
    )
    ex = load_examples(cfg)
    assert ex.texts == ["i feel sad", "so happy", "scared"]
    assert ex.labels == [0, 1, 4]
    assert ex.label_names == names


def test_hub_without_datasets_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    cfg = DataConfig(
        name="emotion",
        source=DataSource.hub,
        task=TaskKind.classification,
        hub_id="dair-ai/emotion",
    )
    with pytest.raises(ConfigError, match="`datasets` extra"):
        load_examples(cfg)


def _gsm_cfg(seed: int = 1) -> DataConfig:
    return DataConfig(
        name="gsm_symbolic",
        source=DataSource.generator,
        task=TaskKind.causal_lm,
        label_column=None,
        seed=seed,
    )


def test_gsm_symbolic_generates_questions_with_worked_answers() -> None:
    pytest.importorskip("reasoning_gym")
    ex = load_examples(_gsm_cfg(), num_wanted=5)
    assert len(ex) == 5
    assert all(t.endswith("Do not include units.") for t in ex.texts)
    assert all("####" in a for a in ex.targets)
    assert len(ex.strata) == 5


def test_gsm_symbolic_is_seeded() -> None:
    pytest.importorskip("reasoning_gym")
    assert load_examples(_gsm_cfg(1), num_wanted=3) == load_examples(_gsm_cfg(1), num_wanted=3)
    assert load_examples(_gsm_cfg(1), num_wanted=3) != load_examples(_gsm_cfg(2), num_wanted=3)


def test_gsm_symbolic_without_reasoning_gym_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ConfigError, match="`gsm` extra"):
        load_examples(_gsm_cfg(), num_wanted=3)


def test_unknown_packaged_name_lists_the_known_ones() -> None:
    cfg = DataConfig(name="sst2", source=DataSource.packaged, task=TaskKind.classification)
    with pytest.raises(ConfigError, match="rotten_tomatoes"):
        load_examples(cfg)


@pytest.mark.assets
def test_rotten_tomatoes_is_binary_fresh_positive() -> None:
    cfg = DataConfig(
        name="rotten_tomatoes", source=DataSource.packaged, task=TaskKind.classification
    )
    ex = load_examples(cfg)
    assert ex.label_names == ["rotten", "fresh"]
    assert (ex.labels.count(0), ex.labels.count(1)) == (5405, 7403)


@pytest.mark.assets
def test_rotten_tomatoes_plot_rows_join_when_named() -> None:
    cfg = DataConfig(
        name="rotten_tomatoes",
        source=DataSource.packaged,
        task=TaskKind.classification,
        labels=["rotten", "fresh", "plot"],
    )
    assert load_examples(cfg).labels.count(2) == 1083  # 1,097 plot rows, 14 without text


def test_hub_configuration_name_reaches_load_dataset() -> None:
    from splitlab.configure import compose_config
    from splitlab.data.sources import hub_load_args

    cfg = compose_config(["model=tiny_gpt2", "data=gsm8k"]).data
    assert hub_load_args(cfg) == (("openai/gsm8k", "main"), {"split": "train"})
    cfg.hub_config = None
    assert hub_load_args(cfg) == (("openai/gsm8k",), {"split": "train"})
