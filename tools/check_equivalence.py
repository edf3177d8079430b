"""Splitting must not change a token: one process (whole-model loader) vs the ring (shard loader).

The reference loads the whole model with `from_pretrained` and generates with the model's own
forward and cache; the ring runs one process per stage with the shard loader, over TCP on the
given addresses. The two sides share no loader, so a loader bug cannot cancel out. Exit 0 only
if every token id matches; a mismatch names its index and what it points at: index 0 is
prefill (causal mask or rotary positions across a stage boundary), a later index is decode-time
per-stage KV cache handling.

    python tools/check_equivalence.py                       # SmolLM2, cuts 10,20, 64 tokens
    python tools/check_equivalence.py --model /path/to/folder --cuts 1,3 --max-new-tokens 16
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
    p.add_argument("--max-new-tokens", type=int, default=64)
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
    ref = generate_reference(model, prompt_ids, gen).token_ids
    del model
    hosts = args.hosts.split(",")
    cuts = [int(c) for c in args.cuts.split(",") if c]
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="check_equivalence-"))
    layout = RingLayout(model=str(folder), cuts=cuts, hosts=hosts, base_port=pick_base_port(hosts),
                        run_id=f"equiv-{int(time.time())}", loader=args.loader, dtype=args.dtype)  # fmt: skip
    head_args = ["--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens)]
    if args.no_chat:
        head_args.append("--no-chat")
    group, result = run_ring(layout, run_dir=run_dir, head_args=head_args, timeout_s=args.timeout_s)
    if group.exit_code != 0 or result is None:
        print(f"FAIL: the ring did not finish: {group.diagnosis()}", file=sys.stderr)
        return group.exit_code or 1
    ring = result["token_ids"]
    report = {"reference": ref, "ring": ring, "cuts": cuts, "hosts": hosts, "run_dir": str(run_dir)}
    (run_dir / "equivalence.json").write_text(json.dumps(report), encoding="utf-8")
    index = first_mismatch(ref, ring)
    if index is not None:
        got = ring[index] if index < len(ring) else None
        want = ref[index] if index < len(ref) else None
        print(
            f"FAIL: token {index} differs (reference {want}, ring {got}): points at {diagnose(index)}"
        )
        return 1
    print(
        f"OK: {len(ring)} of {len(ref)} token ids identical (cuts {cuts}, hosts {hosts}); {run_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
