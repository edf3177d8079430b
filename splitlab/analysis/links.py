"""Link alpha/beta per ring link from the ring's own token records (no active prober).

    .venv/bin/python tools/derive_link_params.py RUN/traces
    .venv/bin/pytest tests/unit/test_analysis_links.py -q

For link s-1 -> s, every token gives one sample
    y[t] = recv_wait_ms[s, t] - compute_ms[s-1, t]    against    bytes[s-1, t]
and `fit_link` regresses y on payload bytes: the slope is beta (ms per byte), the intercept
alpha (ms); `bytes` is what stage s-1 sent (the ring traces the sender's payload). The
head's input (the token id from the tail, a few bytes every time) is not a
link this can measure, so links are 1..S-1.

Assumptions, and where they break:
- Everything in stage s's wait other than compute[s-1] and the link is constant per token.
  On a single-sequence ring stage s also waits for the stages before s-1; their mean lands in
  alpha and their jitter in the residual. Their prefill compute grows with the same prompt as
  the payload, so for s >= 2 a prefill-driven beta also absorbs that growth: read beta with
  r^2 and n, and prefer traces whose byte spread does not come only from prefill.
- Beta needs at least two distinct payload sizes; a decode-only trace (fixed 1 x 1 x H
  payload) gives a `NoFit` that says so.
- On a testbed (the run folder holds testbed.json) `shaped_paths` measures each shaped path
  directly instead: the receiving TCP transport times large frames as they cross it, and the
  sender's delay line reports how long it held frames; both sit in the `transport` records.
- On loopback (or two stages on one host) recv_wait is mostly peer scheduling delay, which on
  a contended host dwarfs the transfer. Such links are flagged `loopback=True` and the tool
  prints NOT A LINK MEASUREMENT instead of numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pandas as pd

from splitlab.analysis.fits import Fit, NoFit, fit_link
from splitlab.analysis.traces import TraceFormatError, select
from splitlab.hosts import is_loopback

NOT_A_LINK = "NOT A LINK MEASUREMENT"
_WILDCARD = {"0.0.0.0", "::", ""}


@dataclass(frozen=True)
class LinkEstimate:
    """Alpha/beta of link `src_stage -> dst_stage`, or why there are none.

    `loopback` is True when the hosts say the bytes never left the machine; then alpha and
    beta, even if fitted, describe a memcpy plus scheduling, not a link. `note` carries the
    reason for a flag or a missing fit.
    """

    src_stage: int
    dst_stage: int
    src_host: str | None
    dst_host: str | None
    n: int
    alpha_ms: float | None
    beta_ms_per_byte: float | None
    r2: float | None
    loopback: bool
    note: str | None = None

    @property
    def is_measurement(self) -> bool:
        return not self.loopback and self.alpha_ms is not None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _hosts(frame: pd.DataFrame) -> dict[int, dict[str, str | None]]:
    meta = select(frame, "stage_meta")
    out: dict[int, dict[str, str | None]] = {}
    for record in meta.to_dict("records"):
        peer = record.get("peer_host")
        out[int(record["stage"])] = {
            "host": str(record["host"]),
            "peer_host": None if peer is None or pd.isna(peer) else str(peer),
        }
    return out


def link_locality(
    src: dict[str, str | None] | None, dst: dict[str, str | None] | None
) -> tuple[bool, str | None]:
    """(loopback?, reason) for a link from the two stages' `stage_meta` hosts."""
    if src is None or dst is None:
        return False, "no stage_meta for one end: cannot tell whether this link is real"
    candidates = [("receiver binds", dst.get("host")), ("sender sends to", src.get("peer_host"))]
    for label, host in candidates:
        if is_loopback(host):
            return True, f"{label} {host}, a loopback address"
    src_host, dst_host = src.get("host"), dst.get("host")
    if src_host == dst_host and src_host not in _WILDCARD:
        return True, f"both stages on host {src_host}"
    return False, None


