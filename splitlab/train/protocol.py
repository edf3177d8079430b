"""What the U-shape schedulers share on the wire: frame kinds, tensor names, polling, aborts.

Data plane (one frame per microbatch and direction; `Routing.window`/`microbatch` identify it,
the sender's peer id says which owner or worker it came from):

    BODY_FORWARD   owner -> worker  activation lane  hidden_BTH, pad_mask_BT
    TAIL_FORWARD   worker -> owner  activation lane  hidden_BTH
    BODY_BACKWARD  owner -> worker  gradient lane    grad_BTH   (priority BACKWARD)
    FRONT_BACKWARD worker -> owner  gradient lane    grad_BTH   (priority BACKWARD)

Token ids, labels, logits and losses never appear. Control (PLAN, OPEN, DRAINED, COMMIT,
ABORT) goes over the control bus (`splitlab.control`).

    .venv/bin/pytest tests/equivalence/test_train_schedulers.py -q
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable

import torch

from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Abort
from splitlab.errors import AbortedError, PeerLostError, SplitlabError, WaitTimeoutError
from splitlab.wire.base import Message, Transport
from splitlab.wire.frame import Lane

BODY_FORWARD = "body_forward"
TAIL_FORWARD = "tail_forward"
BODY_BACKWARD = "body_backward"
FRONT_BACKWARD = "front_backward"

HIDDEN = "hidden_BTH"
PAD_MASK = "pad_mask_BT"
GRAD = "grad_BTH"

IDLE_WAIT_S = 0.002  # how long one idle poll blocks on a lane
CONTROL_EVERY_S = 0.05  # how often a busy loop looks for an ABORT on the control bus


def try_recv(transport: Transport, lane: Lane, timeout_s: float = 0.0) -> Message | None:
    """The next frame on `lane`, or None when none arrives within `timeout_s`."""
    try:
        return transport.recv(lane, timeout_s=timeout_s)
    except WaitTimeoutError:
        return None


def owned(msg: Message, name: str) -> torch.Tensor:
    """A tensor of a received frame copied out of the pooled buffer (kept past release)."""
    return msg.tensors[name].clone()


def owned_on(msg: Message, transport: Transport, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a received frame, kept past its release, on the `device` it is used on.

    On CUDA the pooled host buffers are copied straight to the device on the transport's
    receive stream (`to_device`; the compute stream waits for the copy, and the release waits
    for it before a buffer is reused), with no host clone in between; elsewhere, cloned.
    """
    if device.type != "cuda":
        return {name: t.clone() for name, t in msg.tensors.items()}
    return transport.to_device(msg, device)


class Watchdog:
    """Bounds a scheduler loop: raises on an ABORT from the bus or `timeout_s` without progress."""

    def __init__(self, control: ControlEndpoint, *, timeout_s: float, what: str) -> None:
        self.control, self.timeout_s, self.what = control, timeout_s, what
        self._last_progress = self._last_control = time.monotonic()

    def progress(self) -> None:
        self._last_progress = time.monotonic()

    def check(self, waiting_for: Iterable[str]) -> None:
        now = time.monotonic()
        if now - self._last_control >= CONTROL_EVERY_S:
            self._last_control = now
            msg = self.control.poll(0.0, kinds=())  # only an ABORT can come out
            if isinstance(msg, Abort):
                raise AbortedError(
                    f"round aborted by {msg.cause_node!r}: {msg.reason} "
                    f"(while {self.control.node_id!r} was {self.what})"
                )
        if now - self._last_progress > self.timeout_s:
            raise WaitTimeoutError(
                f"{self.control.node_id!r} made no progress for {self.timeout_s:.1f} s while "
                f"{self.what}; waiting for {sorted(set(waiting_for))}"
            )


def explain_peer_loss(control: ControlEndpoint, error: BaseException, wait_s: float = 1.0) -> None:
    """A lost data connection is often the symptom of a peer that aborted: if an ABORT is (or
    soon is) on the bus, raise `AbortedError` with its cause instead; otherwise do nothing."""
    if not isinstance(error, PeerLostError):
        return
    msg = None
    with contextlib.suppress(SplitlabError, OSError):
        msg = control.poll(wait_s, kinds=())
    if isinstance(msg, Abort):
        raise AbortedError(
            f"round aborted by {msg.cause_node!r}: {msg.reason} (seen here as: {error})"
        ) from error


def abort_peers(control: ControlEndpoint, peers: Iterable[str], error: BaseException) -> None:
    """Best effort: tell every peer the round is over and why (never masks `error`)."""
    if isinstance(error, AbortedError):
        return  # someone else's abort: it already reached everyone
    reason = f"{type(error).__name__}: {error}"
    msg = Abort(
        session_id=control.session,
        sender=control.node_id,
        window_id=control.window_id,
        reason=reason[:2000],
        cause_node=control.node_id,
    )
    for peer in peers:
        with contextlib.suppress(SplitlabError, OSError):
            control.send(peer, msg, timeout_s=2.0)
