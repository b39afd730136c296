"""The master's backbone cut into pipeline stages (`masters.pipeline_stages`, APTMoE's and GPipe's pipeline), one
master process per stage, over the node's devices.

Stage s of S holds a contiguous range of the decoder layers (`stage_layers`): stage 0 also the embedding, the last
stage the final norm, the LM head and the loss. Every stage is built as one master is (the same seeded skeleton and
LoRA draws, so every tensor starts as one master's), then keeps its own layers (`keep_stage`): the others are
replaced in their ModuleList by `OutsideStage`, which holds nothing, so their weights are never read (stage 0, which
the runner built whole, frees them). The model's own forward runs unchanged on every stage; two boundaries, the
first and last layer of the stage (`StageBoundary`), make it a stage's:

  - a stage past the first ignores the hidden state its forward computed up to its first layer (the embedding of
    the token ids, passed through the layers outside it) and takes the one the stage before sent;
  - a stage before the last ends its forward after its last layer (`StageOutput`) and sends that layer's output.

So the masks, the positions and each layer's own arguments (sliding windows, rotary embeddings) are what one master
computes, for every family, with nothing written per family.

The schedule is GPipe's, in lockstep ticks (`PipelineStage.forward_backward`): at forward tick k stage s runs
micro-batch k - s, then every stage takes part in one exchange over the stages' group (`replicas.Exchanger`: a
`ThreadGroup` of threads, or a gloo group of the stage processes), each sending its output to the next stage; the
backward runs the same ticks back, first micro-batch first, each stage sending the gradient of its input to the
stage before. GPipe, not 1F1B: every micro-batch's activations are kept until the backward (1F1B would keep S of
them), in exchange for a schedule whose ticks every stage walks in one order, and whose gradients sum in the serial
step's micro-batch order (any backward order runs when every graph is kept). The experts of every stage's MoE
layers are served by the ExpertManagers as one master's are: each stage is one more master process to them.

Exact: the hidden states and their gradients are moved, not changed, so every LoRA gradient is one master's, bit
for bit, computed on the one stage that holds its layer. The global gradient norm is the stages' squared norms
summed (with the workers', which master 0 reads once every backward has ended: stage 0's backward is the schedule's
last).

    stage = keep_stage(master, index=1, count=2, group=group, blocks=blocks)
    loss = stage.forward_backward(master.peft_model, micro_batches, model_loss)   # every stage, at once
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from vela_ray.model.modeling import MoeBlock
from vela_ray.model.tensor_parallel import decoder_layers
from vela_ray.training.replicas import Exchanger

logger = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
Forward = Callable[[Batch], Any]  # a micro-batch's forward through the whole model: its loss, or nothing


class StageOutput(BaseException):
    """Raised by a stage's last layer to end the model's forward there (a BaseException: no `except Exception` in
    the model's code takes it); carries the layer's output."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Each stage's contiguous decoder layers, as even as they divide (the first stages one more)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"masters.pipeline_stages ({stages}) must be between 1 and the model's {num_layers} "
                         "decoder layers: every stage holds at least one")
    bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(num_layers), stages)])
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def check_stages(text_config, count: int) -> None:
    """ValueError, in one line, where `count` stages cannot hold the model of `text_config` (its text config) exactly:
    fewer layers than stages, or a loss that adds the router aux loss (the preflight's check, and each stage's)."""
    stage_layers(text_config.num_hidden_layers, count)
    if getattr(text_config, "output_router_logits", False) and getattr(text_config, "router_aux_loss_coef", 0.0):
        raise ValueError("masters.pipeline_stages: this model's loss adds the router aux loss (its config's "
                         "output_router_logits), a product of two means over every layer's routing, which no stage "
                         "can compute alone: set output_router_logits false in its config.json, or "
                         "masters.pipeline_stages: 1")


