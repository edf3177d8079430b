"""Key figures and tables of one run, from its trace frame: what a report or a sweep row quotes.

    .venv/bin/pytest tests/unit/test_analysis_summary.py -q

Pure: frames in, dicts and frames out. `kinds_present` says which parts of the record contract
a run holds (a ring run has tokens, a training run rounds, microbatches and WRR records);
`key_figures` flattens the headline numbers into one dict of scalars (a sweep's CSV columns);
`tables` returns the per-stage, per-link, per-round and per-lane tables a report shows.
A figure the run does not hold is absent, never zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from splitlab.analysis.links import derive_link_params
from splitlab.analysis.traces import ANALYSED_KINDS, select, transport_by_lane
from splitlab.telemetry.records import round_number

# Headline figures in the order a report lists them (name -> what it is, with its unit).
FIGURE_DOCS: dict[str, str] = {
    "num_tokens": "tokens generated (head records)",
    "ttft_ms": "time to first token at the head (prefill trip), ms",
    "tpot_ms_median": "median time per output token at the head (decode only), ms",
    "tpot_ms_p90": "90th percentile time per output token, ms",
    "tokens_per_s": "1000 / median TPOT",
    "num_barriers": "control barriers run (head records)",
    "num_aborted": "barriers that aborted",
    "barrier_ms_median": "median barrier time at the head, ms",
    "num_migrations": "committed block moves",
    "num_rounds": "federated rounds recorded",
    "owners_val_loss": "mean over owners of the last round's validation loss, before FedAvg",
    "owners_val_accuracy": "mean over owners of the last round's validation accuracy, before "
    "FedAvg (not the merged model: that is final_metrics.json)",
    "num_microbatches": "microbatch records (all lanes)",
    "microbatch_bytes": "payload bytes of every microbatch record",
    "fwd_ms_median": "median forward time per microbatch, ms",
    "bwd_ms_median": "median backward time per microbatch, ms",
    "transport_bytes_sent": "bytes sent over every lane (last counter snapshot per process)",
    "trace_span_s": "first to last trace record of any process, s (not the whole job: "
    "final_metrics.json's wall_s is)",
}


def kinds_present(frame: pd.DataFrame) -> list[str]:
    """Record kinds of the contract found in `frame`, in contract order."""
    if "kind" not in frame.columns:
        return []
    found = set(frame["kind"].dropna().unique())
    return [kind for kind in ANALYSED_KINDS if kind in found]


def _median(series: pd.Series) -> float | None:
    values = pd.to_numeric(series, errors="coerce").dropna()
    return float(values.median()) if len(values) else None


def _head_tokens(tokens: pd.DataFrame) -> pd.DataFrame:
    return tokens[tokens["stage"].astype(int) == 0].sort_values("ts_us")


def _is_prefill(rows: pd.DataFrame) -> pd.Series:
    if "prefill" in rows.columns:
        return rows["prefill"].fillna(False).astype(bool)
    return rows["token"] == rows["token"].min()


def ring_figures(frame: pd.DataFrame) -> dict[str, float | int | None]:
    tokens = select(frame, "token")
    out: dict[str, float | int | None] = {}
    if tokens.empty:
        return out
    head = _head_tokens(tokens)
    out["num_tokens"] = int(len(head))
    if "tpot_ms" in head.columns and len(head):
        prefill = _is_prefill(head)
        out["ttft_ms"] = _median(head.loc[prefill, "tpot_ms"])
        decode = pd.to_numeric(head.loc[~prefill, "tpot_ms"], errors="coerce").dropna()
        if len(decode):
            out["tpot_ms_median"] = float(decode.median())
            out["tpot_ms_p90"] = float(np.percentile(decode, 90))
            out["tokens_per_s"] = 1e3 / float(decode.median())
    for stage, rows in tokens.groupby(tokens["stage"].astype(int), sort=True):
        decode = rows[~_is_prefill(rows)]
        out[f"stage{stage}_compute_ms_median"] = _median(decode["compute_ms"])
        out[f"stage{stage}_bytes_sent"] = int(pd.to_numeric(rows["bytes"]).sum())
    windows = head_records(select(frame, "window"))
    if not windows.empty:
        out["num_barriers"] = int(len(windows))
        out["num_aborted"] = int(windows["aborted"].fillna(False).astype(bool).sum())
        out["barrier_ms_median"] = _median(windows["barrier_ms"])
    migrations = select(frame, "migration")
    if not migrations.empty:
        out["num_migrations"] = int(len(unique_migrations(migrations)))
    return out


def head_records(rows: pd.DataFrame) -> pd.DataFrame:
    """Barrier records as the head wrote them (rank 0), or all of them when no rank says so."""
    if rows.empty or "rank" not in rows.columns:
        return rows
    head = rows[(rows["rank"] == 0) & (rows.get("role", "stage") == "stage")]
    return (head if not head.empty else rows).reset_index(drop=True)


def unique_migrations(rows: pd.DataFrame) -> pd.DataFrame:
    """One migration record per (epoch, boundary): donor and receiver may both write one."""
    if rows.empty:
        return rows
    keys = [k for k in ("epoch", "boundary") if k in rows.columns]
    return rows.drop_duplicates(keys).reset_index(drop=True)


def training_figures(frame: pd.DataFrame) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {}
    rounds = select(frame, "round")
    if not rounds.empty:
        out["num_rounds"] = int(rounds["round"].nunique())
        last = rounds[rounds["round"] == rounds["round"].max()]
        for key, column in (("owners_val_loss", "loss"), ("owners_val_accuracy", "accuracy")):
            if column in last.columns:  # a causal-LM run's traces carry no accuracy
                out[key] = float(pd.to_numeric(last[column]).mean())
    microbatches = select(frame, "microbatch")
    if not microbatches.empty:
        out["num_microbatches"] = int(len(microbatches))
        out["microbatch_bytes"] = int(pd.to_numeric(microbatches["bytes"]).sum())
        for column in ("fwd_ms", "bwd_ms"):
            if column in microbatches.columns:
                out[f"{column}_median"] = _median(microbatches[column])
    return out


def transport_totals(frame: pd.DataFrame) -> pd.DataFrame:
    """Last snapshot of each process's counters: rows (role, rank, lane, direction, frames, bytes);
    a lane that carried nothing in the run (a training run's kv lane) is left out."""
    lanes = transport_by_lane(frame)
    if lanes.empty:
        return lanes
    last = lanes.sort_values("ts_us").groupby(["role", "rank", "lane", "direction"], sort=True)
    totals = last.tail(1).drop(columns="ts_us").reset_index(drop=True)
    carried = pd.to_numeric(totals["bytes"], errors="coerce").fillna(0) > 0
    return totals[carried].reset_index(drop=True)


def key_figures(frame: pd.DataFrame) -> dict[str, float | int | None]:
    """Every headline figure this run holds (names in `FIGURE_DOCS`, plus per-stage ones)."""
    out = {**ring_figures(frame), **training_figures(frame)}
    if "ts_us" in frame.columns and len(frame):
        stamps = pd.to_numeric(frame["ts_us"], errors="coerce").dropna()
        if len(stamps):
            out["trace_span_s"] = float(stamps.max() - stamps.min()) / 1e6
    totals = transport_totals(frame)
    if not totals.empty:
        sent = totals[totals["direction"].isin(["sent", "total"])]
        out["transport_bytes_sent"] = int(pd.to_numeric(sent["bytes"]).fillna(0).sum())
    return out


def tables(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Named tables for a report; a table the run has no records for is absent."""
    out: dict[str, pd.DataFrame] = {}
    tokens = select(frame, "token")
    if not tokens.empty:
        rows: list[dict[str, Any]] = []
        for stage, group in tokens.groupby(tokens["stage"].astype(int), sort=True):
            decode = group[~_is_prefill(group)]
            rows.append({
                "stage": stage, "tokens": len(group),
                "compute_ms_median": _median(decode["compute_ms"]),
                "recv_wait_ms_median": _median(decode["recv_wait_ms"]),
                "send_ms_median": _median(decode.get("send_ms", pd.Series(dtype=float))),
                "bytes_sent": int(pd.to_numeric(group["bytes"]).sum()),
            })  # fmt: skip
        out["stages"] = pd.DataFrame(rows)
        links = [e.to_dict() for e in derive_link_params(frame)]
        if links:
            table = pd.DataFrame(links)
            # A loopback fit is scheduling delay, not a link: the table never shows its numbers.
            table.loc[table["loopback"], ["alpha_ms", "beta_ms_per_byte", "r2"]] = None
            out["links"] = table
    migrations = unique_migrations(select(frame, "migration"))
    if not migrations.empty:
        columns = ["epoch", "token", "boundary", "k", "weights_ms", "kv_ms", "commit_ms",
                   "release_ms", "kv_bytes"]  # fmt: skip
        out["migrations"] = migrations[[c for c in columns if c in migrations.columns]]
    rounds = select(frame, "round")
    if not rounds.empty:
        columns = ["round", "owner", "loss", "accuracy", "perplexity", "samples", "bytes"]
        table = rounds[[c for c in columns if c in rounds.columns]].sort_values(["round", "owner"])
        out["rounds"] = table.assign(round=table["round"].map(round_number))  # 1..N, as logged
    totals = transport_totals(frame)
    if not totals.empty:
        out["transport"] = totals
    return out
