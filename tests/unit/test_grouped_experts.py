"""A shard's experts of one layer as grouped matrix multiplies (`LayerExperts._low_rank`, `grouped_mm`)
equal a plain per-expert computation: outputs and gradients of the rows and of every LoRA A and B.

The reference is written here, expert by expert, in plain torch: x W (+ bias) + s (x A^T) B^T per weight
stack, with the family's own `_apply_gate` (or `act_fn`) between. Families cover the layouts: Mixtral,
Qwen3-MoE, OLMoE (SwiGLU), gpt-oss (transposed, interleaved gate/up, biased, clamped), DeepSeek-V4 with a
clamp that binds, Nemotron-H (no gate: up_proj and an activation). Routing is uneven and one hosted
expert gets no rows. Both implementations `grouped_mm` may pick run: `torch._grouped_mm` and the
per-expert loop.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from vela_ray.model import experts as experts_mod
from vela_ray.model.experts import ExpertShard, LayerExperts, LoraSpec, slot_name
from vela_ray.model.families import debug_model
from vela_ray.model.modeling import expert_weights, experts_prototypes, find_moe_blocks

LORA = LoraSpec(r=4, alpha=8)
FAMILIES = {
    "mixtral": {},
    "qwen3_moe": {},
    "olmoe": {},
    "gpt_oss": {"swiglu_limit": 0.05},  # the clamp binds
    "deepseek_v4": {"swiglu_limit": 0.05},
    "nemotron_h": {},
}
HOSTED = [0, 2, 3, 5]  # global ids of the hosted experts: not 0..n-1
COUNTS = {0: 9, 2: 0, 3: 1, 5: 14}  # rows per hosted expert: uneven, one with none
IMPLEMENTATIONS = ["torch._grouped_mm", "per-expert loop"]


def build_layer(family: str, hosted: list[int], lora: LoraSpec = LORA, dtype: torch.dtype = torch.float32,
                device: str = "cpu", overrides: dict | None = None) -> tuple[ExpertShard, int]:
    """A shard hosting `hosted` of the family's first MoE layer, with random non-zero LoRA B; (shard, layer).
    `overrides` of the debug config: FAMILIES[family] by default."""
    model = debug_model(family, seed=0, **(FAMILIES[family] if overrides is None else overrides)).to(dtype)
    blocks = find_moe_blocks(model)
    layer = blocks[0].index
    shard = ExpertShard.from_weights(expert_weights(blocks, [(layer, e) for e in hosted]), lora,
                                     experts_prototypes(model.config), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in shard.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    assert shard.layers[str(layer)].low_rank  # the grouped path is the one under test
    return shard.to(device), layer


def routed_rows(counts: dict[int, int], hidden: int, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [R], rows [R, D]): counts[e] rows for expert e, shuffled."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.tensor([e for e, n in counts.items() for _ in range(n)])
    ids = ids[torch.randperm(len(ids), generator=generator)]
    rows = torch.randn(len(ids), hidden, generator=generator)
    return ids.to(device), rows.to(dtype).to(device)


def reference(layer: LayerExperts, ids: torch.Tensor, rows: torch.Tensor, grad_out: torch.Tensor,
              lora: LoraSpec = LORA, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Per expert in plain torch, computed in `dtype`: (outputs, d rows, d every LoRA parameter)."""
    module, scaling = layer.module, lora.alpha / lora.r
    first = "gate_up_proj" if module.has_gate else "up_proj"
    params = list(layer.adapters.parameters())

    def project(stack: str, local: int, x: torch.Tensor) -> torch.Tensor:
        weight = getattr(module, stack)[local].to(dtype)
        y = x @ weight if module.is_transposed else x @ weight.T
        if module.has_bias:
            y = y + getattr(module, f"{stack}_bias")[local].to(dtype)
        adapter, slot = layer.adapters[str(layer.expert_ids[local])], slot_name(stack)
        A, B = getattr(adapter, f"lora_A_{slot}").to(dtype), getattr(adapter, f"lora_B_{slot}").to(dtype)
        return y + scaling * ((x @ A.T) @ B.T)

    x = rows.detach().to(dtype).requires_grad_()
    out = x.new_zeros(x.shape)
    for local, expert in enumerate(layer.expert_ids):
        index = (ids == expert).nonzero()[:, 0]
        h = project(first, local, x[index])
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        out = out.index_add(0, index, project("down_proj", local, h))
    grads = torch.autograd.grad(out, [x, *params], grad_out.to(dtype), allow_unused=True)
    return out.detach(), grads[0], [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads[1:])]


def run_shard(shard: ExpertShard, layer: int, ids: torch.Tensor, rows: torch.Tensor,
              grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The shard's forward_rows/backward_rows: (outputs, d rows, d every LoRA parameter of the layer)."""
    out = shard.forward_rows(layer, ids, rows, key="k")
    grad_rows = shard.backward_rows("k", grad_out)
    return out, grad_rows, [p.grad.clone() for p in shard.layers[str(layer)].adapters.parameters()]


def assert_equal(got: tuple, want: tuple, rtol: float, atol: float) -> None:
    """Outputs, d rows and each d LoRA parameter close; `atol` is relative to the largest |reference|."""
    pairs = [("outputs", got[0], want[0]), ("d rows", got[1], want[1]),
             *((f"d LoRA parameter {i}", g, w) for i, (g, w) in enumerate(zip(got[2], want[2])))]
    for name, g, w in pairs:
        scale = float(w.abs().max()) if w.numel() else 1.0
        torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol * scale, msg=name)