class OutsideStage(nn.Module):
    """A decoder layer another stage holds: nothing, its input passed on."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class StageBoundary(nn.Module):
    """A stage's first layer (`receives`: it runs on the hidden state the stage before sent) and/or its last
    (`sends`: its output ends the forward, `StageOutput`). It shares the layer's submodules, parameters and buffers
    (the same dicts, as `streaming.StreamedLayer` does), so every name is unchanged."""

    def __init__(self, layer: nn.Module, stage: PipelineStage, receives: bool, sends: bool):
        super().__init__()
        self._modules, self._parameters, self._buffers = layer._modules, layer._parameters, layer._buffers
        self.__dict__["inner"] = layer  # not a submodule: its children are this module's already
        self.__dict__["stage"] = stage
        self.receives, self.sends = receives, sends
        self.training = layer.training

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if self.receives:
            hidden_states = self.stage.take_input()
        output = self.inner(hidden_states, *args, **kwargs)
        if self.sends:
            raise StageOutput(output)
        return output

    def train(self, mode: bool = True) -> StageBoundary:
        self.inner.train(mode)
        return super().train(mode)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner":
                raise
            return getattr(self.inner, name)  # the layer's plain attributes (e.g. `attention_type`)


@dataclass
class PipelineStage:
    """Stage `index` of `count`: its `layers`, the stages' `group`, the shape of the hidden states that cross
    (`hidden_size`, `dtype`), and every MoE block of the model as found before the stage kept its own (a routing
    profile counts each stage's own on the model's layer numbering)."""

    index: int
    count: int
    layers: range
    group: Exchanger
    hidden_size: int
    dtype: torch.dtype
    blocks: list[MoeBlock] = field(default_factory=list)
    _input: torch.Tensor | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def rejoin(self, group: Exchanger) -> None:
        """The stages' group after a recovery started the other stages again (`MasterGroup.restart_ranks`)."""
        self.group = group

    def take_input(self) -> torch.Tensor:
        if self._input is None:
            raise RuntimeError(f"pipeline stage {self.index} ran its first layer with no hidden state from stage "
                               f"{self.index - 1}: its forwards run through `PipelineStage` alone")
        hidden, self._input = self._input, None
        return hidden

    def _run(self, forward: Forward, batch: Batch, hidden: torch.Tensor | None) -> Any:
        """One micro-batch's forward on this stage: its output (the loss's, on the last stage, else the hidden
        state its last layer sends)."""
        self._input = hidden
        try:
            result = forward(batch)
        except StageOutput as out:
            shape, dtype = self._shape(batch)
            if out.hidden.shape != shape or out.hidden.dtype != dtype:  # the next stage reads what it expects
                raise RuntimeError(f"pipeline stage {self.index}'s last layer gave {out.hidden.dtype} "
                                   f"{tuple(out.hidden.shape)}, not the {dtype} {shape} the next stage "
                                   "receives") from None
            return out.hidden
        finally:
            self._input = None
        if not self.last:
            raise RuntimeError(f"pipeline stage {self.index}'s forward ended before its last layer "
                               f"{self.layers[-1]}")
        return result

    def _shape(self, batch: Batch) -> tuple[tuple[int, ...], torch.dtype]:
        return (*batch["input_ids"].shape, self.hidden_size), self.dtype

    def forwards(self, micro_batches: Sequence[Batch], forward: Forward, keep_graph: bool = False
                 ) -> tuple[list[Any], list[torch.Tensor | None], list[Any]]:
        """GPipe's forward ticks over `micro_batches`: (each micro-batch's output on this stage, its input here
        (a leaf that keeps its gradient when `keep_graph`), the last stage's `forward` results: empty elsewhere)."""
        count, here = len(micro_batches), self.index
        outputs: list[Any] = [None] * count
        inputs: list[torch.Tensor | None] = [None] * count
        arrived: dict[int, torch.Tensor] = {}
        for tick in range(count + self.count - 1):
            i = tick - here
            outgoing = {}
            if 0 <= i < count:
                if not self.first:
                    inputs[i] = arrived.pop(i).detach().requires_grad_(keep_graph)
                outputs[i] = self._run(forward, micro_batches[i], inputs[i])
                if not self.last:
                    outgoing = {here + 1: outputs[i].detach()}
            coming = tick + 1 - here  # the micro-batch the stage before runs at this tick
            incoming = {here - 1: self._shape(micro_batches[coming])} if not self.first and 0 <= coming < count \
                else {}
            arrived.update({coming: t for t in self.group.exchange(outgoing, incoming).values()})
        return outputs, inputs, outputs if self.last else []

    def backwards(self, outputs: list[Any], inputs: list[torch.Tensor | None], micro_batches: Sequence[Batch]
                  ) -> None:
        """GPipe's backward ticks, first micro-batch first (every micro-batch's graph is kept, so any order runs;
        this one sums each gradient in the serial step's order): the last stage's from its losses, the others' from
        the gradient of their output the stage after sent; each sends the gradient of its input to the stage before.
        A micro-batch's graph is let go once its backward ran."""
        count, here = len(outputs), self.index
        arrived: dict[int, torch.Tensor] = {}
        for tick in range(count + self.count - 1):
            i = tick - (self.count - 1 - here)  # the stage after runs i + 1 at this tick
            outgoing = {}
            if 0 <= i < count:
                torch.autograd.backward(outputs[i], None if self.last else arrived.pop(i))
                if not self.first:
                    outgoing = {here - 1: inputs[i].grad}
                outputs[i] = inputs[i] = None
            coming = i + 1
            incoming = {here + 1: self._shape(micro_batches[coming])} if not self.last and 0 <= coming < count \
                else {}
            arrived.update({coming: t for t in self.group.exchange(outgoing, incoming).values()})

    def forward_backward(self, model: nn.Module, micro_batches: Sequence[Batch],
                         loss_fn: Callable[[nn.Module, Batch], torch.Tensor]) -> float:
        """`step.forward_backward`'s work, pipelined: every micro-batch's loss scaled by 1/len(micro_batches),
        forward and backward through every stage; their summed loss, on every stage."""
        scale = len(micro_batches)
        outputs, inputs, losses = self.forwards(micro_batches, lambda batch: loss_fn(model, batch) / scale,
                                                keep_graph=True)
        total = sum(float(loss.detach()) for loss in losses)
        self.backwards(outputs, inputs, micro_batches)
        return self.group.sum(total)


