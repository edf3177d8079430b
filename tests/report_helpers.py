"""A small fine-tuning run folder for report tests, and a reader for a report's headline table.

`write_training_run` writes what a finished main job leaves that the report reads: seeded
synthetic owner traces (`splitlab.analysis.synthetic`), a final_metrics.json and the resolved
config; `headline_rows` reads `<table id='headline'>` back from report.html (as written, or as
a browser's DOM dump).
"""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from splitlab.analysis.synthetic import training_records, transport_records, write_traces
from splitlab.config.load import save_resolved_config
from splitlab.configure import compose_config

# what the launcher writes (splitlab.launch.train): the last merged model on the test split
FINAL_METRICS: dict[str, Any] = {
    "round": 3, "split": "test", "samples": 1000, "val_loss": 0.4412345, "val_samples": 1000,
    "val_accuracy": 0.801, "val_perplexity": None, "wall_s": 185.4,
}  # fmt: skip


def write_training_run(
    run_dir: Path, *, num_workers: int = 1, final: dict[str, Any] | None = FINAL_METRICS
) -> Path:
    """A U-shape run folder: 2 owners x `num_workers` workers, 3 rounds, tiny_bert config."""
    records = training_records(num_owners=2, num_workers=num_workers, num_rounds=3)
    write_traces(records + transport_records(records), run_dir / "traces")
    save_resolved_config(compose_config(["model=tiny_bert"]), run_dir / "config.yaml")
    if final is not None:
        (run_dir / "final_metrics.json").write_text(json.dumps(final))
    return run_dir


class _Headline(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, Any]] = {}
        self._in_table = False
        self._row: dict[str, Any] | None = None
        self._cell: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table" and a.get("id") == "headline":
            self._in_table = True
        elif self._in_table and tag == "tr":
            raw = a.get("data-value") or ""
            self._row = {"value": json.loads(raw) if raw else None, "label": "", "text": ""}
            self.rows[a.get("data-key") or ""] = self._row
        elif self._row is not None and tag in ("th", "td"):
            self._cell = "label" if tag == "th" else ("text" if a.get("class") == "value" else None)

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_table, self._row = False, None
        elif tag in ("th", "td"):
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._row is not None and self._cell is not None:
            self._row[self._cell] += data


def headline_rows(page: str) -> dict[str, dict[str, Any]]:
    """key -> {"value": raw value (data-value, JSON), "label": ..., "text": shown value}, in the
    page's order."""
    parser = _Headline()
    parser.feed(page)
    return parser.rows
