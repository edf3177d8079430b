"""Key figures and tables from synthetic ring and training frames: present when recorded, absent
otherwise.

.venv/bin/pytest tests/unit/test_analysis_summary.py -q
"""

from __future__ import annotations

import pandas as pd
import pytest

from splitlab.analysis.summary import key_figures, kinds_present, tables
from splitlab.analysis.synthetic import (
    barrier_records,
    ring_records,
    training_records,
    transport_records,
)


def test_ring_figures_quote_the_head_decode_tpot() -> None:
    tokens = ring_records(num_stages=3, num_requests=1, decode_tokens=10)
    frame = pd.DataFrame(tokens)
    head_decode = [
        r["tpot_ms"]
        for r in tokens
        if r["kind"] == "token" and r["stage"] == 0 and not r["prefill"]
    ]
    figures = key_figures(frame)
    assert figures["num_tokens"] == 11
    assert figures["tpot_ms_median"] == pytest.approx(pd.Series(head_decode).median())
    assert "owners_val_loss" not in figures and "num_barriers" not in figures


def test_barriers_counted_once_and_migrations_deduplicated() -> None:
    tokens = ring_records(num_requests=2, decode_tokens=40)
    barriers = barrier_records(tokens, window=10, migrate_every=2)
    mirrored = [{**r, "rank": 1} for r in barriers]  # another stage's view of the same barrier
    figures = key_figures(pd.DataFrame(tokens + barriers + mirrored))
    assert figures["num_barriers"] == sum(r["kind"] == "window" for r in barriers)
    assert figures["num_migrations"] == sum(r["kind"] == "migration" for r in barriers)


def test_training_figures_and_tables() -> None:
    records = training_records(num_owners=2, num_rounds=3)
    frame = pd.DataFrame(records + transport_records(records))
    figures = key_figures(frame)
    last = [r for r in records if r["kind"] == "round" and r["round"] == 2]
    assert figures["num_rounds"] == 3
    assert figures["owners_val_loss"] == pytest.approx(sum(r["loss"] for r in last) / 2)
    mb_bytes = sum(r["bytes"] for r in records if r["kind"] == "microbatch")
    assert figures["microbatch_bytes"] == figures["transport_bytes_sent"] == mb_bytes
    assert set(tables(frame)) == {"rounds", "transport"}
    assert sorted(set(tables(frame)["rounds"]["round"])) == [1, 2, 3]  # as logged, not 0..2
    assert kinds_present(frame) == ["microbatch", "round", "wrr", "transport"]


def test_loopback_links_show_no_numbers() -> None:
    frame = pd.DataFrame(ring_records(hosts=["127.0.0.1"] * 3))
    links = tables(frame)["links"]
    assert links["loopback"].all() and links["alpha_ms"].isna().all()