def keep_stage(model: nn.Module, index: int, count: int, group: Exchanger, blocks: list[MoeBlock]
               ) -> PipelineStage:
    """Make `model` (peft-wrapped, before any step) stage `index` of `count` (module docstring): its own layers
    kept, the first and last behind a `StageBoundary`, every other layer replaced by an `OutsideStage`. The
    caller gives its optimizer the parameters left (`MasterModel.keep_stage`)."""
    layers = decoder_layers(model)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    check_stages(text, count)
    in_layers = {id(p) for p in layers.parameters()}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_layers]
    if outside:
        raise ValueError(f"masters.pipeline_stages: {outside[0]} is trained outside the decoder layers, which "
                         "no one stage's layers hold: adapt only modules inside the layers (lora.target_modules), or "
                         "set masters.pipeline_stages: 1")
    own = stage_layers(len(layers), count)[index]
    stage = PipelineStage(index, count, own, group, text.hidden_size,
                          model.get_input_embeddings().weight.dtype, list(blocks))
    for i in range(len(layers)):
        if i not in own:
            layers[i] = OutsideStage(i)
    first, last = own[0], own[-1]
    receives, sends = index > 0, index < count - 1
    if first == last:
        layers[first] = StageBoundary(layers[first], stage, receives, sends)
    else:
        if receives:
            layers[first] = StageBoundary(layers[first], stage, receives=True, sends=False)
        if sends:
            layers[last] = StageBoundary(layers[last], stage, receives=False, sends=True)
    logger.info("pipeline stage %d of %d: decoder layers %d-%d", index, count, first, last)
    return stage
