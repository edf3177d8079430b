"""HTML building blocks shared by a run's report.html and a sweep's report.html.

    .venv/bin/pytest tests/unit/test_analysis_result.py tests/integration/test_report_browser.py -q

Pure: strings in, strings out. Pages are self-contained (PNGs inlined as base64, no scripts, no
external links). Every number goes through `splitlab.analysis.formatting`; the headline table
keeps each figure's raw value in `data-value` beside its text, so a reader (or a test) can check
the page against the files it came from.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Sequence

import pandas as pd
from matplotlib.figure import Figure

from splitlab.analysis.formatting import format_frame, is_missing
from splitlab.analysis.result import Headline

_STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:auto}"
    "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px}"
    "td{text-align:right}td:first-child,th{text-align:left}img{max-width:100%}"
    "#headline td,#key-figures td:last-child{text-align:left}"
    "#headline td.value{font-size:16px;font-weight:bold}"
    "pre{background:#f6f6f6;padding:8px;font-size:12px;max-height:400px;overflow:auto}"
)

esc = html.escape


def page(title: str, body: Sequence[str]) -> str:
    """A whole HTML document around `body` (already HTML)."""
    head = (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
            f"<style>{_STYLE}</style></head><body>")  # fmt: skip
    return "\n".join([head, *body, "</body></html>"])


def table_html(frame: pd.DataFrame, *, table_id: str | None = None) -> str:
    """`frame` as an HTML table, every cell formatted for people by its column's name."""
    return format_frame(frame).to_html(index=False, escape=True, border=0, table_id=table_id)


def figure_png(fig: Figure) -> bytes:
    """The figure as PNG bytes, at the resolution every report uses."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def image_html(name: str, png: bytes) -> str:
    """A figure: its heading and the PNG inlined."""
    encoded = base64.b64encode(png).decode("ascii")
    return (f"<h2>Figure: {esc(name)}</h2>"
            f"<img alt='{esc(name)}' src='data:image/png;base64,{encoded}'>")  # fmt: skip


def headline_html(items: Sequence[Headline]) -> str:
    """The result table: one row per figure, its raw value in `data-value` (JSON)."""
    rows = []
    for item in items:
        raw = "" if is_missing(item.value) else json.dumps(item.value)
        rows.append(f"<tr data-key='{esc(item.key)}' data-value='{esc(raw)}'>"
                    f"<th>{esc(item.label)}</th><td class='value'>{esc(item.text)}</td>"
                    f"<td class='note'>{esc(item.note)}</td></tr>")  # fmt: skip
    return f"<table id='headline'>{''.join(rows)}</table>"
