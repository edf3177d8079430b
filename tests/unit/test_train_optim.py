"""splitlab.train.optim: AdamW fused where the parameters allow, the same update as the loop.

.venv/bin/pytest tests/unit/test_train_optim.py -q
"""

from __future__ import annotations

import torch

from splitlab.train.optim import adamw, can_fuse


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(300, 16), (16, 16), (16,)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    return params


def test_cpu_float_parameters_get_the_fused_kernel() -> None:
    opt = adamw(_params(), lr=1e-3)
    assert opt.defaults["fused"] is True
    assert can_fuse(_params())


def test_what_the_kernel_cannot_take_keeps_the_loop() -> None:
    assert not can_fuse([])
    assert not can_fuse([torch.zeros(3, dtype=torch.int64)])
    assert not can_fuse([*_params(), torch.zeros(3, dtype=torch.int32)])
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    assert not can_fuse([meta])


def test_the_fused_update_matches_the_loop_to_rounding() -> None:
    fused, loop = _params(), _params()
    opts = [
        adamw(fused, lr=1e-2, eps=1e-6),
        torch.optim.AdamW(loop, lr=1e-2, eps=1e-6, foreach=False),
    ]
    for _ in range(5):
        for opt in opts:
            opt.step()
    for a, b in zip(fused, loop, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, start in zip(fused, _params(), strict=True):
        assert not torch.equal(a, start)  # it stepped


def test_param_groups_keep_their_own_rates() -> None:
    first, second = _params(0), _params(1)
    opt = adamw(
        [{"params": iter(first), "lr": 0.1}, {"params": second, "lr": 0.0}], weight_decay=0.0
    )
    before = [p.detach().clone() for p in second]
    opt.step()
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.0]
    assert len(opt.param_groups[0]["params"]) == 3  # an iterator's tensors were all taken
    for p, q in zip(second, before, strict=True):
        assert torch.equal(p, q)  # a zero rate moves nothing
    assert not torch.equal(first[0], _params(0)[0])