def use(implementation: str, monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Make `grouped_mm` run `implementation`; returns a counter of torch._grouped_mm calls."""
    calls = []
    native = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or native(*a, **k))
    if implementation == "per-expert loop":
        monkeypatch.setattr(experts_mod, "native_grouped_mm", lambda x, w: False)
    return lambda: len(calls)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grouped_experts_equal_the_per_expert_computation(family, implementation, monkeypatch):
    torch.set_num_threads(1)
    calls = use(implementation, monkeypatch)
    shard, layer = build_layer(family, HOSTED)
    experts = shard.layers[str(layer)]
    ids, rows = routed_rows(COUNTS, experts.hidden_size)
    grad_out = torch.randn(rows.shape, generator=torch.Generator().manual_seed(3))
    got = run_shard(shard, layer, ids, rows, grad_out)
    assert_equal(got, reference(experts, ids, rows, grad_out), rtol=1e-5, atol=1e-6)
    assert all(not p.grad.any() for p in shard.expert(layer, 2).parameters())  # no rows, no gradient
    # on CPU, torch >= 2.9 runs torch._grouped_mm: a base and two LoRA products for each of the 2 stacks
    assert calls() == (6 if implementation == "torch._grouped_mm" else 0)


def test_a_shard_with_one_expert(monkeypatch):
    torch.set_num_threads(1)
    calls = use("torch._grouped_mm", monkeypatch)
    shard, layer = build_layer("gpt_oss", [3])
    experts = shard.layers[str(layer)]
    ids, rows = routed_rows({3: 7}, experts.hidden_size)
    grad_out = torch.randn(rows.shape, generator=torch.Generator().manual_seed(3))
    assert_equal(run_shard(shard, layer, ids, rows, grad_out), reference(experts, ids, rows, grad_out),
                 rtol=1e-5, atol=1e-6)
    assert calls() == 6


def test_a_broadcast_output_gradient_is_taken(monkeypatch):
    """torch._grouped_mm's backward rejects an expanded gradient; the unsort by index makes it dense."""
    torch.set_num_threads(1)
    use("torch._grouped_mm", monkeypatch)
    shard, layer = build_layer("mixtral", HOSTED)
    experts = shard.layers[str(layer)]
    ids, rows = routed_rows(COUNTS, experts.hidden_size)
    grad_out = torch.randn(1, rows.shape[1], generator=torch.Generator().manual_seed(3)).expand(rows.shape)
    assert_equal(run_shard(shard, layer, ids, rows, grad_out), reference(experts, ids, rows, grad_out),
                 rtol=1e-5, atol=1e-6)


def test_sizes_the_kernel_cannot_take_run_the_per_expert_loop():
    """16-byte strides: r=4 is fine in fp32, not in bf16 (8 bytes); float64 has no kernel."""
    x = torch.randn(10, 32)
    assert experts_mod.native_grouped_mm(x, torch.randn(3, 32, 4))
    assert not experts_mod.native_grouped_mm(x.bfloat16(), torch.randn(3, 32, 4, dtype=torch.bfloat16))
    assert not experts_mod.native_grouped_mm(x.double(), torch.randn(3, 32, 8, dtype=torch.float64))
    assert not experts_mod.native_grouped_mm(x[:, :30], torch.randn(3, 30, 8))  # 30 floats: 120 bytes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_on_cuda_grouped_experts_equal_the_per_expert_computation(family, dtype, monkeypatch):
    """On CUDA, bf16 and fp32; torch._grouped_mm is what runs on sm90+ (r=8: 16 bytes in bf16). The
    reference runs in fp32 from the same (bf16) weights, so bf16 is held to bf16 rounding; gpt-oss keeps
    its default clamp, which these values do not reach (a binding one would flip elements at the limit
    by rounding)."""
    calls = use("torch._grouped_mm", monkeypatch)
    lora = LoraSpec(r=8, alpha=16)
    shard, layer = build_layer(family, HOSTED, lora=lora, dtype=dtype, device="cuda", overrides={})
    experts = shard.layers[str(layer)]
    ids, rows = routed_rows(COUNTS, experts.hidden_size, dtype=dtype, device="cuda")
    grad_out = torch.randn(rows.shape, generator=torch.Generator().manual_seed(3)).to(dtype).cuda()
    got = run_shard(shard, layer, ids, rows, grad_out)
    want = reference(experts, ids, rows, grad_out, lora, dtype=torch.float32)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 4e-2, "atol": 4e-2}
    assert_equal(got, want, **tolerance)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert calls() == 6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rows_for_experts_not_hosted_raise_a_key_error_naming_them(device):
    """Ids come from the host while the hosted-expert map lives on the weights' device: the error must
    name the missing experts, not fail on indexing a CUDA tensor with a CPU mask (or the reverse)."""
    shard, layer = build_layer("mixtral", HOSTED, device=device)
    experts = shard.layers[str(layer)]
    ids = torch.tensor([0, 4, 2, 1, 4])  # on the host, whatever the device: 1 and 4 are not hosted
    rows = torch.randn(len(ids), experts.hidden_size, device=device)
    with pytest.raises(KeyError, match=rf"experts \[\({layer}, 1\), \({layer}, 4\)\] are not hosted here "
                                       rf"\(hosted of layer {layer}: \[0, 2, 3, 5\]\)"):
        experts(ids, rows)
