"""One ring stage in its process: `python -m splitlab.node --role stage --rank I ...`.

Everything every stage must agree on comes from the run's resolved config: the model, the
cuts and every stage's address (`architecture.peer_hosts`, `splitlab.infer.topology`), the
ports (`architecture.base_port + i`), the window, the timeouts, the planner, drift and (head)
the generation settings (`task.prompt`, `task.max_new_tokens`, ...). Per host the node only
adds its bind address, device and session. The data-plane key comes from
`$SPLITLAB_SESSION_KEY` (`splitlab.wire.session_key`), never from argv. The head (stage 0)
tokenizes the prompt, drives generation, logs TTFT, TPOT and tokens/s and writes the prompt
and answer to `RUN/ring_result.json` (which `task=infer` prints);
every stage writes `RUN/traces/stage-<i>.jsonl`.

On a testbed (the config has `testbed.hosts`; the launcher starts this process inside its host)
the stage's transport sends through a delay line where a path to a peer has a one-way delay
(`splitlab.testbed.placement.node_delay_line`: this kernel has no netem), and the transport's
counters, with `delay_source`, go to this stage's trace.

`architecture.window` W > 0 turns on the control star and the window barrier: every stage also
dials the head on the control lane and its successor on the KV lane (migration), over the same
transport and handshake (`splitlab.infer.ring_wire`).

    .venv/bin/pytest tests/integration/test_ring_tcp.py -q
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from splitlab.config.enums import DType, LoaderKind, ModelSource
from splitlab.config.schema import (
    SPIN_US,
    Config,
    DriftConfig,
    InferTaskConfig,
    ModelConfig,
    PlannerConfig,
    RingConfig,
)
from splitlab.errors import ConfigError, SplitlabError
from splitlab.hosts import is_loopback
from splitlab.infer.compute import EchoCompute, PartCompute, StageCompute
from splitlab.infer.folders import RESULT_FILE, model_folder
from splitlab.infer.migration import Migrator
from splitlab.infer.parity import stage_versions
from splitlab.infer.planners import Planner, make_planner, planner_schema
from splitlab.infer.ring import GenParams, RingStage, StageIdentity
from splitlab.infer.ring_wire import (
    RingLinks,
    link_addresses,
    link_tcp_ring,
    stage_peer,
    stage_transport,
)
from splitlab.infer.topology import resolve_ring
from splitlab.infer.window import HeadControl, StageControl
from splitlab.models.plan import ring_plan
from splitlab.telemetry.records import LinksRecord, StageMetaRecord
from splitlab.telemetry.trace import Tracer
from splitlab.testbed.placement import node_delay_line
from splitlab.testbed.topology import Topology, topology_from_config
from splitlab.wire.delay import DelayLine

log = logging.getLogger("splitlab.infer.stage")


@dataclass(frozen=True, kw_only=True)
class StageRun:
    """What one stage process runs: the shared config's parts it needs plus its own facts."""

    stage: int  # this stage's index (0 = head)
    ring: RingConfig  # cuts and peer_hosts resolved; base_port set
    model_folder: Path | None  # None: the echo model (testing: no weights)
    num_layers: int  # the echo model's block count (the config's model.num_layers)
    dtype: DType
    device: str
    session: str  # the same on every stage
    run_dir: Path | None  # traces, logs, the head's result
    bind: str  # address this stage listens on
    generation: InferTaskConfig  # the head's prompt and sampling
    tokenizer: str | None  # tokenizer asset or folder; None = the model folder's
    planner: PlannerConfig
    drift: DriftConfig | None  # None = no drift
    testbed: Topology | None = None  # the testbed this stage runs on; None = none
    ctrl_fault: str | None = None  # testing: nack, hang or slow_kv at the barriers
    spin_us: float = SPIN_US  # transport.spin_us: how long a receive looks before it sleeps
    parity_override: dict[str, str] = field(default_factory=dict)  # testing: versions skew
    scripted_shifts: list[tuple[int, int, int]] = field(default_factory=list)  # testing: the
    # head's planner makes these (token, boundary, k) shifts instead of the config's planner

    @property
    def num_stages(self) -> int:
        return len(self.ring.cuts) + 1

    @property
    def drift_applied(self) -> str | None:
        """kernel (the launcher changes this testbed's cgroups and links), simulated (this
        stage sleeps) or None (no replayed drift)."""
        from splitlab.drift.kernel import drift_applied

        if self.drift is None:
            return None
        return drift_applied(self.drift, on_testbed=self.testbed is not None)

    @property
    def testbed_host(self) -> str | None:
        """The testbed host this stage runs on (`testbed.placement.stage`), if any."""
        return None if self.testbed is None else self.testbed.host_of("stage", self.stage)

    def delay_line(self) -> DelayLine | None:
        """The send-side delay line of this stage's paths to every other stage (testbed only;
        None where no path has a delay)."""
        if self.testbed is None:
            return None
        peers = {stage_peer(j): ("stage", j) for j in range(self.num_stages) if j != self.stage}
        return node_delay_line(self.testbed, "stage", self.stage, peers,
                               seed=self.generation.seed + self.stage)  # fmt: skip


