"""A run's result, what its report leads with: the merged model's test metrics, wall time, bytes
moved, what ran where.

    .venv/bin/pytest tests/unit/test_analysis_result.py -q

Pure: `headline` takes the run's key figures (`splitlab.analysis.summary.key_figures`), its
`final_metrics.json` (the launcher's evaluation of the last merged checkpoint on examples no
owner trained or validated on), its `testbed.json` and its resolved config as dicts, and returns
the figures in the order a person reads them. The owners' validation before the last FedAvg
(`owners_val_*`) is not the run's result: non-IID owners' local models are biased toward their
own classes, and the merged model is what the run produced.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from splitlab.analysis.formatting import format_value, is_missing
from splitlab.analysis.links import node_host

FINAL_METRICS_FILE = "final_metrics.json"  # written by splitlab.launch.train
# splitlab.testbed.placement.RECORD_FILE; analysis reads files and imports no testbed code
TESTBED_FILE = "testbed.json"


@dataclass(frozen=True)
class Headline:
    """One headline figure: `key` names it (and its unit, for `format_value`)."""

    key: str
    label: str
    value: Any
    note: str = ""

    @property
    def text(self) -> str:
        return format_value(self.key, self.value)


def merged_figures(final: Mapping[str, Any] | None) -> dict[str, Any]:
    """`final_metrics.json` as `test_loss`, `test_accuracy`, `test_perplexity` (a metric the
    task does not have is absent); {} without the file."""
    if not final:
        return {}
    names = {"test_loss": "val_loss", "test_accuracy": "val_accuracy",
             "test_perplexity": "val_perplexity"}  # fmt: skip
    return {k: final[v] for k, v in names.items() if not is_missing(final.get(v))}


def loss_unit(*, accuracy: Iterable[Any] = (), perplexity: Iterable[Any] = ()) -> str:
    """The unit of a run's loss: a classifier's cross-entropy is per example, a causal LM's per
    token; told apart by which of accuracy and perplexity the run has values for."""
    if any(not is_missing(v) for v in accuracy):
        return "nats per example"
    if any(not is_missing(v) for v in perplexity):
        return "nats per token"
    return "nats"


def node_names(pairs: Iterable[tuple[str, int]]) -> list[str]:
    """Node names ("owner0") of (role, rank) pairs, coordinator first, then in name order."""
    names = {f"{role}{int(rank)}" for role, rank in pairs}
    return sorted(names, key=lambda n: (not n.startswith("coordinator"), n))


def placement(
    nodes: Iterable[str],
    *,
    testbed: Mapping[str, Any] | None = None,
    stage_hosts: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Where each node ran: its testbed host (and address), a ring stage's bound address, or
    "this machine"."""
    stage_hosts = stage_hosts or {}
    out: dict[str, str] = {}
    for node in nodes:
        host = node_host(dict(testbed), node) if testbed else None
        if host is not None:
            address = testbed.get("hosts", {}).get(host, {}).get("address")  # type: ignore[union-attr]
            out[node] = f"{host} ({address})" if address else host
        else:
            out[node] = stage_hosts.get(node, "this machine")
    return out


def where_text(where: Mapping[str, str], *, testbed: Mapping[str, Any] | None = None) -> str:
    """One line: the nodes grouped by where they ran."""
    groups: dict[str, list[str]] = {}
    for node, host in where.items():
        groups.setdefault(host, []).append(node)
    line = "; ".join(f"{', '.join(nodes)} on {host}" for host, nodes in groups.items())
    return f"testbed {testbed.get('testbed')}: {line}" if testbed else line


def _final_note(final: Mapping[str, Any]) -> str:
    split, samples, round_ = final.get("split"), final.get("samples"), final.get("round")
    return (f"merged model after round {round_}, on the {split} split "
            f"({format_value('samples', samples)} examples)")  # fmt: skip


def headline(
    *,
    figures: Mapping[str, Any],
    final: Mapping[str, Any] | None = None,
    where: Mapping[str, str] | None = None,
    testbed: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    loss_per: str = "nats",
) -> list[Headline]:
    """The run's result, in reading order; a figure the run does not hold is left out, but a
    fine-tuning run without `final` says that its merged model was not evaluated."""
    out: list[Headline] = []
    test = merged_figures(final)
    if test:
        note = _final_note(final or {})
        for key, label in (("test_accuracy", "test accuracy"),
                           ("test_perplexity", "test perplexity")):  # fmt: skip
            if key in test:
                out.append(Headline(key, label, test[key], note))
        if "test_loss" in test:
            out.append(Headline("test_loss", f"test loss (cross-entropy, {loss_per})",
                                test["test_loss"], note))  # fmt: skip
    elif "num_rounds" in figures:
        out.append(Headline("test_accuracy", "test result", None,
                            "the merged model was not evaluated (no final_metrics.json)"))  # fmt: skip
    ring = (("num_tokens", "tokens generated", "at the head"),
            ("ttft_ms", "time to first token", "prefill trip at the head"),
            ("tpot_ms_median", "time per output token", "median over decode tokens"),
            ("tokens_per_s", "tokens per second", "1000 / median TPOT"))  # fmt: skip
    for key, label, note in ring:
        if not is_missing(figures.get(key)):
            out.append(Headline(key, label, figures[key], note))
    if not is_missing(figures.get("num_rounds")):
        out.append(Headline("num_rounds", "federated rounds", figures["num_rounds"]))
    if final and not is_missing(final.get("wall_s")):
        out.append(Headline("wall_s", "wall time", final["wall_s"],
                            "the launcher's start to the end of the final evaluation"))  # fmt: skip
    elif not is_missing(figures.get("trace_span_s")):
        out.append(Headline("trace_span_s", "wall time (traced)", figures["trace_span_s"],
                            "first to last trace record of any process (model loading and "
                            "the final evaluation fall outside)"))  # fmt: skip
    if not is_missing(figures.get("transport_bytes_sent")):
        out.append(Headline("transport_bytes_sent", "bytes moved",
                            figures["transport_bytes_sent"],
                            "sent by every process over every lane (wire counters)"))  # fmt: skip
    if where:
        out.append(Headline("where", "what ran where", where_text(where, testbed=testbed)))
    if config:
        transport = (config.get("transport") or {}).get("name")
        control = (config.get("control") or {}).get("name")
        model = (config.get("model") or {}).get("name")
        parts = [f"model {model}" if model else "", f"{transport} data plane" if transport else "",
                 f"{control} control" if control else ""]  # fmt: skip
        if any(parts):
            out.append(Headline("setup", "setup", ", ".join(p for p in parts if p)))
    return out
