"""Splitting must not change a token: one process (whole-model loader) vs the ring (shard loader).

The reference loads the whole model with `from_pretrained` and generates with the model's own
forward and cache; the ring runs one process per stage with the shard loader, over TCP on the
given addresses. The two sides share no loader, so a loader bug cannot cancel out. Exit 0 only
if every token id matches; a mismatch (exit 1) names its index and what it points at: index 0
is prefill (causal mask or rotary positions across a stage boundary), a later index is
decode-time per-stage KV cache handling. A config error (cuts past the model's blocks
included) exits 2 before the reference runs; a ring that fails exits with its stages' code.

The ring is configured like any run: Hydra overrides on top of `task=infer` and this check's
defaults (SmolLM2, cuts 10,20, stages on 127.0.0.1/.2/.3, a story prompt, 64 tokens).

    python tools/check_equivalence.py                       # SmolLM2, cuts 10,20, 64 tokens
    python tools/check_equivalence.py model=tiny_llama architecture.cuts=[1,3] task.max_new_tokens=16
    # 200 tokens, shift b_1 up by one block at token 100, against the same ring without the shift
    python tools/check_equivalence.py task.max_new_tokens=200 architecture.window=20 \
        planner=forced_shift planner.at_token=100 planner.shift_k=1 planner.boundary=1 \
        --baseline noshift
    # as root: each stage in its own host of the ring3_edge testbed (0.5 core, 100 Mbit/s)
    python tools/check_equivalence.py --testbed ring3_edge

With `planner=forced_shift` the ring shifts boundary `planner.boundary` by `planner.shift_k`
blocks at the first barrier (every `architecture.window` tokens) at or after
`planner.at_token`. The baseline is the one-process reference (default) or `noshift`: the same
ring, same barriers, `planner=noop`.

`--testbed NAME` runs the ring on that testbed (`testbed=NAME`; the placement, not the default
loopback addresses, decides where each stage runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitlab import assets
from splitlab.config.schema import Config
from splitlab.configure import compose_config
from splitlab.errors import ExitCode, SplitlabError
from splitlab.infer.prompt import encode_prompt, eos_ids
from splitlab.infer.ring import GenParams
from splitlab.infer.stage import tokenizer_ref
from splitlab.launch.ring import model_ref, run_ring
from splitlab.preflight import preflight
from splitlab.reference.generate import generate_reference
from splitlab.telemetry.log import leave

DTYPES = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16}


def first_mismatch(ref: list[int], ring: list[int]) -> int | None:
    """Index of the first differing token id (a length difference counts), None if equal."""
    for i, (a, b) in enumerate(zip(ref, ring, strict=False)):
        if a != b:
            return i
    return None if len(ref) == len(ring) else min(len(ref), len(ring))


def diagnose(index: int) -> str:
    if index == 0:
        return "prefill: causal mask or rotary positions across a stage boundary"
    return "decode: per-stage KV cache handling (positions or cache lengths after prefill)"


DEFAULTS = [
    "task=infer", "model=smollm2_135m", "architecture.cuts=[10,20]",
    "task.prompt=Write a long story about a robot who learns to paint.",
]  # fmt: skip
LOOPBACK_HOSTS = "architecture.peer_hosts=[127.0.0.1,127.0.0.2,127.0.0.3]"  # without a testbed


def defaults(testbed: str | None) -> list[str]:
    """This check's defaults: loopback stage addresses, or `testbed=NAME` instead."""
    return [*DEFAULTS, f"testbed={testbed}" if testbed else LOOPBACK_HOSTS]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides (task=infer is implied)")
    p.add_argument("--baseline", default="reference", choices=["reference", "noshift"])
    p.add_argument("--run-dir", default=None)
    p.add_argument("--testbed", default=None, help="run the ring on this testbed preset (root)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # the cuts meet the model's real block count here, before the reference run
        cfg = compose_config([*defaults(args.testbed), *args.overrides])
        preflight(cfg)
    except SplitlabError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    task = cfg.task
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="check_equivalence-"))
    folder = Path(model_ref(cfg.model, run_dir, seed=task.seed))
    ref_tokenizer = tokenizer_ref(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(
        assets.resolve(ref_tokenizer) if ref_tokenizer else folder
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[cfg.model.dtype.value])
    model.to(torch.device(cfg.device)).eval()  # the reference runs on `device`
    if task.prompt_ids:
        prompt_ids, stop = torch.tensor([list(task.prompt_ids)]), ()
    else:
        prompt_ids = encode_prompt(tokenizer, task.prompt, chat=task.chat)
        stop = () if task.ignore_eos else eos_ids(model.config, tokenizer)
    gen = GenParams(max_new_tokens=task.max_new_tokens, eos_ids=stop)
    ring_cfg = cfg.architecture

    def ring_run(name: str, run_cfg: Config) -> tuple[dict | None, int]:
        """The ring's result, or None and the exit code to leave with (the stages' own)."""
        group, result = run_ring(run_cfg, run_dir=run_dir / name, timeout_s=args.timeout_s)
        if group.exit_code != 0 or result is None:
            print(f"FAIL: the {name} ring did not finish: {group.diagnosis()}", file=sys.stderr)
            return None, group.exit_code or int(ExitCode.ERROR)
        return result, 0

    if args.baseline == "noshift":
        del model
        # the same ring without the planner: its own keys (planner.at_token...) do not fit noop
        same = [o for o in args.overrides if not o.lstrip("+~").startswith("planner")]
        base, code = ring_run(
            "noshift", compose_config([*defaults(args.testbed), *same, "planner=noop"])
        )
        if base is None:
            return code
        ref = base["token_ids"]
    else:
        ref = generate_reference(model, prompt_ids, gen).token_ids
        del model
    shifting = cfg.planner.name == "forced_shift"
    result, code = ring_run("ring", cfg)
    if result is None:
        return code
    ring = result["token_ids"]
    hosts = ring_hosts(run_dir / "ring")
    shifted = _shift_applied(run_dir / "ring") if shifting else None
    planner = dataclasses.asdict(cfg.planner)
    report = {"reference": ref, "ring": ring, "cuts": ring_cfg.cuts, "hosts": hosts,
              "testbed": args.testbed, "run_dir": str(run_dir), "baseline": args.baseline,
              "planner": {k: getattr(v, "value", v) for k, v in planner.items()},
              "shift": shifted}  # fmt: skip
    if shifting and not shifted:
        print("FAIL: the forced shift never committed (see the window records)")
        return 1
    (run_dir / "equivalence.json").write_text(json.dumps(report), encoding="utf-8")
    index = first_mismatch(ref, ring)
    if index is not None:
        got = ring[index] if index < len(ring) else None
        want = ref[index] if index < len(ref) else None
        print(
            f"FAIL: token {index} differs (reference {want}, ring {got}): points at {diagnose(index)}"
        )
        return 1
    what = f", shift {shifted}" if shifted else ""
    print(
        f"OK: {len(ring)} of {len(ref)} token ids identical (cuts {ring_cfg.cuts}, hosts "
        f"{hosts}{f' on testbed {args.testbed}' if args.testbed else ''}, baseline "
        f"{args.baseline}{what}); {run_dir}"
    )
    return 0


def ring_hosts(run_dir: Path) -> list[str]:
    """The address every stage bound (its `stage_meta`), in stage order."""
    hosts = {}
    for path in sorted((run_dir / "traces").glob("stage-*.jsonl")):
        for line in path.open():
            rec = json.loads(line)
            if rec["kind"] == "stage_meta":
                hosts[rec["stage"]] = rec["host"]
                break
    return [hosts[i] for i in sorted(hosts)]


def _shift_applied(run_dir: Path) -> dict | None:
    """The head's committed forced-shift window (token and cuts), or None."""
    for line in (run_dir / "traces" / "stage-0.jsonl").open():
        rec = json.loads(line)
        if (
            rec["kind"] == "window"
            and not rec["aborted"]
            and rec["decision"].startswith("forced_shift: b")
        ):
            return {"token": rec["token"], "cuts": rec["cuts"], "decision": rec["decision"]}
    return None


if __name__ == "__main__":
    leave(main())
