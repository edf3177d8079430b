"""Seeded synthetic traces with known ground truth, for testing the analysis (never a benchmark).

    .venv/bin/pytest tests/unit/test_analysis_links.py tests/unit/test_analysis_plots.py -q

Pure: each generator takes a seed and returns a list of trace lines (dicts), each a
`splitlab.telemetry.records` record stamped as the tracer stamps it, so the synthetic traces
spell every field as the writers do; `write_traces` is the one function that touches files.
Hosts are only strings in the records; nothing here opens a socket.

The ring model: a run serves `num_requests` prompts; each starts with a prefill token whose
payload is `prompt_tokens * hidden_bytes` and continues with decode tokens of `hidden_bytes`.
For every link s-1 -> s,
    recv_wait_ms[s, t] = compute_ms[s-1, t] + alpha_ms[s] + beta_ms_per_byte[s] * bytes[s, t] + noise
which is exactly what `splitlab.analysis.links.derive_link_params` inverts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from splitlab.telemetry.records import (
    MicrobatchRecord,
    MigrationRecord,
    Record,
    RoundRecord,
    StageMetaRecord,
    TokenRecord,
    TransportRecord,
    WindowRecord,
    WrrRecord,
    stamp,
)

LOOPBACK_HOST = "127.0.0.1"


def lan_hosts(num_stages: int) -> list[str]:
    """Distinct private addresses, one per stage (strings only)."""
    return [f"10.0.0.{stage + 1}" for stage in range(num_stages)]


def ring_records(
    *,
    num_stages: int = 3,
    num_requests: int = 8,
    decode_tokens: int = 24,
    alpha_ms: Sequence[float] = (0.4, 0.6),
    beta_ms_per_byte: Sequence[float] = (8e-6, 2e-5),
    hosts: Sequence[str] | None = None,
    hidden_bytes: int = 4096,
    noise_ms: float = 0.02,
    seed: int = 0,
    t0_us: int = 1_700_000_000_000_000,
) -> list[dict[str, Any]]:
    """`stage_meta` and `token` records of a ring; alpha/beta are given per link 1..S-1."""
    if len(alpha_ms) != num_stages - 1 or len(beta_ms_per_byte) != num_stages - 1:
        raise ValueError(f"{num_stages} stages need {num_stages - 1} alpha and beta values")
    hosts = list(hosts) if hosts is not None else lan_hosts(num_stages)
    rng = np.random.default_rng(seed)
    records: list[dict[str, Any]] = []
    for stage in range(num_stages):
        records.append(_line(t0_us, "stage", stage, StageMetaRecord(
            stage=stage, host=hosts[stage], peer_host=hosts[(stage + 1) % num_stages],
            start=4 * stage, stop=4 * stage + 4, load_ms=120.0 + 10 * stage,
        )))  # fmt: skip
    clock_us = t0_us + 1_000_000
    token = 0
    for _ in range(num_requests):
        prompt_tokens = int(rng.integers(16, 512))
        for step in range(decode_tokens + 1):
            prefill = step == 0
            payload = hidden_bytes * (prompt_tokens if prefill else 1)
            compute = [
                float((2.0 + stage) * (1 + 0.01 * prompt_tokens * prefill) + rng.gamma(4, 0.05))
                for stage in range(num_stages)
            ]
            tpot = 0.0
            lines: list[tuple[int, TokenRecord]] = []
            for stage in range(num_stages):
                if stage == 0:
                    wait = float(rng.uniform(0.1, 0.3))  # the token id from the tail
                else:
                    link = alpha_ms[stage - 1] + beta_ms_per_byte[stage - 1] * payload
                    wait = max(0.0, compute[stage - 1] + link + float(rng.normal(0, noise_ms)))
                sent = 8 if stage == num_stages - 1 else payload  # the tail sends the token id
                tpot += compute[stage] + wait
                clock_us += int((compute[stage] + wait) * 1000)
                lines.append((clock_us, TokenRecord(
                    stage=stage, token=token, compute_ms=compute[stage], recv_wait_ms=wait,
                    send_ms=0.05, bytes=sent, prefill=prefill,
                )))  # fmt: skip
            head_us, head = lines[0]
            lines[0] = (head_us, replace(head, tpot_ms=tpot))  # the head times the whole trip
            records.extend(_line(us, "stage", stage, r) for stage, (us, r) in enumerate(lines))
            token += 1
    return records


def barrier_records(
    tokens: Sequence[dict[str, Any]], *, window: int = 20, migrate_every: int = 3, seed: int = 0
) -> list[dict[str, Any]]:
    """A `window` record every `window` tokens (each with `token`), a `migration` every few."""
    rng = np.random.default_rng(seed)
    head = [r for r in tokens if r.get("kind") == "token" and r["stage"] == 0]
    records: list[dict[str, Any]] = []
    for epoch, start in enumerate(range(window, len(head), window), start=1):
        at = head[start]
        aborted = bool(rng.random() < 0.1)
        records.append(_line(at["ts_us"] - 1, "stage", 0, WindowRecord(
            epoch=epoch, token=at["token"], barrier_ms=float(rng.uniform(1, 4)),
            prestage_ms=0.5, commit_ms=0.2, release_ms=0.1, n_acks=3,
            aborted=aborted, decision="noop" if epoch % migrate_every else "shift",
            obs={"theta_obs": 50.0, "q_cmp_obs": 0.1, "q_mem_obs": 0.2, "link_obs": 1.0},
        )))  # fmt: skip
        if epoch % migrate_every == 0 and not aborted:
            records.append(_line(at["ts_us"], "stage", 0, MigrationRecord(
                epoch=epoch, token=at["token"], boundary=1, k=1, side="receiver", layer_ids=[4],
                weights_ms=40.0, kv_ms=3.0, commit_ms=0.3, pause_ms=43.3, kv_bytes=1 << 20,
            )))  # fmt: skip
    return records


def training_records(
    *,
    num_owners: int = 2,
    num_workers: int = 2,
    num_rounds: int = 4,
    windows_per_round: int = 2,
    microbatches_per_window: int = 6,
    seed: int = 0,
    t0_us: int = 1_700_000_000_000_000,
) -> list[dict[str, Any]]:
    """`microbatch`, `wrr` and `round` records of a U-shape run with falling loss.

    Owners are `owner<i>` (role "owner", rank i) and workers `worker<j>`, as the launcher names
    them.
    """
    rng = np.random.default_rng(seed)
    records: list[dict[str, Any]] = []
    clock_us = t0_us
    for round_index in range(num_rounds):
        for w in range(windows_per_round):
            window = round_index * windows_per_round + w
            for owner in range(num_owners):
                weights = rng.dirichlet(np.ones(num_workers))
                counts = np.floor(weights * microbatches_per_window).astype(int)
                counts[0] += microbatches_per_window - counts.sum()
                for worker, count in enumerate(counts):
                    clock_us += 1000
                    records.append(_line(clock_us, "owner", owner, WrrRecord(
                        window=window, owner=f"owner{owner}", worker=f"worker{worker}",
                        count=int(count),
                    )))  # fmt: skip
                    for mb in range(int(count)):
                        for lane, nbytes in (
                            ("activation", 2 * 64 * 2048),
                            ("gradient", 64 * 2048),
                        ):
                            clock_us += 500
                            records.append(_line(clock_us, "owner", owner, MicrobatchRecord(
                                window=window, microbatch=mb, owner=f"owner{owner}",
                                worker=f"worker{worker}", lane=lane,
                                fwd_ms=float(rng.uniform(5, 9)), bwd_ms=float(rng.uniform(9, 15)),
                                bytes=int(nbytes * rng.uniform(0.8, 1.0)),
                            )))  # fmt: skip
        for owner in range(num_owners):
            loss = 2.5 * np.exp(-0.3 * round_index) + float(rng.normal(0, 0.02))
            records.append(_line(clock_us, "owner", owner, RoundRecord(
                round=round_index, owner=f"owner{owner}", loss=loss, perplexity=float(np.exp(loss)),
                accuracy=float(min(1.0, 0.4 + 0.1 * round_index + rng.normal(0, 0.01))),
                samples=96, bytes=10_000_000,
            )))  # fmt: skip
    return records


def transport_records(
    training: Sequence[dict[str, Any]], *, t0_us: int = 1_700_000_000_000_000
) -> list[dict[str, Any]]:
    """A closing `transport` counter snapshot per owner, summing its `microbatch` bytes per lane.

    Shaped as `splitlab.wire.counters.WireCounters.emit` writes it (`<lane>.bytes_sent`, ...).
    """
    totals: dict[int, dict[str, list[int]]] = {}  # by rank
    last_us = t0_us
    for record in training:
        if record.get("kind") != "microbatch":
            continue
        lane = totals.setdefault(record["rank"], {}).setdefault(record["lane"], [0, 0])
        lane[0] += 1
        lane[1] += int(record["bytes"])
        last_us = max(last_us, int(record["ts_us"]))
    records: list[dict[str, Any]] = []
    for rank, lanes in sorted(totals.items()):
        counters: dict[str, Any] = {}
        for lane, (frames, nbytes) in sorted(lanes.items()):
            counters[f"{lane}.frames_sent"], counters[f"{lane}.bytes_sent"] = frames, nbytes
        records.append(_line(last_us + 1, "owner", rank, TransportRecord(counters=counters)))
    return records


def _line(ts_us: int, role: str, rank: int, record: Record) -> dict[str, Any]:
    return stamp(record, ts_us=int(ts_us), role=role, rank=rank)


def write_traces(records: Sequence[dict[str, Any]], traces_dir: str | Path) -> list[Path]:
    """Writes records to `traces_dir/<role>-<rank>.jsonl` as the tracer would; returns the files."""
    folder = Path(traces_dir)
    folder.mkdir(parents=True, exist_ok=True)
    by_file: dict[Path, list[str]] = {}
    for record in records:
        path = folder / f"{record['role']}-{record['rank']}.jsonl"
        by_file.setdefault(path, []).append(json.dumps(record, separators=(",", ":")))
    for path, lines in by_file.items():
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return sorted(by_file)
