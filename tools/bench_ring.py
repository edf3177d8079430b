"""TPOT of one process vs the 3-stage ring (SmolLM2, greedy), alternating in one run.

The baseline is the whole model in this process (`generate_reference`); the ring is three
stage processes with the shard loader on 127.0.0.1/.2/.3. Repetitions alternate so machine
noise hits both; medians and their ratio go to the JSON, with the per-stage profile of where
ring time goes (compute, blocked receive, send) and each stage's resident weight bytes
against the bytes it owns, plus the hf loader's figure for contrast.

    python tools/bench_ring.py --quick --out /tmp/bench_ring.json
    python tools/bench_ring.py --tokens 128 --reps 3 --out outputs/bench_ring.json
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitlab.infer.prompt import encode_prompt
from splitlab.infer.reference import generate_reference
from splitlab.infer.ring import GenParams
from splitlab.infer.stage import resolve_model_folder
from splitlab.launch.ring import RingLayout, pick_base_port, run_ring
from splitlab.models.plan import ring_plan
from splitlab.models.shard import load_part_hf, open_checkpoint, owned_bytes
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median

PROMPT = "Write a long story about a robot who learns to paint."
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def stage_profile(run_dir: Path) -> list[dict]:
    """Per stage: decode medians of compute/recv_wait/send and the stage_meta residency."""
    out = []
    for i in range(len(HOSTS)):
        records = [json.loads(x) for x in (run_dir / "traces" / f"stage-{i}.jsonl").open()]
        meta = next(r for r in records if r["kind"] == "stage_meta")
        decode = [r for r in records if r["kind"] == "token" and not r["prefill"]]
        row = {
            "stage": i, "blocks": [meta["start"], meta["stop"]],
            "compute_ms": median([r["compute_ms"] for r in decode]),
            "recv_wait_ms": median([r["recv_wait_ms"] for r in decode]),
            "send_ms": median([r["send_ms"] for r in decode]),
            "bytes_per_token": median([r["bytes"] for r in decode]),
            "resident_weight_bytes": meta["shard_load"]["resident_weight_bytes"],
            "owned_bytes": meta["owned_bytes"], "load_ms": meta["load_ms"],
        }  # fmt: skip
        if i == 0:
            row["tpot_ms"] = median([r["tpot_ms"] for r in decode])
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = bench_arg_parser(__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--cuts", default="10,20")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    tokens, reps = (32, 1) if args.quick else (args.tokens, args.reps)
    cuts = [int(c) for c in args.cuts.split(",")]
    folder = resolve_model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
    prompt_ids = encode_prompt(tokenizer, PROMPT)
    gen = GenParams(max_new_tokens=tokens)  # no EOS: both sides generate exactly `tokens`
    report = BenchReport(bench="ring", config={
        "model": args.model, "cuts": cuts, "hosts": HOSTS, "tokens": tokens, "reps": reps,
        "prompt_len": int(prompt_ids.shape[1]), "threads_per_process": torch.get_num_threads(),
    })  # fmt: skip
    one, ring, profiles, same = [], [], [], True
    generate_reference(model, prompt_ids, GenParams(max_new_tokens=4))  # warm-up
    for rep in range(reps):
        ref = generate_reference(model, prompt_ids, gen)
        one.append(ref.tpot_ms_median)
        run_dir = Path(tempfile.mkdtemp(prefix=f"bench_ring-{rep}-"))
        layout = RingLayout(model=str(folder), cuts=cuts, hosts=HOSTS,
                            base_port=pick_base_port(HOSTS), run_id=f"bench-{rep}")  # fmt: skip
        group, result = run_ring(layout, run_dir=run_dir, timeout_s=900, head_args=[
            "--prompt", PROMPT, "--max-new-tokens", str(tokens), "--ignore-eos"])  # fmt: skip
        if group.exit_code != 0 or result is None:
            print(group.diagnosis(), file=sys.stderr)
            return group.exit_code or 1
        ring.append(result["tpot_ms_median"])
        same &= result["token_ids"] == ref.token_ids
        profiles.append(stage_profile(run_dir))
        report.add_result(rep=rep, one_process_tpot_ms=one[-1], ring_tpot_ms=ring[-1],
                          one_process_ttft_ms=ref.ttft_ms, ring_ttft_ms=result["ttft_ms"])  # fmt: skip
        print(f"rep {rep}: one process {one[-1]:.2f} ms, ring {ring[-1]:.2f} ms", file=sys.stderr)
    del model
    index = open_checkpoint(folder)
    residency = []
    for i, span in enumerate(ring_plan(index.family.num_layers(index.config), cuts)):
        _, hf = load_part_hf(folder, span)
        shard = profiles[-1][i]
        residency.append({
            "stage": i, "owned_bytes": owned_bytes(index, span),
            "shard_resident_bytes": shard["resident_weight_bytes"],
            "shard_vs_owned": shard["resident_weight_bytes"] / owned_bytes(index, span),
            "hf_peak_bytes": hf.peak_weight_bytes, "hf_resident_after_prune_bytes": hf.resident_weight_bytes,
        })  # fmt: skip
    report.add_result(profile=profiles[-1], residency=residency, tokens_identical=same)
    ratio = statistics.median(ring) / statistics.median(one)
    report.add_result(
        one_process_tpot_ms_median=statistics.median(one),
        ring_tpot_ms_median=statistics.median(ring),
    )
    report.add_ratio("ring_over_one_process_tpot", ratio)
    report.add_target("ring_over_one_process_tpot", ratio, 1.05, "<=")
    worst = max(abs(r["shard_vs_owned"] - 1) for r in residency)
    report.add_target("resident_vs_owned_max_deviation", worst, 0.10, "<=")
    report.write(args.out)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
