"""Split fine-tuning in two lines: a plain PyTorch loop whose middle runs in another process.

The edge (this process) keeps the data, the embeddings, block 0 up to its FFN's rank-R code,
and (U-shape) the last block and the head; the cloud (a child process started here, or
another terminal) runs the rest. The only changes to an ordinary loop are the two wrapped
lines marked below. Tiny random BERT, random data with a learnable label; well under a minute on 2 cores:

    .venv/bin/python examples/sft_two_lines.py [--rank 8] [--residual drop|keep]

Two terminals instead (the cloud prints the address to pass to the edge):

    .venv/bin/python examples/sft_two_lines.py --cloud --port 7000
    .venv/bin/python examples/sft_two_lines.py --peer 127.0.0.1:7000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from typing import Any

import torch

from splitlab import sft
from splitlab.config.enums import DType, Family, ModelSource
from splitlab.config.schema import ModelConfig
from splitlab.models.load import load_model

KEY = b"example-session-key-32-bytes...."  # share it out of band; it never crosses the wire
LR = 1e-3


def tiny_bert() -> torch.nn.Module:
    cfg = ModelConfig(name="tiny_bert", family=Family.bert, source=ModelSource.random,
                      num_layers=4, hidden_size=64, num_heads=4, intermediate_size=128,
                      vocab_size=128, max_position_embeddings=64, num_labels=2,
                      dtype=DType.fp32, dropout=0.0)  # fmt: skip
    torch.manual_seed(0)  # both processes start from the same "pre-trained" weights
    return load_model(cfg, load_tokenizer=False)[0]


def cloud(port: int, addresses: Any = None) -> None:
    def ready(address: tuple[str, int]) -> None:
        print(f"cloud: serving on {address[0]}:{address[1]}", flush=True)
        if addresses is not None:
            addresses.put(address)

    make_optimizer = lambda params: torch.optim.AdamW(params, lr=LR)  # noqa: E731
    sft.serve(tiny_bert(), key=KEY, port=port, make_optimizer=make_optimizer, on_ready=ready)


def edge(peer: tuple[str, int], rank: int | None, residual: str, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 128, (32, 24), generator=gen)
    labels = (input_ids[:, 0] % 2).long()  # learnable: the parity of the first token
    model = tiny_bert()

    # --- the two lines -------------------------------------------------------------------
    model = sft.split(model, peer=peer, key=KEY, layer=1, rank=rank, residual=residual,
                      cuts="both", tail_blocks=1)  # fmt: skip
    optimizer = sft.SFTOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), model)
    # --------------------------------------------------------------------------------------

    model.train()
    for step in range(steps):
        batch = slice(step % 4 * 8, step % 4 * 8 + 8)
        loss = model(input_ids[batch], labels=labels[batch]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"edge: step {step:3d} loss {loss.item():.4f}", flush=True)
    counters = model.counters()
    model.close()
    wire = sum(counters[f"{lane}.bytes_{way}"] for lane in ("activation", "gradient")
               for way in ("sent", "recv"))  # fmt: skip
    print(f"edge: {wire / steps:.0f} bytes on the wire per step (rank={rank}, {residual})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cloud", action="store_true", help="run the cloud side only")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--peer", help="HOST:PORT of a running cloud (else one is spawned)")
    parser.add_argument("--rank", type=int, default=8, help="0 = uncompressed cut")
    parser.add_argument("--residual", choices=("drop", "keep"), default="drop")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    rank = args.rank or None
    if args.cloud:
        cloud(args.port)
        return
    child = None
    if args.peer:
        host, port = args.peer.rsplit(":", 1)
        peer = (host, int(port))
    else:
        ctx = mp.get_context("spawn")
        addresses = ctx.Queue()
        child = ctx.Process(target=cloud, args=(args.port, addresses))
        child.start()
        peer = addresses.get(timeout=120)
    edge(peer, rank, args.residual, args.steps)
    if child is not None:
        child.join(timeout=30)


if __name__ == "__main__":
    main()
