"""Calibration: measure a model's per-block cost terms on this machine and write them as JSON.

    .venv/bin/python tools/calibrate.py --quick --out /tmp/cal.json          # ~30 s, 2 cores
    .venv/bin/python tools/calibrate.py --out calibration.json                # to 8192, ~1 min
    splitlab task=calibrate model=smollm2_135m task.threads=1
    .venv/bin/python tools/calibrate.py --only decode,load --contexts 128,2048,8192

Fits per-block decode `c0 + c1 * (P + t)` from batches of >= 24 decode steps at contexts in a
geometric set up to `max_context` (or `task.contexts`), per-block prefill `d0 + d1 * P + d2 *
P^2` from prompts of >= `prefill_min_tokens`, and L_n, the time to load n blocks, `fixed_ms +
per_block_ms * n` (`"load"`, read by `analysis.fits.load_cost`); every fit has more distinct
points than parameters or is null with the reason. Times one block's weight load (cold or
warm page cache, as mincore says), the swap of a block to the device and back (null on CPU),
link alpha/beta from an active probe over the framed-tensor TCP path (loopback: flagged),
decode under a co-running process, and the thermal zones where the host has any.
`task.only` runs a subset of the probes (the rest are null, with a warning). The record is
`"calibrated": false` with a warning per reason the values do not hold off the target
device; what was not observed is null. Timed
inside a testbed host (`tools/calibrate.py --testbed NAME --host HOST`), `on_testbed` makes it
that emulated device's calibration: the host's probed link, `"calibrated": true`.

The file holds `{"version": 1, "records": {"<model>|<device>|<dtype>": record}}`; writing to an
existing file replaces only this key's record. `schema_from` diffs this record's keys against
another device file's (its same-key record, else its first).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from splitlab.analysis.fits import (
    CALIBRATION_VERSION,
    MODELS,
    CalibrationResult,
    Fit,
    NoFit,
    fit_decode,
    fit_link,
    fit_load,
    fit_prefill,
    schema_diff,
)
from splitlab.config.enums import CalibrateProbe
from splitlab.config.schema import CalibrateTaskConfig, Config, ModelConfig
from splitlab.errors import ConfigError
from splitlab.measure import probes

log = logging.getLogger(__name__)

MIN_DECODE_STEPS = 24  # shorter batches time jitter, not the KV term
MIN_ROUND_TRIPS = 30
R2_GOAL = 0.9


PROBES = tuple(p.value for p in CalibrateProbe)


@dataclass(frozen=True)
class CalibrateOptions:
    """What to time and how often (built from the task config by `options_from`)."""

    contexts: tuple[int, ...]  # decode contexts P (tokens)
    decode_steps: int  # decode steps per timed batch
    prefill_lengths: tuple[int, ...]  # prompt lengths P (tokens)
    link_sizes: tuple[int, ...]  # probe payloads (bytes)
    round_trips: int  # link probe round trips per size
    repeats: int = 3  # interleaved repetitions per prefill size (median taken)
    decode_repeats: int = 7  # interleaved decode batches per context (fastest taken)
    load_repeats: int = 7  # interleaved L_n reads per block count, cold and warm (fastest taken)
    num_blocks: int = 4  # consecutive middle blocks timed together (divided per block)
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    corunner_s: float = 20.0  # upper bound on the contention co-runner's life
    probes: tuple[str, ...] = PROBES  # which probes run (`CalibrateProbe` values)


def geometric(low: int, high: int) -> tuple[int, ...]:
    """low, 2 low, 4 low, ... up to and including high."""
    out = [low]
    while out[-1] * 2 < high:
        out.append(out[-1] * 2)
    return tuple(dict.fromkeys([*out, high]))


def _contexts(task: CalibrateTaskConfig, max_context: int) -> tuple[int, ...]:
    if not task.contexts:
        return geometric(128, max_context)
    contexts = tuple(sorted(set(task.contexts)))
    if contexts[0] < 1:
        raise ConfigError(f"task.contexts={list(task.contexts)}: contexts are tokens, need >= 1")
    need = len(MODELS["decode"][0]) + 1
    if CalibrateProbe.decode.value in _probes(task) and len(contexts) < need:
        raise ConfigError(
            f"task.contexts={list(task.contexts)}: {len(contexts)} distinct contexts; the decode "
            f"fit c0 + c1 * (P + t) needs at least {need}, more than its {need - 1} parameters"
        )
    return contexts


def _probes(task: CalibrateTaskConfig) -> tuple[str, ...]:
    chosen = {CalibrateProbe(p).value for p in task.only}
    return tuple(p for p in PROBES if p in chosen) if chosen else PROBES


def options_from(task: CalibrateTaskConfig) -> CalibrateOptions:
    """Validated probe options; `task.quick` shrinks the sweep (contexts to 2048, fewer sizes);
    `task.contexts` replaces the geometric decode contexts, `task.only` picks the probes.

    Raises:
        ConfigError: a setting below what makes its fit meaningful.
    """
    if task.decode_steps < MIN_DECODE_STEPS:
        raise ConfigError(
            f"task.decode_steps={task.decode_steps}: batches under {MIN_DECODE_STEPS} steps "
            "time jitter (r^2 collapses); use >= 24"
        )
    if task.probe_round_trips < MIN_ROUND_TRIPS:
        raise ConfigError(f"task.probe_round_trips={task.probe_round_trips}: need >= 30")
    if task.prefill_min_tokens < 512:
        raise ConfigError(
            f"task.prefill_min_tokens={task.prefill_min_tokens}: under 512 the P^2 term is not "
            "observable and d2 fits noise"
        )
    max_context = min(task.max_context, 2048) if task.quick else task.max_context
    if max_context < 256 and not task.contexts:
        raise ConfigError(f"task.max_context={task.max_context}: need >= 256 for a slope")
    p0 = task.prefill_min_tokens
    prefill = (
        (p0, p0 * 5 // 4, p0 * 3 // 2, p0 * 2)
        if task.quick
        else (p0, p0 * 2, p0 * 3, p0 * 4, p0 * 6)
    )
    link_top = 1 << 20 if task.quick else 4 << 20
    return CalibrateOptions(
        contexts=_contexts(task, max_context), decode_steps=task.decode_steps,
        prefill_lengths=prefill, link_sizes=geometric(1024, link_top),
        round_trips=task.probe_round_trips, repeats=2 if task.quick else 3,
        decode_repeats=4 if task.quick else 7, load_repeats=5 if task.quick else 7,
        num_blocks=task.blocks, threads=task.threads, probes=_probes(task),
    )  # fmt: skip


def model_checkpoint(model: ModelConfig, *, tag: str):  # noqa: ANN201 - CheckpointIndex
    """`model`'s checkpoint, opened (a random-init model is first written to a temporary
    folder named after `tag`): what the calibration benchmarks (tools/bench_ln.py,
    tools/bench_release.py) time."""
    import tempfile

    from splitlab.launch.ring import model_ref
    from splitlab.models.shard import open_checkpoint

    return open_checkpoint(model_ref(model, Path(tempfile.mkdtemp(prefix=f"{tag}-")), seed=0))


def _fit_record(fit: Fit | NoFit, points: Sequence[tuple[float, float]]) -> dict[str, Any]:
    base = fit.to_dict() if isinstance(fit, Fit) else {"params": None, "r2": None, "n": fit.n,
                                                        "warnings": [fit.reason]}  # fmt: skip
    return {**base, "points": [list(p) for p in points]}


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }  # fmt: skip


def _middle_span(num_layers: int, num_blocks: int):  # noqa: ANN202 - Span (import kept local)
    from splitlab.models.plan import Span

    num_blocks = max(1, min(num_blocks, num_layers))
    start = (num_layers - num_blocks) // 2
    return Span(start, start + num_blocks)


def measure_contention(part, options: CalibrateOptions) -> dict[str, Any]:  # noqa: ANN001
    """Decode at the shortest context alone and beside a co-running busy process."""
    context = options.contexts[0]

    def decode_ms() -> float:
        points = probes.time_decode(part, contexts=[context], steps=options.decode_steps,
                                    repeats=options.decode_repeats)  # fmt: skip
        return points[0][1]

    alone = decode_ms()
    with probes.corunner(options.corunner_s) as proc:
        if proc is None:
            return {"alone_ms": alone, "with_corunner_ms": None, "slowdown": None, "rho": None,
                    "note": "the co-runner did not start"}  # fmt: skip
        loaded = decode_ms()
    return {
        "context": context, "alone_ms": alone, "with_corunner_ms": loaded,
        "slowdown": loaded / alone if alone > 0 else None,
        "corunner": probes.CORUNNER_WHAT, "rho": None,
        "note": "rho not fitted: the co-runner saturates a core rather than applying a known load",
    }  # fmt: skip


def measure_load(index, span, options: CalibrateOptions, *, dtype: str  # noqa: ANN001
                 ) -> tuple[dict[str, Any], dict[str, Any], Fit | NoFit]:  # fmt: skip
    """One block's first (cold) read, and L_n: the fit of loading n blocks, cold and warm.

    Returns the `weight_load_ms` and `load` records and the cold fit; `load`'s top-level fit
    is the cold one (what a migration meets when the receiver's page cache does not hold the
    blocks), `load.warm` the same reads with the pages resident.
    """
    from splitlab.models.shard import load_blocks

    files = sorted(set(index.key_files.values()))
    one = probes.time_weight_load(lambda: load_blocks(index, [span.start], dtype=dtype), files)
    one["what"] = f"one block (layers.{span.start}) via load_blocks"
    counts = probes.load_counts(index.config.num_hidden_layers)
    timed = probes.time_load_n(lambda n: load_blocks(index, range(n), dtype=dtype), counts, files,
                               repeats=options.load_repeats)  # fmt: skip
    cold, warm = (fit_load(*zip(*timed[arm], strict=True)) for arm in ("cold", "warm"))
    record = {**_fit_record(cold, timed["cold"]), "cache": timed["cache"],
              "what": "load_blocks of layers 0..n-1, pages dropped before each read",
              "warm": _fit_record(warm, timed["warm"])}  # fmt: skip
    if isinstance(cold, Fit):
        record.update(cold.params)
    return one, record, cold


def calibrate(
    folder: str | Path, *, model: str, device: str, dtype: str, options: CalibrateOptions
) -> tuple[CalibrationResult, dict[str, Any]]:
    """Run the probes of `options.probes` on the checkpoint in `folder`; returns the record and
    extra context. A probe that did not run leaves its field null, and a warning says so."""
    from splitlab.models.shard import load_part, open_checkpoint

    if options.threads > 0:
        torch.set_num_threads(options.threads)
    run = set(options.probes)
    warnings: list[str] = []
    index = open_checkpoint(folder)
    span = _middle_span(index.config.num_hidden_layers, options.num_blocks)
    thermal_start = probes.read_thermal_c()
    t0 = time.perf_counter()
    one_block = load = None
    fits: dict[str, tuple[Fit | NoFit, list[tuple[float, float]]]] = {}
    if "load" in run:
        one_block, load, load_fit = measure_load(index, span, options, dtype=dtype)
        fits["load"] = (load_fit, load["points"])
    part, _ = load_part(index, span, dtype=dtype)
    part = part.to(device)
    torch_dtype = str(next(part.parameters()).dtype).removeprefix("torch.")
    if "decode" in run:
        points = probes.time_decode(part, contexts=options.contexts, steps=options.decode_steps,
                                    repeats=options.decode_repeats)  # fmt: skip
        fits["decode"] = (fit_decode(*zip(*points, strict=True)), points)
    if "prefill" in run:
        points = probes.time_prefill(part, lengths=options.prefill_lengths, repeats=options.repeats)
        fits["prefill"] = (fit_prefill(*zip(*points, strict=True)), points)
    swap_ms = probes.time_swap(part.to("cpu"), device) if "swap" in run else None
    if "link" in run:
        points = probes.probe_link(sizes=options.link_sizes, round_trips=options.round_trips)
        fits["link"] = (fit_link(*zip(*points, strict=True)), points)
    contention = measure_contention(part, options) if "contention" in run else None
    thermal_end = probes.read_thermal_c()
    elapsed_s = time.perf_counter() - t0

    skipped = [p for p in PROBES if p not in run]
    if skipped:
        warnings.append(f"not measured (task.only={','.join(options.probes)}): "
                        f"{', '.join(skipped)} are null")  # fmt: skip
    if run & {"decode", "prefill"}:
        where = f"{machine()['cpu']}, {torch.get_num_threads()} torch threads"
        warnings.append(f"c0/c1/d0/d1/d2 were timed on this host ({where}, device={device}), "
                        "not on the target device")  # fmt: skip
    for fit, _ in fits.values():
        if isinstance(fit, Fit):
            warnings += [f"{fit.model} fit: {w}" for w in fit.warnings]
        else:
            warnings.append(f"{fit.model} is null: {fit.reason}")
    decode = fits.get("decode", (None,))[0]
    if isinstance(decode, Fit) and (decode.r2 or 0.0) < R2_GOAL:
        warnings.append(f"decode r2={decode.r2:.3f} < {R2_GOAL}: a noisy host; rerun idle")
    if one_block is not None and one_block["cache"] != "cold":
        warnings.append(
            f"weight_load_ms is a {one_block['cache']} page-cache read (resident fraction "
            f"{one_block['resident_fraction_before']} after posix_fadvise DONTNEED), not a disk read"
        )
    if load is not None and load["cache"] != "cold":
        warnings.append(f"load (L_n) met a {load['cache']} page cache after posix_fadvise "
                        "DONTNEED: a memory copy, not a disk read")  # fmt: skip
    if "swap" in run and swap_ms is None:
        warnings.append(f"swap_ms is null: device={device} has no separate memory to swap to")
    link_record = None
    if "link" in fits:
        warnings.append("link alpha/beta come from an in-process loopback probe over TcpTransport: "
                        "memcpy and scheduling, NOT A LINK MEASUREMENT")  # fmt: skip
        link, points = fits["link"]
        link_record = {**_fit_record(link, points), "loopback": True}
        if isinstance(link, Fit):
            link_record.update(link.params)
    if contention is not None:
        warnings.append("contention.rho is null: " + contention["note"])
    thermal = None
    if thermal_start is None:
        warnings.append("thermal is null: this host exposes no thermal sensors")
    else:
        thermal = {"zones_start_degc": thermal_start, "zones_end_degc": thermal_end,
                   "theta_th": None, "gamma": None, "nu": None}  # fmt: skip
        warnings.append("thermal theta_th/gamma/nu are null: no throttling was observed")
    fit_records = {name: _fit_record(*fits[name]) if name in fits else None
                   for name in ("decode", "prefill")}  # fmt: skip
    result = CalibrationResult(
        model=model, device=device, dtype=torch_dtype, calibrated=False,
        warnings=tuple(warnings), decode=fit_records["decode"], prefill=fit_records["prefill"],
        weight_load_ms=one_block, swap_ms=swap_ms, link=link_record, load=load,
        contention=contention, thermal=thermal,
    )  # fmt: skip
    extra = {"machine": machine(), "options": asdict(options), "elapsed_s": elapsed_s,
             "blocks": [span.start, span.stop]}  # fmt: skip
    return result, extra


def write_record(path: Path, result: CalibrationResult, extra: dict[str, Any]) -> dict[str, Any]:
    """Adds (or replaces) this record's key in the file at `path`; returns the whole document."""
    document: dict[str, Any] = {"version": CALIBRATION_VERSION, "records": {}}
    if path.is_file():
        document = json.loads(path.read_text(encoding="utf-8"))
        document.setdefault("records", {})
    document["records"][result.key] = {**result.to_dict(), **extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return document


def diff_against(path: str | Path, key: str, record: dict[str, Any]) -> list[str]:
    """schema_diff of `record` (a) against the same-key (else first) record of another file (b)."""
    other = json.loads(Path(path).read_text(encoding="utf-8"))
    records = other.get("records") if isinstance(other.get("records"), dict) else None
    if records is None:  # a bare record, or a file keyed some other way
        return schema_diff(record, other)
    if not records:
        raise ConfigError(f"task.schema_from={str(path)!r}: no records in that file")
    return schema_diff(record, records.get(key) or next(iter(records.values())))


@dataclass
class CalibrateOutcome:
    path: Path
    result: CalibrationResult
    schema_diff: list[str] | None = field(default=None)


def run_calibration(cfg: Config) -> CalibrateOutcome:
    """Resolve the model folder, calibrate, write the JSON (and the schema diff, if asked)."""
    from splitlab.launch.ring import model_ref

    task = cfg.task
    options = options_from(task)
    run_dir = Path(cfg.run_dir or f"outputs/calibrate-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    folder = model_ref(cfg.model, run_dir, seed=task.seed)
    result, extra = calibrate(folder, model=cfg.model.name, device=cfg.device,
                              dtype=cfg.model.dtype.value, options=options)  # fmt: skip
    path = Path(task.out) if task.out else run_dir / "calibration.json"
    write_record(path, result, extra)
    outcome = CalibrateOutcome(path=path, result=result)
    if task.schema_from:
        outcome.schema_diff = diff_against(task.schema_from, result.key, result.to_dict())
    return outcome


def summary_lines(outcome: CalibrateOutcome) -> list[str]:
    result = outcome.result
    lines = [f"wrote {outcome.path} [{result.key}] calibrated={str(result.calibrated).lower()}"]
    for name, fit in (
        ("decode", result.decode),
        ("prefill", result.prefill),
        ("link", result.link),
        ("load", result.load),
    ):
        if fit is None:
            continue  # not measured (task.only): a warning says so
        r2 = fit.get("r2")
        params = fit.get("params") or {
            k: fit[k] for k in ("alpha_ms", "beta_ms_per_byte") if k in fit
        }  # a testbed's link: probed, not fitted
        shown = ", ".join(f"{k}={v:.4g}" for k, v in params.items())
        cache = f"  cache={fit['cache']}" if "cache" in fit else ""
        lines.append(f"{name}: {shown or 'no fit'}  r2={'n/a' if r2 is None else f'{r2:.4f}'}"
                     f"  n={fit.get('n', 'n/a')}{cache}")  # fmt: skip
    lines += [f"warning: {w}" for w in result.warnings]
    if outcome.schema_diff is not None:
        lines.append(f"schema diff against {outcome.result.key}: "
                     f"{len(outcome.schema_diff)} difference(s)")  # fmt: skip
        lines += [f"  {line}" for line in outcome.schema_diff]
    return lines


def run_calibrate(cfg: Config) -> int:
    """The `task=calibrate` runner: prints where the JSON went, the fits and the warnings."""
    outcome = run_calibration(cfg)
    for line in summary_lines(outcome):
        print(line)
    return 0


# --- on a testbed host: the emulated device is the target, its link the testbed's ---------------

_OFF_TARGET = "not on the target device"
_LOOPBACK_LINK = "NOT A LINK MEASUREMENT"


def on_testbed(
    result: CalibrationResult, *, host: str, testbed: dict[str, Any]
) -> CalibrationResult:
    """`result`, timed inside testbed host `host`, as a calibration of that emulated device.

    `testbed` is the testbed's record (`Testbed.record()`, a run's testbed.json). The compute
    fits stand (they were timed under the host's CPU budget and thread count); the loopback
    link probe is replaced by the host's link as the testbed probed it at start-up: TCP goodput
    per direction and small-message RTT through the link's delay (netem's, or the transport
    delay line's where the kernel has none: `rtt_delay_source`). alpha_ms = RTT / 2;
    beta_ms_per_byte = 8e-3 / Mbit/s, per direction; bucket_bytes is the depth of the link's
    token bucket at a degraded rate (`testbed.plan.tbf_for`: the configured `burst_kib`, else
    the floor a rate under ~16 Mbit/s gets), which `planner=model` prices hops with.
    `calibrated` is true when both directions were probed; a host on the unshaped side of the
    switch has no link to report.
    """
    from splitlab.testbed.plan import MIN_BURST_BYTES

    link = testbed["links"][host]
    probed, nominal = link.get("probed") or {}, link.get("nominal") or {}
    up, down, rtt = probed.get("up_mbit"), probed.get("down_mbit"), probed.get("rtt_ms")
    spec = testbed["hosts"][host]
    kept = [w for w in result.warnings if _OFF_TARGET not in w and _LOOPBACK_LINK not in w]
    kept.append(f"compute timed inside testbed {testbed['testbed']} host {host} "
                f"(cpu {spec['cpu'] or 'unlimited'}, {spec['threads']} threads)")  # fmt: skip
    if not (up and down and rtt is not None):
        kept.append(f"link is null: host {host} has no shaped link that the testbed probed")
        return replace(result, calibrated=False, link=None, warnings=tuple(kept))
    record = {
        "source": "testbed probe", "host": host, "loopback": False,
        "up_mbit": up, "down_mbit": down, "rtt_ms": rtt, "wire_rtt_ms": probed.get("wire_rtt_ms"),
        "delay_source": link.get("delay_source"), "nominal": nominal,
        "alpha_ms": rtt / 2,
        "beta_ms_per_byte": 8e-3 / min(up, down),
        "beta_up_ms_per_byte": 8e-3 / up, "beta_down_ms_per_byte": 8e-3 / down,
        "bucket_bytes": int(float(nominal.get("burst_kib") or 0) * 1024) or MIN_BURST_BYTES,
    }  # fmt: skip
    kept.append("link from the testbed's start-up probes: TCP goodput (a few % under the "
                "shaped rate: headers) and RTT through the link's delay")  # fmt: skip
    return replace(result, calibrated=True, link=record, warnings=tuple(kept))
