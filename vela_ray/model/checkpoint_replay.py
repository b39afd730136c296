"""Activation checkpointing's broker stage: a checkpointed layer's recompute replays its broker calls.

torch's non-reentrant checkpoint around decoder layers (`recompute_contexts`, `modeling.enable_activation_
checkpointing`) runs a checkpointed layer's forward twice, once in the forward pass and again in backward to
rebuild what it saved. `CheckpointReplay`, the dispatcher's second stage, records each broker call's plan,
key, selection, the experts' output and whether it computed the block's shared expert (`shared_expert`) in the
first forward; the recompute replays them, so no row crosses the data plane a second time, the routing is counted
once, the recompute saves its tensors in the first forward's order, and backward still goes through the first
call's `_RemoteExperts` node and its key.

    torch.utils.checkpoint.checkpoint(layer, hidden, use_reentrant=False, context_fn=recompute_contexts)
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace
import torch

from vela_ray.model.dispatch_stages import BrokerCall, DispatchPlan


@dataclass(frozen=True)
class _RecordedCall:
    """What a broker call in a checkpointed layer's first forward decided and got back (its decisions only: the
    call's own tensors are the checkpoint's to drop)."""

    plan: DispatchPlan
    sent: DispatchPlan
    key: tuple[int, int]
    selection: object | None  # `condensation.Selection`
    expert_out_RD: torch.Tensor  # detached: the recompute's copy of the first forward's output
    shared_meanwhile: bool  # the block's shared expert computed in the call: the recompute's saves come in this order


class _LayerCalls:
    """The broker calls of one checkpointed layer call: recorded in its forward, replayed in order
    in its recompute, each dropped once replayed."""

    def __init__(self):
        self.calls: list[_RecordedCall | None] = []
        self.replaying = False
        self.next = 0

    @contextlib.contextmanager
    def active(self, replaying: bool):
        self.replaying, self.next = replaying, 0
        token = _CHECKPOINTED_LAYER.set(self)
        try:
            yield
        finally:
            _CHECKPOINTED_LAYER.reset(token)

    def record(self, call: BrokerCall) -> None:
        self.calls.append(_RecordedCall(call.plan, call.sent, call.key, call.selection, call.expert_out_RD.detach(),
                                        call.shared_meanwhile))

    def replay(self) -> _RecordedCall:
        if self.next >= len(self.calls) or self.calls[self.next] is None:
            raise RuntimeError("a checkpointed layer's recompute called the expert broker more often than its "
                               "forward did (its routing is not deterministic?)")
        recorded, self.calls[self.next] = self.calls[self.next], None
        self.next += 1
        return recorded


_CHECKPOINTED_LAYER: contextvars.ContextVar[_LayerCalls | None] = contextvars.ContextVar(
    "vela_checkpointed_layer", default=None)


def recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's `context_fn` for decoder layers with brokers: the layer's forward records
    its broker calls, its recompute in backward replays them (see the module docstring)."""
    layer = _LayerCalls()
    return layer.active(replaying=False), layer.active(replaying=True)


class CheckpointReplay:
    """The stage (module docstring); outside a checkpointed layer's forward with grad it passes calls through."""

    def dispatch(self, call: BrokerCall) -> BrokerCall:
        layer = _CHECKPOINTED_LAYER.get() if call.track_grad else None
        if layer is None:
            return call
        if not layer.replaying:
            return replace(call, in_checkpoint=True)
        first = layer.replay()
        return replace(call, in_checkpoint=True, plan=first.plan, sent=first.sent, key=first.key,
                       selection=first.selection, replayed_RD=first.expert_out_RD,
                       shared_meanwhile=first.shared_meanwhile)

    def combine(self, call: BrokerCall, out: torch.Tensor) -> torch.Tensor:
        if call.in_checkpoint and call.replayed_RD is None:
            _CHECKPOINTED_LAYER.get().record(call)
        return out
