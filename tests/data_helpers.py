"""Small offline stand-ins for the data tests: a word-level tokenizer and tiny tables.

from data_helpers import word_tokenizer, write_table
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from splitlab.config.enums import DataSource, TaskKind
from splitlab.config.schema import DataConfig

WORDS = "the a film was good bad great awful plot and not very so fun dull long short".split()


def word_tokenizer(*, with_pad: bool = True) -> PreTrainedTokenizerFast:
    """Whitespace word tokenizer over WORDS (+ [UNK], [EOS], optionally [PAD]); no BOS."""
    specials = ["[UNK]", "[EOS]"] + (["[PAD]"] if with_pad else [])
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="[UNK]",
        eos_token="[EOS]",
        pad_token="[PAD]" if with_pad else None,
    )


def sentiment_frame(num_rows: int = 60) -> pd.DataFrame:
    """`num_rows` reviews of varying length; label "pos" for even rows, "neg" for odd ones."""
    texts = [
        " ".join(["very"] * (1 + i % 7) + ["good" if i % 2 == 0 else "bad"])
        for i in range(num_rows)
    ]
    return pd.DataFrame(
        {"text": texts, "label": ["pos" if i % 2 == 0 else "neg" for i in range(num_rows)]}
    )


def write_table(frame: pd.DataFrame, path: Path) -> Path:
    """Write `frame` in the format `path`'s suffix names (.csv, .tsv, .jsonl, .parquet)."""
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    elif path.suffix == ".tsv":
        frame.to_csv(path, index=False, sep="\t")
    elif path.suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    elif path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    else:
        raise ValueError(f"no writer for {path.suffix}")
    return path


def file_data_config(path: Path, **overrides: object) -> DataConfig:
    """A classification DataConfig reading `path`, with `overrides` on top."""
    base: dict[str, object] = {
        "name": "local",
        "source": DataSource.file,
        "task": TaskKind.classification,
        "path": str(path),
    }
    return DataConfig(**{**base, **overrides})  # type: ignore[arg-type]