def tokenizer_ref(model: ModelConfig) -> str | None:
    """`model.tokenizer` (an asset or folder), or None for the model folder's own (a random-init
    checkpoint is saved with its tokenizer)."""
    if model.tokenizer and ModelSource(model.source) is not ModelSource.random:
        return model.tokenizer
    return None


def stage_run(
    cfg: Config,
    stage: int,
    *,
    session: str,
    run_dir: Path | None,
    bind: str | None = None,
    echo: bool = False,
    ctrl_fault: str | None = None,
    parity_override: dict[str, str] | None = None,
    scripted_shifts: list[tuple[int, int, int]] | None = None,
) -> StageRun:
    """Stage `stage` of the ring `cfg` describes (`bind` default: its `peer_hosts` entry).

    Raises:
        ConfigError: not a ring, no such stage, no base port, or an unusable model reference.
    """
    ring = resolve_ring(cfg)
    if not 0 <= stage < len(ring.peer_hosts):
        raise ConfigError(f"--rank={stage}: the ring has {len(ring.peer_hosts)} stages")
    if ring.base_port <= 0:
        raise ConfigError(
            f"architecture.base_port={ring.base_port}: stages started from a config need the "
            "ring's ports (the launcher writes the port it picked; by hand, set it)"
        )
    task = cfg.task
    if not isinstance(task, InferTaskConfig):
        raise ConfigError(f"task={task.name.value}: ring stages need task=infer")
    drift = cfg.drift if cfg.drift.name != "none" else None
    testbed = topology_from_config(cfg.testbed) if cfg.testbed.hosts else None
    return StageRun(
        stage=stage, ring=ring, model_folder=None if echo else model_folder(cfg.model, run_dir),
        num_layers=cfg.model.num_layers, dtype=cfg.model.dtype,
        device=ring.stage_devices[stage] if ring.stage_devices else cfg.device,
        session=session, run_dir=run_dir, bind=bind or ring.peer_hosts[stage], generation=task,
        tokenizer=tokenizer_ref(cfg.model), planner=cfg.planner, drift=drift, testbed=testbed,
        ctrl_fault=ctrl_fault, spin_us=cfg.transport.spin_us,
        parity_override=dict(parity_override or {}), scripted_shifts=list(scripted_shifts or []),
    )  # fmt: skip


def build_compute(run: StageRun) -> tuple[StageCompute, StageIdentity, dict[str, Any], Any, Any]:
    """Load this stage's share of the model; returns compute, identity, stage_meta, the model
    config and the checkpoint index (migration loads blocks from this stage's own copy)."""
    config = index = None
    if run.model_folder is None:
        num_layers = run.num_layers
        span = ring_plan(num_layers, run.ring.cuts)[run.stage]
        versions = stage_versions(dtype="float32", device=run.device)
        model: dict[str, Any] = {"model_type": "echo"}
        compute: StageCompute = EchoCompute(span)
        meta: dict[str, Any] = {"loader": "echo"}
    else:
        from splitlab.models.shard import load_part, load_part_hf, open_checkpoint, owned_bytes

        folder = run.model_folder
        index = open_checkpoint(folder)
        config = index.config
        num_layers = index.family.num_layers(config)
        span = ring_plan(num_layers, run.ring.cuts)[run.stage]
        dtype = run.dtype.value
        if run.ring.loader is LoaderKind.hf:
            part, report = load_part_hf(folder, span, dtype=dtype)
        else:
            part, report = load_part(index, span, dtype=dtype)
        loaded = next(part.parameters()).dtype
        compute = PartCompute(part, device=run.device)
        versions = stage_versions(dtype=loaded, device=run.device)
        model = {
            "model_type": config.model_type,
            "hidden_size": index.family.hidden_size(config),
            "vocab_size": int(config.vocab_size),
        }
        meta = {"shard_load": asdict(report), "owned_bytes": owned_bytes(index, span, dtype=dtype),
                "model_folder": str(folder)}  # fmt: skip
    versions.update(run.parity_override)
    identity = StageIdentity(
        stage=run.stage, num_stages=run.num_stages, start=span.start, stop=span.stop,
        num_layers=num_layers, model=model, versions=versions, address=run.bind,
    )  # fmt: skip
    return compute, identity, meta, config, index


