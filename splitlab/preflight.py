"""Pre-spawn checks: what a run needs from this machine, checked before any node starts.

`splitlab.configure.validate` has already checked the config itself (and taken a local model
folder's facts, so cuts were checked against its real block count). `preflight` checks what
the nodes would otherwise find out only after starting: the data file (readable UTF-8 or
Parquet, with rows, the configured columns, and no more classes than the model's head), the
packaged model name, a tied head under `architecture=two_stage` (unless
`model.untie_embeddings`), the configured TCP ports, the broker and the selected loggers'
libraries. Each failure is a ConfigError (exit 2) naming the key and the value; rows dropped
for a blank text or label are said once, here, with their count. It stays light: the data file
(read once, as each owner will), config.json files, one bind and one connect per address.

    splitlab data.source=file data.path=/nonexistent          # exit 2 within seconds
    splitlab architecture=two_stage model=tiny_gpt2 data=gsm_symbolic   # tied head: exit 2
    splitlab logger=[tensorboard]     # exit 2 naming the pip extra when tensorboard is missing
    .venv/bin/pytest tests/integration/test_preflight.py -q
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from urllib.parse import urlsplit

from splitlab import assets
from splitlab.config.enums import DataSource, ModelSource, TaskKind
from splitlab.config.schema import (
    Config,
    DataConfig,
    FinetuneTaskConfig,
    InferTaskConfig,
    ModelConfig,
    TwoStageConfig,
)
from splitlab.control.broker_users import check_node_users
from splitlab.errors import ConfigError
from splitlab.loggers.registry import check_loggers
from splitlab.models.families import family_kind, get_family
from splitlab.models.folder import has_tokenizer, read_folder_config, tied_head

BROKER_TIMEOUT_S = 3.0  # longest wait for the broker's TCP port to accept
AMQP_PORT = 5672

log = logging.getLogger(__name__)


def check_data(data: DataConfig, model: ModelConfig, *, finetune: bool = True) -> None:
    """`data.source=file`: the file reads in its format, has the configured columns and rows
    to train on, and (a classifier, labels inferred) no more classes than `model.num_labels`."""
    from splitlab.data.sources import label_ids, read_table, usable_rows

    if DataSource(data.source) is not DataSource.file:
        return
    if not data.path:
        raise ConfigError("data.path must name a CSV/TSV/JSONL/Parquet file when data.source=file")
    path = Path(data.path).expanduser()
    frame, dropped = usable_rows(read_table(path), data)
    if not len(frame):
        blank = f" ({dropped} rows, each with a blank text or label)" if dropped else ""
        raise ConfigError(f"data.path={str(path)!r} has no rows to train on{blank}")
    if dropped:
        log.warning("data.path=%r: dropped %d of %d rows with a blank text or label",
                    str(path), dropped, dropped + len(frame))  # fmt: skip
    if not (finetune and data.task is TaskKind.classification and data.label_column):
        return
    try:
        _, names = label_ids(frame[data.label_column].tolist(), data.labels)
    except ConfigError as exc:
        raise ConfigError(f"data.path={str(path)!r}: {exc}") from None
    head = family_kind(model.family).task is TaskKind.classification
    if head and len(names) > model.num_labels:
        raise ConfigError(
            f"data.path={str(path)!r}: its {data.label_column!r} column has {len(names)} "
            f"classes {names[:10]} but model.num_labels={model.num_labels}; set "
            f"model.num_labels={len(names)} or name the classes in data.labels"
        )


def model_tied(model: ModelConfig) -> bool | None:
    """Whether the model's head is its embedding tensor; None where only the weights would say
    (a hub id, or a packaged asset not fetched yet)."""
    if model.tie_word_embeddings is not None:
        return model.tie_word_embeddings
    source = ModelSource(model.source)
    if source is ModelSource.random:  # the family's default, without importing transformers
        kind = family_kind(model.family)
        return kind.task is TaskKind.causal_lm and kind.ties_head
    adapter = get_family(model.family)
    if source is ModelSource.packaged and model.id and assets.is_cached(model.id):
        _, config = read_folder_config("model.id", assets.asset_dir(model.id))
        return tied_head(adapter, config)
    return None


def check_model(cfg: Config) -> None:
    """A packaged model names a known asset; a model folder without a tokenizer has one named
    (unless the ring is fed token ids); `two_stage` does not split a tied head."""
    model = cfg.model
    token_ids = isinstance(cfg.task, InferTaskConfig) and bool(cfg.task.prompt_ids)
    if model.path and not model.tokenizer and not token_ids and not has_tokenizer(Path(model.path)):
        raise ConfigError(
            f"model.path={model.path!r}: the folder has no tokenizer and model.tokenizer is "
            "unset; name one with model.tokenizer=<asset, hub id or folder>"
        )
    if ModelSource(model.source) is ModelSource.packaged and model.id not in assets.ASSETS:
        raise ConfigError(
            f"model.id={model.id!r}: not a packaged asset (known: {sorted(assets.ASSETS)}) "
            "nor a model folder"
        )
    two_stage = isinstance(cfg.architecture, TwoStageConfig)
    if two_stage and not model.untie_embeddings and model_tied(model):
        raise ConfigError(
            f"architecture=two_stage with model={model.name} ({model.path or model.id or 'random'}"
            "): its head is tied to the embedding (tie_word_embeddings=true), so the first and "
            "last stage would share one tensor across processes; set model.untie_embeddings=true "
            "(the head becomes its own copy at load), or use architecture=u_shape"
        )


def check_port_free(key: str, host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"{key}={port}: cannot listen on {host}:{port}: {exc.strerror}"
            ) from None


def check_broker(key: str, url: str) -> None:
    """The broker in `url` accepts TCP connections (the AMQP handshake is the nodes' job)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or AMQP_PORT
    try:
        socket.create_connection((host, port), timeout=BROKER_TIMEOUT_S).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"{key}={url!r}: no broker at {host}:{port} ({reason}); start RabbitMQ there or "
            "use control=embedded transport=tcp"
        ) from None


def check_network(cfg: Config) -> None:
    """The configured data port is free and the broker, where one is configured, is up.

    Under a testbed the nodes listen inside their host namespaces, so ports are theirs to bind,
    and the broker is reached through the testbed's relay, which only control=rabbitmq sets up.
    """
    transport = cfg.transport
    if cfg.testbed.hosts and transport.name == "rabbitmq" and cfg.control.name != "rabbitmq":
        raise ConfigError(
            f"testbed={cfg.testbed.name} with transport=rabbitmq needs control=rabbitmq "
            f"(control={cfg.control.name}): the broker is reached through the testbed's relay"
        )
    if transport.name == "tcp" and transport.port and not cfg.testbed.hosts:
        check_port_free("transport.port", transport.bind_host, transport.port)
    brokers: dict[str, str] = {}  # url -> the key that names it first
    if cfg.control.name == "rabbitmq":
        brokers.setdefault(cfg.control.url, "control.url")
    if transport.name == "rabbitmq":
        brokers.setdefault(transport.url, "transport.url")
    for url, key in brokers.items():
        check_broker(key, url)
    check_node_users(cfg.control, transport)


def preflight(cfg: Config) -> None:
    """Every pre-spawn check; launchers call it before starting any node process.

    Raises:
        ConfigError: naming the key and the value that would fail on a node.
    """
    check_data(cfg.data, cfg.model, finetune=isinstance(cfg.task, FinetuneTaskConfig))
    check_model(cfg)
    check_network(cfg)
    check_loggers(cfg.logger)