def link_samples(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (link, token): dst_stage, token, bytes, y_ms = recv_wait[s] - compute[s-1]."""
    tokens = select(frame, "token")
    if tokens.empty:
        return pd.DataFrame(columns=["dst_stage", "token", "bytes", "y_ms"])
    keys = ["session", "token"] if "session" in tokens.columns else ["token"]
    tokens = tokens.assign(stage=tokens["stage"].astype(int))
    duplicated = tokens.duplicated(["stage", *keys])
    if duplicated.any():
        row = tokens[duplicated].iloc[0]
        raise TraceFormatError(
            f"stage {row['stage']} has two token records for {dict(row[keys])}; "
            "tokens must be unique per stage (add a `session` field per generation)"
        )
    parts: list[pd.DataFrame] = []
    stages = sorted(tokens["stage"].unique())
    for stage in stages:
        if stage == 0 or stage - 1 not in stages:
            continue
        dst = tokens[tokens["stage"] == stage][[*keys, "recv_wait_ms"]]
        src = tokens[tokens["stage"] == stage - 1][[*keys, "compute_ms", "bytes"]]
        joined = dst.merge(src, on=keys, how="inner")
        parts.append(pd.DataFrame({
            "dst_stage": stage, "token": joined["token"], "bytes": joined["bytes"].astype(float),
            "y_ms": joined["recv_wait_ms"].astype(float) - joined["compute_ms"].astype(float),
        }))  # fmt: skip
    if not parts:
        return pd.DataFrame(columns=["dst_stage", "token", "bytes", "y_ms"])
    return pd.concat(parts, ignore_index=True)


def derive_link_params(frame: pd.DataFrame) -> list[LinkEstimate]:
    """One estimate per ring link s-1 -> s found in the token records, in stage order."""
    samples = link_samples(frame)
    hosts = _hosts(frame)
    estimates: list[LinkEstimate] = []
    for dst_stage, rows in samples.groupby("dst_stage", sort=True):
        dst_stage = int(dst_stage)
        src, dst = hosts.get(dst_stage - 1), hosts.get(dst_stage)
        loopback, reason = link_locality(src, dst)
        fit: Fit | NoFit = fit_link(rows["bytes"].to_numpy(), rows["y_ms"].to_numpy())
        notes = [reason] if reason else []
        if isinstance(fit, Fit):
            notes.extend(fit.warnings)
            alpha, beta = fit.params["alpha_ms"], fit.params["beta_ms_per_byte"]
            r2 = fit.r2
        else:
            notes.append(fit.reason)
            alpha = beta = r2 = None
        estimates.append(LinkEstimate(
            src_stage=dst_stage - 1, dst_stage=dst_stage,
            src_host=src["host"] if src else None, dst_host=dst["host"] if dst else None,
            n=fit.n, alpha_ms=alpha, beta_ms_per_byte=beta, r2=r2, loopback=loopback,
            note="; ".join(notes) or None,
        ))  # fmt: skip
    return estimates


def format_estimate(estimate: LinkEstimate) -> str:
    """One table row; a loopback link prints the warning and its reason instead of numbers."""
    head = (f"link {estimate.src_stage}->{estimate.dst_stage} "
            f"({estimate.src_host or '?'} -> {estimate.dst_host or '?'}) n={estimate.n}")  # fmt: skip
    if estimate.loopback:
        return f"{head}  {NOT_A_LINK}: {estimate.note}"
    if estimate.alpha_ms is None or estimate.beta_ms_per_byte is None:
        return f"{head}  no fit: {estimate.note}"
    r2 = "n/a" if estimate.r2 is None else f"{estimate.r2:.4f}"
    mb_per_s = 1e-3 / estimate.beta_ms_per_byte if estimate.beta_ms_per_byte > 0 else float("nan")
    row = (f"{head}  alpha_ms={estimate.alpha_ms:.4f}  beta_ms_per_byte={estimate.beta_ms_per_byte:.4e}"
           f"  (~{mb_per_s:.1f} MB/s)  r2={r2}")  # fmt: skip
    return f"{row}  note: {estimate.note}" if estimate.note else row


# --- links of a testbed run: measured from the transport's own counters ------------------------


@dataclass(frozen=True)
class PathEstimate:
    """The shaped path `src_host -> dst_host` of a testbed run: nominal and measured figures.

    `rate_mbit` is the median of the large frames' rates the receiving transport timed as
    they crossed the path (`rx.<peer>.stream_median_mbit`, wire/tcp_reader.py). On a busy host
    single frames are off both ways: a sender starved mid-frame leaves the link idle (slower),
    and a receiver whose softirq work was deferred gets a backlog of packets at once (faster:
    22.6-22.9 Mbit/s on a 20 Mbit/s path at load 3-6, before the reader stopped timing frames
    it found mostly queued); `peak_mbit` is the fastest frame, `mean_mbit`
    all timed bytes over all timed milliseconds (what the run got, stalls included). `delay_ms` the least time the
    sender's delay line held a frame (`held_ms`), where the delay is added in the transport, and
    `delay_mean_ms` its mean (which adds the line's lateness on a busy host).
    """

    src: str  # sending node, e.g. "owner0"
    dst: str
    src_host: str
    dst_host: str
    frames: int
    nominal_mbit: float
    rate_mbit: float | None
    nominal_delay_ms: float
    delay_ms: float | None
    delay_mean_ms: float | None = None
    mean_mbit: float | None = None
    peak_mbit: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_NODE = re.compile(r"([a-z_]+?)(\d+)")  # a node's name: its role, then its rank


def node_host(record: dict[str, Any], node: str) -> str | None:
    """The testbed host of node `node` ("worker0", "owner1") from testbed.json's placement."""
    match = _NODE.fullmatch(node)
    hosts = record.get("placement", {}).get(match.group(1)) if match else None
    return hosts[int(match.group(2)) % len(hosts)] if match and hosts else None


def _nominal(record: dict[str, Any], a: str, b: str) -> tuple[float, float]:
    """(rate Mbit/s, one-way delay ms) from host a to b: a's up and b's down, delays added."""
    la, lb = (record["links"].get(h, {}).get("nominal", {}) for h in (a, b))
    rates = [r for r in (la.get("up_mbit", 0.0), lb.get("down_mbit", 0.0)) if r > 0]
    return (min(rates) if rates else 0.0), la.get("delay_ms", 0.0) + lb.get("delay_ms", 0.0)


def shaped_paths(frame: pd.DataFrame, record: dict[str, Any]) -> list[PathEstimate]:
    """One estimate per (sender, receiver) whose frames were timed, for a run on a testbed
    (`record`: the run's testbed.json). Paths within one host are left out."""
    wire = select(frame, "transport")
    if wire.empty:
        return []
    last = wire.groupby(["role", "rank"], sort=True).tail(1)  # counters are cumulative
    held: dict[tuple[str, str], dict[str, float]] = {}
    for row in last.to_dict("records"):
        sent = row.get("held_ms")
        if isinstance(sent, dict):
            for peer, figures in sent.items():
                held[(f"{row['role']}{int(row['rank'])}", peer)] = figures
    out: list[PathEstimate] = []
    for row in last.to_dict("records"):
        dst = f"{row['role']}{int(row['rank'])}"
        for key in sorted(k for k in row if k.startswith("rx.") and k.endswith(".stream_bytes")):
            src = key[len("rx.") : -len(".stream_bytes")]
            nbytes, ms = row[key], row.get(f"rx.{src}.stream_ms")
            src_host, dst_host = node_host(record, src), node_host(record, dst)
            if pd.isna(nbytes) or src_host is None or dst_host is None or src_host == dst_host:
                continue
            rate, delay = _nominal(record, src_host, dst_host)
            out.append(PathEstimate(
                src=src, dst=dst, src_host=src_host, dst_host=dst_host,
                frames=int(row.get(f"rx.{src}.stream_frames") or 0), nominal_mbit=rate,
                rate_mbit=_present(row.get(f"rx.{src}.stream_median_mbit")),
                peak_mbit=_present(row.get(f"rx.{src}.stream_peak_mbit")),
                mean_mbit=nbytes * 8 / (ms * 1e3) if ms and ms > 0 else None,
                nominal_delay_ms=delay, delay_ms=held.get((src, dst), {}).get("min_ms"),
                delay_mean_ms=held.get((src, dst), {}).get("mean_ms"),
            ))  # fmt: skip
    return out


def _present(value: Any) -> float | None:
    return None if value is None or pd.isna(value) else float(value)


def format_path(path: PathEstimate) -> str:
    """One table row: measured vs nominal rate and delay, with the ratio."""

    def vs(measured: float | None, nominal: float, unit: str) -> str:
        if measured is None:
            return f"n/a (nominal {nominal:g} {unit})"
        ratio = f" = {measured / nominal:.3f}x" if nominal > 0 else ""
        return f"{measured:.2f} {unit} (nominal {nominal:g}{ratio})"

    mean = f" (mean {path.mean_mbit:.2f})" if path.mean_mbit is not None else ""
    return (f"path {path.src}@{path.src_host} -> {path.dst}@{path.dst_host} frames={path.frames}"
            f"  rate {vs(path.rate_mbit, path.nominal_mbit, 'Mbit/s')}{mean}"
            f"  delay {vs(path.delay_ms, path.nominal_delay_ms, 'ms')}"
            f"  mean held {path.delay_mean_ms if path.delay_mean_ms is not None else 'n/a'} ms")  # fmt: skip
