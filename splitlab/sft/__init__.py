"""Low-rank split fine-tuning (SFT) for plain PyTorch scripts: two lines on the edge.

Edge (the data owner), an ordinary training loop plus two wrapped objects::

    model = sft.split(model, peer=("cloud-host", 7000), key=KEY, layer=10, rank=8)
    optimizer = sft.SFTOptimizer(torch.optim.AdamW(model.parameters(), lr=2e-5), model)
    for batch in loader:
        loss = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.close()

Cloud, the same pre-trained model::

    sft.serve(model, key=KEY, host="0.0.0.0", port=7000,
              make_optimizer=lambda params: torch.optim.AdamW(params, lr=2e-5))

The edge runs the embeddings and blocks [0, layer], the last one up to its FFN's rank-R code
(`splitlab.models.lowrank`); the cloud runs the rest of that block and on. With
`tail_blocks=k` the split is U-shape: the last k blocks and the head stay on the edge, so
labels and logits never leave it; with `tail_blocks=None` the cloud runs to the head and
returns logits (the loss is still computed on the edge). What crosses per step, edge ->
cloud: code_BTR (+ residual_BTH with residual="keep") and a bool padding mask; back: their
gradients, plus the body's output (and its gradient) in U-shape. `rank=None` is the
uncompressed baseline (hidden_BTH crosses).

    .venv/bin/python examples/sft_two_lines.py
"""

from __future__ import annotations

from torch import nn

from splitlab.config.enums import ResidualMode, SftCut, SftFactors
from splitlab.models.families import family_for_model
from splitlab.sft.cloud import serve
from splitlab.sft.edge import SFTOptimizer, SplitModel, SplitOutput
from splitlab.sft.protocol import CLOUD, EDGE, SplitSpec
from splitlab.wire import TcpTransport


def split(
    model: nn.Module,
    *,
    peer: tuple[str, int],
    key: bytes | str,
    layer: int,
    rank: int | None = 8,
    residual: ResidualMode | str = ResidualMode.drop,
    cuts: SftCut | str = SftCut.front,
    tail_blocks: int | None = None,
    factors: SftFactors | str = SftFactors.two,
    session: str = "sft",
    bind_host: str = "127.0.0.1",
    timeout_s: float = 120.0,
) -> SplitModel:
    """Cut `model` (in place) at block `layer` and connect to the cloud serving its body.

    Args:
        model: a loaded transformers model of a registered family (BERT, GPT-2, Llama/Qwen2).
        peer: the cloud's (host, port), as `serve`'s `on_ready` reports it.
        key: the per-session secret (HMAC handshake; never sent).
        layer: the split layer (0-based block index).
        rank: R of the low-rank cut; None = ordinary cut (baseline).
        residual: keep (the residual stream crosses too) or drop (paper).
        cuts: front, tail or both (tail and both need `tail_blocks`).
        tail_blocks: U-shape tail size on the edge; None = the cloud owns the head.
        factors: two (S V on the sender) or three (V on the sender, a trainable S on the
            receiver; see `splitlab.models.lowrank`).

    Raises:
        ConfigError: a bad split, or the cloud's model disagrees.
        PeerLostError: the cloud cannot be reached.
    """
    spec = SplitSpec(
        family=family_for_model(model).name,
        num_layers=family_for_model(model).num_layers(model.config),
        layer=layer,
        rank=rank,
        residual=ResidualMode(residual).value,
        cuts=SftCut(cuts).value,
        tail_blocks=tail_blocks,
        factors=SftFactors(factors).value,
    )
    spec.plan()  # validate before connecting
    transport = TcpTransport(EDGE, key=key, session=session, bind_host=bind_host)
    try:
        transport.connect(CLOUD, *peer, timeout_s=timeout_s)
        return SplitModel(model, spec, transport, session=session, timeout_s=timeout_s)
    except BaseException:
        transport.close()
        raise


__all__ = ["SFTOptimizer", "SplitModel", "SplitOutput", "SplitSpec", "serve", "split"]
