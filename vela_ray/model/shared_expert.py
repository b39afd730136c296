"""A MoE block's shared expert, computed while the block's routed rows are away (`training.overlap.shared_experts`).

Many MoE blocks add an always-on shared expert to the routed ones, on the same tokens, and most call it after their
experts (DeepSeek-V3 and the families built like it, GLM-4.5, Llama 4, HunYuan, Cohere2-MoE):

    _, weights, index = self.gate(hidden)                       # Llama 4: self.router(hidden)
    routed = self.experts(hidden.view(-1, D), index, weights)    # the broker: waits for the workers
    return routed.view(shape) + self.shared_experts(hidden)      # so this starts once the rows are back

`attach_brokers` makes the block's router and shared expert stand-ins of themselves (`stand_in`): each stays the
very module at its own path, with its own parameters and state (peft's targets and the adapter's names, e.g.
`mlp.shared_experts.gate_proj`, read them), its class given one base in front, as torch's FSDP2 `fully_shard` does to
the modules it shards. The router notes the tokens it is given (`SharedExpert.saw`); the broker's `SendRows` stage
sends the rows on a thread of its own and meanwhile computes the shared expert on those tokens on the calling
thread, in autograd (`SharedExpert.compute`); the block's own call with that same tensor then gets that output
(`SharedExpert.take`). Computed once, on the tensor the block passes, in the graph the block would have built: the
block's numbers. Everything is noted per thread: micro-batches in flight (`training.step.forward_backward`) each run
on a thread of their own, and a checkpointed layer's recompute notes and computes as its first forward did.

Left as the block has it:
  - a shared expert the block calls BEFORE its experts (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE, ERNIE 4.5, AFMoE): it has
    run by the time the rows leave, and overlapping it would take the block's code reordered. Its stand-in notes
    what it ran on; the broker sees the router got that (or a view of it) and computes nothing;
  - a block that calls its shared expert on anything but the very tensor its router got (Aria's new view of it):
    its first call computes the shared expert twice, the broker's output unused and the block's own as it asks,
    and the overlap stops for that block, said once in the log;
  - a block with no router child named `gate` or `router`, or whose shared expert takes more than the tokens
    (Inkling's `gammas`): no stand-ins. (HunYuan-MoE's `shared_mlp` is not found by name; it runs first anyway.)

    expert = stand_in_shared_expert(block, "model.layers.1.mlp")   # None: nothing to overlap
    ExpertBroker(layer, dispatcher, layout, shared=expert)
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref

import torch
from torch import nn

logger = logging.getLogger(__name__)

SHARED_EXPERT_NAMES = ("shared_experts", "shared_expert")
ROUTER_NAMES = ("gate", "router")


class _ThisThread(threading.local):
    """One thread's calls of one block. Weak references: a note must not keep a layer's activations alive."""

    def __init__(self):
        self.tokens: weakref.ref | None = None  # what the router got in the block's current call
        self.ran_on: weakref.ref | None = None  # what the shared expert last ran on for the block itself
        self.stash: tuple[weakref.ref, torch.Tensor] | None = None  # (tokens, their shared expert's output)


class SharedExpert:
    """One MoE block's shared expert as its broker computes it while the rows are away (module docstring)."""

    def __init__(self, module: nn.Module, block: str):
        self.module = module  # the block's own child, not registered here: its path stays the block's
        self.block = block  # the block's path, for the log
        self.serves = True  # False once the block called its shared expert on other inputs than its router's
        self._calls = _ThisThread()

    def __deepcopy__(self, memo: dict) -> "SharedExpert":
        """Itself: a copy of the block's router (peft's `modules_to_save` trains one) notes for the same block."""
        return self

    def saw(self, tokens: torch.Tensor | None) -> None:
        """The router's stand-in: the tokens of the block's current call."""
        calls = self._calls
        calls.tokens = None if tokens is None else weakref.ref(tokens)

    def due(self, decided: bool | None = None) -> torch.Tensor | None:
        """The tokens whose shared expert the broker computes in this call (what the router got, taken once); None
        where the block computes it: it ran on them already, before its experts (on them or a view of them), or
        the overlap stopped for this block. `decided`: a checkpointed layer's recompute does as its forward did."""
        calls = self._calls
        tokens, calls.tokens = _alive(calls.tokens), None
        if decided is not None:
            return tokens if decided else None
        if not self.serves or tokens is None or _same_memory(_alive(calls.ran_on), tokens):
            return None
        return tokens

    def compute(self, tokens: torch.Tensor) -> None:
        """The broker, while the rows are away: the shared expert of `tokens`, through the block's own module (its
        hooks, peft's LoRA, this thread's grad mode and checkpoint), kept for the block's call."""
        calls = self._calls
        calls.stash = None  # a call that ended early leaves none for this one
        out = self.module(tokens)
        calls.stash, calls.ran_on = (weakref.ref(tokens), out), None  # that run was the broker's, not the block's

    def take(self, tokens: torch.Tensor | None, more: bool) -> torch.Tensor | None:
        """The shared expert's stand-in, called as the block calls it (`more`: with other arguments too): the stashed
        output if it was computed on this very tensor, else None (the stand-in computes)."""
        calls = self._calls
        stash, calls.stash = calls.stash, None
        if stash is None or stash[0]() is None:  # none, or left by a call that ended early (its tokens are gone)
            return None
        if stash[0]() is tokens and not more:
            return stash[1]
        if self.serves:  # a recompute of a call from before it stopped finds the same
            self.serves = False
            logger.warning("%s calls its shared expert on other inputs than its router's: it is computed after the "
                           "routed experts from now on (training.overlap.shared_experts)", self.block)
        return None

    def ran(self, tokens: torch.Tensor) -> None:
        """The shared expert's stand-in computed on `tokens`."""
        calls = self._calls
        calls.ran_on = weakref.ref(tokens)


