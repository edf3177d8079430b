"""Splitting must not change a token: one process (whole-model loader) vs the ring (shard loader).

The reference loads the whole model with `from_pretrained` and generates with the model's own
forward and cache; the ring runs one process per stage with the shard loader, over TCP on the
given addresses. The two sides share no loader, so a loader bug cannot cancel out. Exit 0 only
if every token id matches; a mismatch names its index and what it points at: index 0 is
prefill (causal mask or rotary positions across a stage boundary), a later index is decode-time
per-stage KV cache handling.

    python tools/check_equivalence.py                       # SmolLM2, cuts 10,20, 64 tokens
    python tools/check_equivalence.py --model /path/to/folder --cuts 1,3 --max-new-tokens 16
    # 200 tokens, shift b_1 up by one block at token 100, against the same ring without the shift
    python tools/check_equivalence.py --max_new_tokens 200 --window 20 --forced_shift_at 100 \
        --shift_k 1 --shift_boundary 1 --baseline noshift

With `--forced_shift_at T` the ring runs the window barrier (`--window`) and shifts boundary
`--shift_boundary` by `--shift_k` blocks at the first barrier at or after token T. The baseline
is the one-process reference (default) or `noshift`: the same ring, same barriers, no shift.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitlab.config.enums import DType
from splitlab.infer.prompt import encode_prompt, eos_ids
from splitlab.infer.reference import generate_reference
from splitlab.infer.ring import GenParams
from splitlab.infer.stage import resolve_model_folder
from splitlab.launch.ring import RingLayout, pick_base_port, run_ring

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2_135m", help="model folder or packaged asset name")
    p.add_argument("--cuts", default="10,20")
    p.add_argument("--hosts", default="127.0.0.1,127.0.0.2,127.0.0.3")
    p.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=20, help="W (with --forced_shift_at)")
    p.add_argument("--forced-shift-at", "--forced_shift_at", type=int, default=None)
    p.add_argument("--shift-k", "--shift_k", type=int, default=1)
    p.add_argument("--shift-boundary", "--shift_boundary", type=int, default=1)
    p.add_argument("--baseline", default="reference", choices=["reference", "noshift"])
    p.add_argument("--prompt", default="Write a long story about a robot who learns to paint.")
    p.add_argument("--no-chat", action="store_true")
    p.add_argument("--dtype", default=DType.auto.value, choices=list(DTYPES))
    p.add_argument("--ref-loader", default="hf", choices=["hf"], help="the reference's loader")
    p.add_argument("--loader", default="shard", choices=["shard", "hf"], help="the ring's loader")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--timeout-s", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = resolve_model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype]).eval()
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat)
    gen = GenParams(max_new_tokens=args.max_new_tokens, eos_ids=eos_ids(model.config, tokenizer))
    hosts = args.hosts.split(",")
    cuts = [int(c) for c in args.cuts.split(",") if c]
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="check_equivalence-"))
    head_args = ["--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens)]
    if args.no_chat:
        head_args.append("--no-chat")

    def ring_run(name: str, planner: dict | None) -> dict | None:
        window = args.window if args.forced_shift_at is not None else 0
        layout = RingLayout(model=str(folder), cuts=cuts, hosts=hosts, base_port=pick_base_port(hosts),
                            run_id=f"equiv-{name}-{int(time.time())}", loader=args.loader,
                            dtype=args.dtype, window=window, planner=planner)  # fmt: skip
        group, result = run_ring(layout, run_dir=run_dir / name, head_args=head_args,
                                 timeout_s=args.timeout_s)  # fmt: skip
        if group.exit_code != 0 or result is None:
            print(f"FAIL: the {name} ring did not finish: {group.diagnosis()}", file=sys.stderr)
            return None
        return result

    if args.baseline == "noshift":
        del model
        base = ring_run("noshift", {"name": "noop"})
        if base is None:
            return 1
        ref = base["token_ids"]
    else:
        ref = generate_reference(model, prompt_ids, gen).token_ids
        del model
    planner = None
    if args.forced_shift_at is not None:
        planner = {"name": "forced_shift", "at_token": args.forced_shift_at,
                   "shift_k": args.shift_k, "boundary": args.shift_boundary}  # fmt: skip
    result = ring_run("ring", planner)
    if result is None:
        return 1
    ring = result["token_ids"]
    shifted = _shift_applied(run_dir / "ring") if planner else None
    report = {"reference": ref, "ring": ring, "cuts": cuts, "hosts": hosts, "run_dir": str(run_dir),
              "baseline": args.baseline, "planner": planner, "shift": shifted}  # fmt: skip
    if planner and not shifted:
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
        f"OK: {len(ring)} of {len(ref)} token ids identical (cuts {cuts}, hosts {hosts}, "
        f"baseline {args.baseline}{what}); {run_dir}"
    )
    return 0


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
    sys.exit(main())
