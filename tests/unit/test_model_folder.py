"""A local model folder's facts from its config.json; the data file's header checks.

pytest tests/unit/test_model_folder.py -q
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from model_helpers import tiny_config

from splitlab.config.enums import ModelSource
from splitlab.config.schema import DataConfig
from splitlab.configure import compose_config
from splitlab.data.sources import check_columns, read_table
from splitlab.errors import ConfigError
from splitlab.models.families import get_family
from splitlab.models.folder import local_folder, read_folder_config, resolve_local_model


def _save(folder: Path, family: str, *, num_layers: int) -> Path:
    config = get_family(family).make_config(tiny_config(family, num_layers=num_layers))
    get_family(family).model_class(config)(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("ref", ["minilm", "meta-llama/Llama-3.2-1B", "gpt2"])
def test_asset_names_and_hub_ids_are_not_folders(ref: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = compose_config(["model=llama3_2_1b"]).model
    assert local_folder(dataclasses.replace(model, id=ref)) is None


@pytest.mark.parametrize(("key", "ref"), [("path", "/no/such/folder"), ("id", "./nope")])
def test_a_missing_folder_names_its_key(key: str, ref: str) -> None:
    model = dataclasses.replace(compose_config([]).model, **{key: ref})
    with pytest.raises(ConfigError, match=f"model.{key}='{ref}': no such folder"):
        local_folder(model)


def test_a_tied_gpt2_folder_under_a_bert_preset_takes_the_folder_facts(tmp_path: Path) -> None:
    folder = _save(tmp_path / "gpt2", "gpt2", num_layers=5)
    preset = compose_config([]).model  # minilm: bert, packaged, 6 blocks
    model = resolve_local_model(dataclasses.replace(preset, path=str(folder)))
    assert (model.family, model.source, model.num_layers, model.hidden_size) == (
        "gpt2", ModelSource.hub, 5, 32,
    )  # fmt: skip
    assert model.tie_word_embeddings is True
    assert model.id == model.path == str(folder.resolve())


def test_a_folder_without_weights_or_with_an_unknown_type_is_refused(tmp_path: Path) -> None:
    folder = _save(tmp_path / "llama", "llama", num_layers=2)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no weights"):
        read_folder_config("model.path", folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ConfigError, match="model_type='t5': no registered family"):
        read_folder_config("model.path", folder)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".tsv"])
def test_read_table_reads_the_header(suffix: str, tmp_path: Path) -> None:
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": 0}\n')
    else:
        sep = "\t" if suffix == ".tsv" else ","
        path.write_text(f"text{sep}label\na{sep}1\n")
    assert list(read_table(path, nrows=2).columns) == ["text", "label"]


def test_check_columns_names_the_key_of_a_missing_pair_column() -> None:
    data = DataConfig(name="f", source="file", task="classification", label_column=None,
                      text_pair_column="second")  # fmt: skip
    with pytest.raises(ConfigError, match=r"data.text_pair_column='second'.*\['text'\]"):
        check_columns(["text"], data)