def planner_of(run: StageRun) -> Planner:
    """The head's planner: the config group's, or the test-only scripted shifts."""
    bypass = run.ring.bypass
    if run.scripted_shifts:
        shifts = [list(shift) for shift in run.scripted_shifts]
        return make_planner(planner_schema("scripted")(shifts=shifts), bypass=bypass)
    return make_planner(run.planner, bypass=bypass)


def build_control(run: StageRun, compute: StageCompute, identity: StageIdentity, index: Any,
                  links: RingLinks, tracer: Tracer) -> tuple[Any, Any]:  # fmt: skip
    """This stage's window control (head: planner + control star) and its drift source."""
    from splitlab.drift.kernel import KernelApplied
    from splitlab.drift.source import make_source

    me, n, ring = run.stage, identity.num_stages, run.ring
    drift = None
    if run.drift is not None:
        drift = make_source(run.drift, stage=me, num_stages=n, run_id=run.session,
                            run_dir=run.run_dir if me == 0 else None)  # fmt: skip
        if drift is not None and run.drift_applied == "kernel":
            drift = KernelApplied(drift)  # the launcher slows this host: nothing to inject
    migrator = Migrator(stage=me, compute=compute, cuts=list(ring.cuts),
                        num_layers=identity.num_layers, index=index, dtype=run.dtype.value,
                        kv_prev=links.kv_prev, kv_next=links.kv_next,
                        timeout_s=ring.ctrl_timeout_s, bypass=ring.bypass)  # fmt: skip
    log.debug("stage %d: migration warm-up %.2f ms", me, migrator.warm_up())
    if me == 0:
        control = HeadControl(window=ring.window, ctrls=links.ctrls, migrator=migrator,
                              planner=planner_of(run), drift=drift, tracer=tracer,
                              timeout_s=ring.ctrl_timeout_s,
                              prepare_ahead=ring.prepare_ahead)  # fmt: skip
    else:
        control = StageControl(stage=me, window=ring.window, ctrl=links.ctrl, migrator=migrator,
                               drift=drift, tracer=tracer, timeout_s=ring.ctrl_timeout_s,
                               entry_timeout_s=ring.data_timeout_s,
                               fault=run.ctrl_fault)  # fmt: skip
    return control, drift


