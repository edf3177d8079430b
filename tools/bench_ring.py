"""TPOT of one process vs the 3-stage ring (SmolLM2, greedy), alternating in one run.

The baseline is the whole model in one fresh process (`generate_reference`); the ring is
three stage processes with the shard loader on 127.0.0.1/.2/.3. Repetitions alternate so
machine noise hits both; medians and their ratio go to the JSON, with the per-stage profile of
where ring time goes (compute, blocked receive, send) and each stage's resident weight bytes
against the bytes it owns, plus the hf loader's figure for contrast.

A third arm splits the ring's gap: the ring's stage parts, shard-loaded, computed back to back
in one fresh process (`--stages-arm`, same thread policy, same tokens). Against the baseline it
is the cost of the partition itself (`stages_in_one_process_over_one_process`); the ring's
stage compute against it is the cost of computing in separate processes that sleep between
tokens (`ring_compute_over_stages_in_one_process`); what is left is the hops (`per_hop_ms`).

With `--testbed NAME` (as root) one testbed is up for the whole run: the ring's stages run in
the hosts its placement names, and the one-process arm runs inside the head's host (this
script again, `--one-process-arm`), so both arms compute under the same per-host CPU budget
and thread count. The JSON then also holds the testbed's record and the per-token link cost
from the traces: the head's TPOT minus every stage's compute, per decode token (median), and
each hop's bytes per token beside their wire time at the shaped rate.

    python tools/bench_ring.py --quick --out /tmp/bench_ring.json
    python tools/bench_ring.py --tokens 128 --reps 3 --out outputs/bench_ring.json
    python tools/bench_ring.py model=tiny_llama architecture.cuts=[1,3] --quick  # Hydra overrides
    python tools/bench_ring.py --testbed ring3_edge --out outputs/bench_ring_ring3_edge.json  # root
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitlab.analysis.traces import load_traces, select
from splitlab.configure import compose_config
from splitlab.errors import tool_exit
from splitlab.infer.compute import PartCompute
from splitlab.infer.local import decode_in_turn
from splitlab.infer.prompt import encode_prompt
from splitlab.infer.ring import GenParams
from splitlab.infer.topology import resolve_ring
from splitlab.launch.ring import STAGE_ROLE, model_ref, run_ring
from splitlab.launch.threads import local_stage_env, omp_env
from splitlab.models.plan import ring_plan
from splitlab.models.shard import load_part, load_part_hf, open_checkpoint, owned_bytes
from splitlab.reference.generate import generate_reference
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median, thread_policy
from splitlab.telemetry.log import leave
from splitlab.testbed.placement import place, testbed_for
from splitlab.testbed.session import Testbed

PROMPT = "Write a long story about a robot who learns to paint."
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
ONE_PROCESS_FLAG = "--one-process-arm"
DEVICE_FLAG = "--one-process-device"  # the one-process arm runs on the ring's `device`
STAGES_FLAG = "--stages-arm"  # internal: the ring's parts back to back in one process


def stage_profile(run_dir: Path, num_stages: int) -> list[dict]:
    """Per stage: decode medians of compute/recv_wait/send and the stage_meta residency."""
    out = []
    for i in range(num_stages):
        records = [json.loads(x) for x in (run_dir / "traces" / f"stage-{i}.jsonl").open()]
        meta = next(r for r in records if r["kind"] == "stage_meta")
        decode = [r for r in records if r["kind"] == "token" and not r["prefill"]]
        row = {
            "stage": i, "blocks": [meta["start"], meta["stop"]], "host": meta["host"],
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


def link_cost(run_dir: Path, rate_mbit: dict[int, float]) -> dict[str, Any]:
    """Per-token link cost from the traces (decode tokens): the head's TPOT minus every stage's
    compute for that token is the time the token spent on the ring's links (hops, hand-offs);
    beside it, each hop's bytes per token and their wire time at the path's shaped rate
    (`rate_mbit[s]`: the hop into stage s, 0 = unshaped; hop 0 is the tail's token id)."""
    tokens = select(load_traces(run_dir / "traces"), "token")
    decode = tokens[~tokens["prefill"].astype(bool)]
    compute = decode.groupby("token")["compute_ms"].sum()
    tpot = decode[decode["stage"] == 0].set_index("token")["tpot_ms"]
    link_ms = (tpot - compute.reindex(tpot.index)).dropna()
    num_stages = int(decode["stage"].max()) + 1
    hops = []
    for dst in range(num_stages):
        src = (dst - 1) % num_stages
        nbytes = float(decode[decode["stage"] == src]["bytes"].median())
        rate = rate_mbit.get(dst, 0.0)
        hops.append({"hop": f"{src}->{dst}", "bytes_per_token": nbytes,
                     "wire_ms_at_rate": nbytes * 8 / (rate * 1e3) if rate > 0 else None})  # fmt: skip
    return {
        "n": len(link_ms),
        "link_ms_per_token": float(link_ms.median()),
        "compute_ms_per_token": float(compute.median()),
        "hops": hops,
    }


def one_process_arm(folder: str, tokens: int, device: str = "cpu") -> int:
    """The baseline in this process on `device`, as one JSON line on stdout (run inside a
    testbed host)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").to(device).eval()
    prompt_ids = encode_prompt(tokenizer, PROMPT)
    generate_reference(model, prompt_ids, GenParams(max_new_tokens=4))  # warm-up
    ref = generate_reference(model, prompt_ids, GenParams(max_new_tokens=tokens))
    print(json.dumps({"tpot_ms_median": ref.tpot_ms_median, "ttft_ms": ref.ttft_ms,
                      "token_ids": ref.token_ids,
                      "threads": thread_policy(torch_threads=torch.get_num_threads())}))  # fmt: skip
    return 0


def stages_arm(folder: str, tokens: int, cuts: list[int]) -> int:
    """The ring's stage parts (shard loader, `cuts`) computed in turn in this process
    (`decode_in_turn`), as one JSON line on stdout: TPOT, each part's compute per decode
    token, token ids."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    index = open_checkpoint(folder)
    spans = ring_plan(index.family.num_layers(index.config), cuts)
    prompt_ids = encode_prompt(tokenizer, PROMPT)
    parts = [PartCompute(load_part(index, span)[0]) for span in spans]
    decode_in_turn(parts, prompt_ids, GenParams(max_new_tokens=4))  # warm-up
    for part in parts:
        part.reset()  # an empty KV cache again
    result, compute = decode_in_turn(parts, prompt_ids, GenParams(max_new_tokens=tokens))
    print(json.dumps({"tpot_ms_median": result.tpot_ms_median, "token_ids": result.token_ids,
                      "compute_ms": [median([c[i] for c in compute]) for i in range(len(spans))],
                      "threads": thread_policy(torch_threads=torch.get_num_threads())}))  # fmt: skip
    return 0


def one_process_fresh(tb: Testbed | None, folder: Path, tokens: int, env: dict[str, str],
                      device: str = "cpu", *, cuts: list[int] | None = None) -> dict[str, Any]:  # fmt: skip
    """`one_process_arm` (or with `cuts`, `stages_arm`) in a fresh process under the stages'
    OpenMP policy and thread count (`env`); on a testbed inside the head's host (its CPU quota
    and thread count win)."""
    arm = ([STAGES_FLAG, str(folder), "--stages-cuts", ",".join(map(str, cuts))]
           if cuts is not None else [ONE_PROCESS_FLAG, str(folder), DEVICE_FLAG, device])  # fmt: skip
    argv = [sys.executable, __file__, *arm, "--tokens", str(tokens)]
    if tb is not None:
        argv = place(tb, STAGE_ROLE, 0).wrap(argv)
    done = subprocess.run(argv, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the one-process arm exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = bench_arg_parser(__doc__.split("\n")[0], testbed=True)
    p.add_argument("overrides", nargs="*", help="Hydra overrides on task=infer (model, cuts...)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(ONE_PROCESS_FLAG, metavar="FOLDER", help="internal: the testbed's baseline")
    p.add_argument(DEVICE_FLAG, default="cpu", help="internal: the baseline's device")
    p.add_argument(STAGES_FLAG, metavar="FOLDER", help="internal: the stages in one process")
    p.add_argument("--stages-cuts", default="", help="internal: that arm's cuts")
    args = p.parse_args(argv)
    if args.one_process_arm:
        return one_process_arm(args.one_process_arm, args.tokens, args.one_process_device)
    if args.stages_arm:
        cuts = [int(c) for c in args.stages_cuts.split(",")]
        return stages_arm(args.stages_arm, args.tokens, cuts)
    tokens, reps = (32, 1) if args.quick else (args.tokens, args.reps)
    on_testbed = args.testbed != "none"
    where = (
        [f"testbed={args.testbed}"]
        if on_testbed
        else [f"architecture.peer_hosts=[{','.join(HOSTS)}]"]
    )
    cfg = compose_config([
        "task=infer", "model=smollm2_135m", "architecture.cuts=[10,20]", "architecture.window=0",
        *where, f"task.prompt={PROMPT}", f"task.max_new_tokens={tokens}", "task.ignore_eos=true",
        *args.overrides,
    ])  # fmt: skip
    cuts = resolve_ring(cfg).cuts
    folder = Path(model_ref(cfg.model, Path(tempfile.mkdtemp(prefix="bench_ring-")), seed=0))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = encode_prompt(tokenizer, PROMPT)
    with testbed_for(cfg.testbed) as tb:  # None with testbed=none
        report = BenchReport(bench="ring", config={
            "model": cfg.model.name, "cuts": cuts, "tokens": tokens, "reps": reps,
            "prompt_len": int(prompt_ids.shape[1]),
        })  # fmt: skip
        budget_share = 1.0  # the head host's share of the stage hosts' CPU budgets
        if tb is None:  # the stages' count on this host (`stage_children`)
            arm_env = local_stage_env(len(cuts) + 1)
            threads = int(arm_env["OMP_NUM_THREADS"])
            report.config.update(hosts=HOSTS, threads_per_process=threads)
            report.add_arm("ring_stage", thread_policy(torch_threads=threads,
                                                       env={**os.environ, **arm_env}))  # fmt: skip
        else:
            topo = tb.topology
            stage_hosts = [place(tb, STAGE_ROLE, i).host for i in range(len(cuts) + 1)]
            rates = {i: topo.path_rate_mbit(stage_hosts[i - 1], h)
                     for i, h in enumerate(stage_hosts)}  # fmt: skip
            threads = tb.record()["hosts"][stage_hosts[0]]["threads"]
            cpus = [topo.hosts[h].cpu for h in dict.fromkeys(stage_hosts)]
            budget_share = cpus[0] / sum(cpus) if all(c > 0 for c in cpus) else 1.0
            report.config.update(
                hosts=[tb.address(h) for h in stage_hosts], testbed=tb.record(),
                one_process_host=stage_hosts[0], threads_per_process=threads,
            )  # fmt: skip
            # the stages' policy: their host's thread count (Testbed.command) and omp_env
            arm_env = {"OMP_NUM_THREADS": str(threads), **omp_env()}
            report.add_arm("ring_stage", thread_policy(torch_threads=threads, env=arm_env))
        one, ring, profiles, costs, same = [], [], [], [], True
        staged: list[dict[str, Any]] = []  # the stages-in-one-process arm (CPU only)
        for rep in range(reps):
            arm = one_process_fresh(tb, folder, tokens, arm_env, cfg.device)
            ref_tpot, ref_ttft, ref_ids = arm["tpot_ms_median"], arm["ttft_ms"], arm["token_ids"]
            report.add_arm("one_process", arm["threads"])
            one.append(ref_tpot)
            if cfg.device == "cpu":
                staged.append(one_process_fresh(tb, folder, tokens, arm_env, cuts=cuts))
                report.add_arm("stages_in_one_process", staged[-1]["threads"])
                same &= staged[-1]["token_ids"] == ref_ids
            run_dir = Path(tempfile.mkdtemp(prefix=f"bench_ring-{rep}-"))
            group, result = run_ring(cfg, run_dir=run_dir, timeout_s=1800, testbed=tb)
            if group.exit_code != 0 or result is None:
                print(group.diagnosis(), file=sys.stderr)
                return group.exit_code or 1
            ring.append(result["tpot_ms_median"])
            same &= result["token_ids"] == ref_ids
            profiles.append(stage_profile(run_dir, len(cuts) + 1))
            if tb is not None:
                costs.append(link_cost(run_dir, rates))
            report.add_result(rep=rep, one_process_tpot_ms=one[-1], ring_tpot_ms=ring[-1],
                              one_process_ttft_ms=ref_ttft, ring_ttft_ms=result["ttft_ms"],
                              run_dir=str(run_dir))  # fmt: skip
            print(
                f"rep {rep}: one process {one[-1]:.2f} ms, ring {ring[-1]:.2f} ms", file=sys.stderr
            )
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
    if costs:
        report.add_result(link_cost=costs[-1], link_ms_per_token_median=statistics.median(
            [c["link_ms_per_token"] for c in costs]))  # fmt: skip
    ratio = statistics.median(ring) / statistics.median(one)
    report.add_result(
        one_process_tpot_ms_median=statistics.median(one),
        ring_tpot_ms_median=statistics.median(ring),
    )
    report.add_ratio("ring_over_one_process_tpot", ratio)
    report.add_target("ring_over_one_process_tpot", ratio, 1.03, "<=")
    # per hop, what the token's time is beyond every stage's compute (send, wake-up, receive)
    hops = len(cuts) + 1
    per_hop = [(p[0]["tpot_ms"] - sum(s["compute_ms"] for s in p)) / hops for p in profiles]
    report.add_result(per_hop_ms=per_hop)
    report.add_target("per_hop_ms", statistics.median(per_hop), 0.3, "<=")
    if staged:  # where the gap lies: the partition, the separate processes, the hops
        report.add_result(
            stages_in_one_process_tpot_ms_median=median([a["tpot_ms_median"] for a in staged]),
            stages_in_one_process_compute_ms=staged[-1]["compute_ms"],
        )  # fmt: skip
        report.add_ratio(
            "stages_in_one_process_over_one_process",
            median([a["tpot_ms_median"] for a in staged]) / statistics.median(one),
        )
        ring_compute = [sum(s["compute_ms"] for s in p) for p in profiles]
        report.add_ratio(
            "ring_compute_over_stages_in_one_process",
            median(ring_compute) / median([sum(a["compute_ms"]) for a in staged]),
        )
    # three stages doing one sequence's work in turn cannot beat one process doing it all on
    # the same cores; on a testbed each stage has its own host's quota, which a stage busy a
    # third of the time never exhausts, so the ring can be as fast as one process given the
    # stage hosts' budgets together: the floor is the head host's share of them
    report.check_physics("ring_over_one_process_tpot", ratio, floor=budget_share,
                         tolerance=0.10)  # fmt: skip
    worst = max(abs(r["shard_vs_owned"] - 1) for r in residency)
    report.add_target("resident_vs_owned_max_deviation", worst, 0.10, "<=")
    report.write(args.out)
    return report.exit_code(require_quiet=args.require_quiet) or (0 if same else 1)


if __name__ == "__main__":
    leave(tool_exit("bench_ring", main))