def _alive(ref: weakref.ref | None) -> torch.Tensor | None:
    return None if ref is None else ref()


def _same_memory(ran_on: torch.Tensor | None, tokens: torch.Tensor) -> bool:
    """Whether the live tensors `ran_on` and `tokens` start at one address with as many elements: one is the other,
    or a view of it."""
    return ran_on is not None and ran_on.data_ptr() == tokens.data_ptr() and ran_on.numel() == tokens.numel()


class _NotesTokens(nn.Module):
    """The role a block's router plays: it notes the tokens it is given for the block's `SharedExpert`."""

    vela_shared_expert: SharedExpert

    def forward(self, *args, **kwargs):
        self.vela_shared_expert.saw(args[0] if args else None)
        return super().forward(*args, **kwargs)


class _ServesStash(nn.Module):
    """The role a block's shared expert plays: its output computed while the rows were away, if it was computed on
    these tokens; else computed here, as the block asks."""

    vela_shared_expert: SharedExpert

    def forward(self, *args, **kwargs):
        tokens = args[0] if args else None
        stashed = self.vela_shared_expert.take(tokens, more=len(args) > 1 or bool(kwargs))
        if stashed is not None:
            return stashed
        out = super().forward(*args, **kwargs)
        if tokens is not None:
            self.vela_shared_expert.ran(tokens)
        return out


def stand_in_shared_expert(block: nn.Module, path: str) -> SharedExpert | None:
    """The `SharedExpert` of the MoE block at `path`, its router and shared expert made stand-ins of themselves; None
    where there is nothing to overlap (module docstring)."""
    shared, router = _child(block, SHARED_EXPERT_NAMES), _child(block, ROUTER_NAMES)
    if shared is None or router is None or not _takes_tokens_only(shared):
        return None
    expert = SharedExpert(shared, path)
    stand_in(router, _NotesTokens, expert)
    stand_in(shared, _ServesStash, expert)
    return expert


def stand_in(module: nn.Module, role: type[nn.Module], expert: SharedExpert) -> None:
    """`module` stays itself (its path, parameters, buffers, state) and plays `role` for `expert`: its class gets
    `role` as a base in front, under its own name."""
    if not isinstance(module, role):
        module.__class__ = _playing(role, type(module))
    module.vela_shared_expert = expert


@functools.cache
def _playing(role: type[nn.Module], cls: type[nn.Module]) -> type[nn.Module]:
    return type(cls.__name__, (role, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _child(block: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    return next((child for name, child in block.named_children() if name in names), None)


def _takes_tokens_only(module: nn.Module) -> bool:
    """Whether `module`'s forward needs nothing but the tokens (the broker computes it from them alone)."""
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    named = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return bool(params) and sum(p.default is p.empty and p.kind in named for p in params) == 1