def head_inputs(run: StageRun, config: Any) -> tuple[torch.Tensor, GenParams, Any]:
    """Prompt ids, generation params and the tokenizer (None for the echo model or prompt ids)."""
    task = run.generation
    gen_kwargs = dict(max_new_tokens=task.max_new_tokens, temperature=task.temperature,
                      top_k=task.top_k, seed=task.seed)  # fmt: skip
    if config is None:
        return torch.tensor([[1, 2, 3]]), GenParams.from_dict(gen_kwargs), None
    if task.prompt_ids:
        return torch.tensor([list(task.prompt_ids)]), GenParams.from_dict(gen_kwargs), None
    from transformers import AutoTokenizer

    from splitlab.infer.prompt import encode_prompt, eos_ids

    where = run.model_folder
    if run.tokenizer:
        from splitlab import assets

        where = assets.resolve(run.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(where)
    prompt_ids = encode_prompt(tokenizer, task.prompt, chat=task.chat)
    stop_ids = [] if task.ignore_eos else list(eos_ids(config, tokenizer))
    gen = GenParams.from_dict({**gen_kwargs, "eos_ids": stop_ids})
    return prompt_ids, gen, tokenizer


def run_stage(run: StageRun) -> int:
    """Run one stage to the end of generation; returns 0 (failures raise `SplitlabError`)."""
    ring, hosts = run.ring, run.ring.peer_hosts
    if not is_loopback(run.bind) and not ring.ctrl_host:
        log.warning(
            "bound to non-loopback %s without architecture.ctrl_host: set it to the HEAD's "
            "address (%s), not this stage's, or the control star will dial the wrong host",
            run.bind, hosts[0],
        )  # fmt: skip
    tracer = Tracer.for_run(run.run_dir, role="stage", rank=run.stage)
    transport = stage_transport(stage=run.stage, bind_host=run.bind, base_port=ring.base_port,
                                session=run.session, timeout_s=ring.data_timeout_s,
                                tracer=tracer, delay=run.delay_line(),
                                spin_us=run.spin_us)  # fmt: skip
    t0 = time.perf_counter()
    compute, identity, meta, config, index = build_compute(run)
    load_ms = (time.perf_counter() - t0) * 1e3
    n = identity.num_stages
    tracer.write(StageMetaRecord(stage=run.stage, start=identity.start, stop=identity.stop,
                 host=run.bind, peer_host=hosts[(run.stage + 1) % n], base_port=ring.base_port,
                 load_ms=load_ms, versions=identity.versions, run_id=run.session,
                 testbed_host=run.testbed_host, drift_applied=run.drift_applied,
                 **meta))  # fmt: skip
    log.info("stage %d/%d: blocks [%d, %d) loaded in %.0f ms; bound %s:%d",
             run.stage, n, identity.start, identity.stop, load_ms, run.bind,
             transport.address[1])  # fmt: skip
    stage = None
    links = RingLinks()
    control = drift = None
    try:
        if n > 1:
            links = link_tcp_ring(
                transport, stage=run.stage, hosts=list(hosts), base_port=ring.base_port,
                ctrl_host=ring.ctrl_host or hosts[0], window=ring.window,
                connect_timeout_s=ring.connect_timeout_s, timeout_s=ring.data_timeout_s,
                ctrl_timeout_s=ring.ctrl_timeout_s, bypass=ring.bypass and ring.window > 0,
            )  # fmt: skip
            addresses = link_addresses(transport, stage=run.stage, num_stages=n)
            tracer.write(LinksRecord(**addresses))
            log.info("linked: from %s (%s), to %s (%s)", links.up.peer_id, addresses["up"],
                     links.down.peer_id, addresses["down"])  # fmt: skip
            if ring.window > 0:
                control, drift = build_control(run, compute, identity, index, links, tracer)
        stage = RingStage(identity=identity, compute=compute, up=links.up, down=links.down,
                          tracer=tracer, strict_parity=ring.strict_parity,
                          timeout_s=ring.data_timeout_s, session=run.session, control=control,
                          drift=drift, peers=links.peers)  # fmt: skip
        if run.stage == 0:
            prompt_ids, gen, tokenizer = head_inputs(run, config)
            result = stage.generate(prompt_ids, stage.handshake(gen))
            text = tokenizer.decode(result.token_ids, skip_special_tokens=True) if tokenizer else ""
            prompt = run.generation.prompt if tokenizer else prompt_ids[0].tolist()
            summary = {"prompt": prompt, "token_ids": result.token_ids, "text": text,
                       "prompt_len": result.prompt_len, "stop_reason": result.stop_reason,
                       "ttft_ms": result.ttft_ms, "tpot_ms_median": result.tpot_ms_median,
                       "tpot_ms": result.tpot_ms, "tokens_per_s": result.tokens_per_s,
                       "roster": stage.roster}  # fmt: skip
            if run.run_dir is not None:
                run.run_dir.mkdir(parents=True, exist_ok=True)
                (run.run_dir / RESULT_FILE).write_text(json.dumps(summary), encoding="utf-8")
            # the launcher prints prompt and answer from RESULT_FILE; the head only logs figures
            log.info("%d tokens (%s), TTFT %.1f ms, TPOT median %.2f ms, %.1f tokens/s",
                     len(result.token_ids), result.stop_reason, result.ttft_ms,
                     result.tpot_ms_median, result.tokens_per_s)  # fmt: skip
        else:
            served = stage.serve(stage.handshake())
            log.info("stage %d served %d tokens", run.stage, served)
    except SplitlabError as exc:
        if stage is not None:
            stage.abort_downstream(exc)
        raise
    finally:
        transport.close()
        if drift is not None:
            drift.close()
        tracer.close()
    return 0
