"""Migration in one process, no sockets: every shift combo must leave every token unchanged.

Runs the ring as threads (in-process control pipes and KV channels) once without a shift and
once per (boundary, k), each shifting at `--shift-at`, and compares token ids. Isolates
migration from transport: if this passes and `check_equivalence.py planner=forced_shift` fails,
look at the TCP channels.

    python tools/check_migration.py --tokens 40 --shift-at 20                  # SmolLM2
    python tools/check_migration.py --model /path/to/folder --cuts 3,6 --shift-k 1,-1
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer

from splitlab.errors import tool_exit
from splitlab.infer.folders import resolve_model_folder
from splitlab.infer.planners import ForcedShift
from splitlab.infer.prompt import encode_prompt
from splitlab.infer.ring import GenParams
from splitlab.reference.tiny import local_ring
from splitlab.telemetry.log import leave

PROMPT = "Write a long story about a robot who learns to paint."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--cuts", default="10,20")
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--shift-at", type=int, default=20)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--shift-k", default="1,-1,2,-2")
    p.add_argument("--boundaries", default="", help="default: every movable boundary")
    p.add_argument("--out", default=None, help="write the per-combo results as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    folder = resolve_model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = encode_prompt(tokenizer, PROMPT)
    cuts = [int(c) for c in args.cuts.split(",")]
    gen = GenParams(max_new_tokens=args.tokens)  # no EOS: every run decodes exactly `tokens`
    base, _ = local_ring(folder, cuts, prompt_ids, gen, window=args.window)
    boundaries = [int(b) for b in args.boundaries.split(",") if b] or list(range(1, len(cuts) + 1))
    rows, ok = [], True
    for b in boundaries:
        for k in (int(x) for x in args.shift_k.split(",")):
            t0 = time.perf_counter()
            planner = ForcedShift(at_token=args.shift_at, shift_k=k, boundary=b)
            result, computes = local_ring(folder, cuts, prompt_ids, gen, window=args.window, planner=planner)  # fmt: skip
            spans = [[c.span.start, c.span.stop] for c in computes]
            same = result.token_ids == base.token_ids
            moved = any(w["decision"].startswith("forced_shift: b") and not w["aborted"] for w in result.windows)  # fmt: skip
            ok &= same and moved
            rows.append({"boundary": b, "k": k, "identical": same, "moved": moved, "spans": spans,
                         "seconds": time.perf_counter() - t0})  # fmt: skip
            print(f"b{b} {k:+d}: {'OK' if same and moved else 'FAIL'} spans {spans}", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "cuts": cuts, "tokens": args.tokens, "shift_at": args.shift_at,
                       "window": args.window, "results": rows}, f, indent=1)  # fmt: skip
    print(("OK" if ok else "FAIL") + f": {len(rows)} shifts, {args.tokens} tokens each vs no shift")
    return 0 if ok else 1


if __name__ == "__main__":
    leave(tool_exit("check_migration", main))
