"""The optimizer pieces each side runs: the gradient norm and the clipped step, with host syncs that do not
grow with the number of experts (an expert host holds one tensor per (expert, factor): thousands on a real
MoE, and each read back to the host would stall a GPU step)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.equivalence import LORA, micro_batches
from vela_ray.model.experts import ExpertShard
from vela_ray.model.families import debug_model
from vela_ray.model.modeling import expert_weights, experts_prototypes, find_moe_blocks
from vela_ray.training.optim import ShardTrainer, apply_step, grad_sq_norm, make_adamw
from vela_ray.training.schedule import OptimizerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# what reads a tensor's value back to the host (a device sync on a GPU)
HOST_READS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


class CountHostReads(TorchFunctionMode):
    """Counts reads of tensor values back to the host, but for the tensors in `host_side` (AdamW's `step`
    counters: torch keeps them on the CPU unless capturable, so reading one costs no device sync)."""

    def __init__(self, host_side: list[torch.Tensor] = ()):
        super().__init__()
        self.count = 0
        self.host_side = {id(t) for t in host_side}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in HOST_READS and id(args[0]) not in self.host_side
        return func(*args, **(kwargs or {}))


def test_the_gradient_norm_equals_the_per_tensor_sum_in_fp64():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(3, 5), (7,), (2, 2, 4), (1,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 10
    params.append(torch.nn.Parameter(torch.zeros(4)))  # no gradient: not counted
    want = sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None)
    assert grad_sq_norm(params) == pytest.approx(want, rel=1e-6)
    assert grad_sq_norm([params[-1]]) == 0.0


def test_the_clipped_step_equals_clip_grad_norm_then_adamw():
    g = torch.Generator().manual_seed(1)
    ours = [torch.nn.Parameter(torch.randn(4, 3, generator=g)) for _ in range(5)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    cfg = OptimizerConfig(lr=1e-2)
    opt_ours, opt_theirs = make_adamw(ours, cfg), make_adamw(theirs, cfg)
    max_norm = 0.3
    apply_step(opt_ours, 1e-2, min(1.0, max_norm / (grad_sq_norm(ours) ** 0.5 + 1e-6)))
    torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    opt_theirs.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _expert_host_step_reads(num_experts: int) -> int:
    """Host reads of one expert host's optimizer work in a step (norm, clip, AdamW), hosting every expert
    of a debug Mixtral with `num_experts` experts per layer."""
    model = debug_model("mixtral", num_local_experts=num_experts)
    shard = ExpertShard.from_weights(expert_weights(find_moe_blocks(model)), LORA, experts_prototypes(model.config),
                                     seed=0)
    trainer = ShardTrainer(shard, OptimizerConfig(lr=1e-3, max_grad_norm=0.5))
    trainer.step(1e-3, 1.0)  # AdamW's state exists from here on
    rows = micro_batches(0)[0]["input_ids"].shape[0] * 8
    for layer in range(len(find_moe_blocks(model))):  # a gradient for every expert's factors
        ids = torch.arange(rows) % num_experts
        shard.forward_rows(layer, ids, torch.randn(rows, model.config.hidden_size), key=layer)
        shard.backward_rows(layer, torch.randn(rows, model.config.hidden_size))
    with CountHostReads([s["step"] for s in trainer.optimizer.state.values()]) as reads:
        total = trainer.grad_sq_norm()
        trainer.step(1e-3, min(1.0, 0.5 / total ** 0.5))
    return reads.count


def test_an_expert_hosts_step_reads_the_host_as_often_with_4_or_16_experts():
    few, many = _expert_host_step_reads(4), _expert_host_step_reads(16)
    assert few == many, f"host reads per step grow with the experts: {few} with 4, {many} with 16"
    assert many <= 2
