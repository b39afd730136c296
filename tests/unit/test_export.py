"""`vela export`: merged models equal base + peft adapter, per-expert adapters equal the fused one, bad input.

Each family's debug model (`vela_ray.model.families.debug_model`, as tests/unit/test_every_family.py builds
them) is saved with `save_pretrained`, which writes the hub layout (per-expert `experts.{e}.w1` tensors for
Mixtral, fused stacks for gpt-oss), and given a random adapter (non-zero B, every expert's factors
different) in peft's fused layout, as vela-ray exports it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from tests.fixtures import REFUSED
from vela_ray.cli import main
from vela_ray.export import FORMATS, export_run
from vela_ray.model.adapters import full_lora_config
from vela_ray.model.experts import LoraSpec
from vela_ray.model.families import debug_model, moe_families
from vela_ray.model.merging import merge_checkpoint, peft_layout, serving_adapter
from vela_ray.model.modeling import find_moe_blocks

LORA = LoraSpec(r=4, alpha=8)


def make_base_and_adapter(tmp_path: Path, family: str, dtype: torch.dtype = torch.float32,
                          max_shard_size: str | int = "5GB", lora: LoraSpec = LORA, **overrides) -> tuple[Path, Path]:
    """(base checkpoint dir, fused peft adapter dir) of `family`'s debug model; the modules `lora` trains in full
    (`modules_to_save`) moved off their base weights, as training moves them."""
    model = debug_model(family, **overrides).to(dtype)
    base = tmp_path / "base"
    model.save_pretrained(base, max_shard_size=max_shard_size)
    lora_config = full_lora_config(model, lora)
    lora_config.init_lora_weights = False  # random A and B: every expert's delta differs
    torch.manual_seed(7)
    adapter = tmp_path / "adapter"
    peft_model = get_peft_model(model, lora_config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".modules_to_save." in name:
                param.add_(torch.randn_like(param))
    peft_model.save_pretrained(adapter)
    return base, adapter


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


def _merged_equals_peft(tmp_path: Path, family: str, dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(relative logit error, |loss difference|) of the merged model against base + peft adapter."""
    base, adapter = make_base_and_adapter(tmp_path, family, dtype)
    merged_dir = merge_checkpoint(adapter, base, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=dtype).eval()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), adapter).eval()
    batch = _batch(merged.config.get_text_config().vocab_size)
    with torch.no_grad():
        got, want = merged(**batch), reference(**batch)
        with reference.disable_adapter():
            plain = reference(**batch)
    assert rel_error(plain.logits, want.logits) > 1e-3  # the adapter changes what the model computes
    return rel_error(got.logits, want.logits), abs(float(got.loss) - float(want.loss))


SUBSET = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss")


def _sweep() -> list:
    """Every family vela-ray trains; all but `SUBSET` marked slow (each sweep takes ~45 s on the 2-core machine)."""
    return [pytest.param(f, marks=[] if f in SUBSET else [pytest.mark.slow]) for f in moe_families()
            if f not in REFUSED]


# Families whose checkpoint layout the merge cannot write back into, and the conversion that says why.
MERGE_REFUSED = {
    "inkling2_loop_text": "Inkling2LoopDequantizeExperts",  # experts stored quantized
    "inkling2_text": "Interleave",  # w13 stored interleaved
    "lara_mini": "Split",  # an adapted backbone tensor split four ways on load
}
# Jamba's Mamba mixer reads `dt_proj.weight` directly (`dt_proj.weight @ time_step`), past peft's LoRA forward:
# peft's unmerged model ignores that factor, and every merge (peft's `merge_and_unload` too) folds it in. A
# trained adapter never differs there (its B starts at 0 and gets no gradient); this test's random B does.
READS_ADAPTED_WEIGHTS_DIRECTLY = {"jamba"}


@pytest.mark.parametrize("family", _sweep())
def test_every_family_merges_equal_to_peft_or_is_refused_with_the_reason(family, tmp_path):
    if family in MERGE_REFUSED:
        with pytest.raises(ValueError, match=f"converts with .*{MERGE_REFUSED[family]}.*cannot be exported merged"):
            _merged_equals_peft(tmp_path, family)
        return
    if family in READS_ADAPTED_WEIGHTS_DIRECTLY:
        _merged_equals_peft_merge_and_unload(tmp_path, family)
        return
    logits_error, loss_error = _merged_equals_peft(tmp_path, family)
    assert logits_error < 1e-5  # relative L2 over all logits
    assert loss_error < 1e-5  # the merged model reproduces the loss


def _merged_equals_peft_merge_and_unload(tmp_path: Path, family: str) -> None:
    base, adapter = make_base_and_adapter(tmp_path, family)
    merged = AutoModelForCausalLM.from_pretrained(merge_checkpoint(adapter, base, tmp_path / "merged")).state_dict()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    want = reference.merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_bf16_merge_is_within_bf16_rounding_of_the_peft_model(tmp_path):
    base, adapter = make_base_and_adapter(tmp_path, "qwen3_moe", torch.bfloat16)
    merged_dir = merge_checkpoint(adapter, base, tmp_path / "merged")
    batch = _batch(AutoModelForCausalLM.from_pretrained(base).config.vocab_size)

    def logits(dtype: torch.dtype, merged: bool) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(merged_dir if merged else base, dtype=dtype)
        model = model if merged else PeftModel.from_pretrained(model, adapter)
        with torch.no_grad():
            return model.eval()(**batch).logits

    exact = logits(torch.float32, merged=False)  # the bf16 weights upcast, the adapter applied in fp32
    peft_error = rel_error(logits(torch.bfloat16, merged=False), exact)
    merged_error = rel_error(logits(torch.bfloat16, merged=True), exact)
    # bf16 keeps 8 significant bits; on this debug model peft's own bf16 run is ~8% (relative L2) from exact.
    # The merge rounds W + delta once; peft rounds the delta at each use: both are rounding, of the same
    # size (a misplaced delta would be ~100%).
    assert merged_error < 1.5 * peft_error


def test_merged_checkpoint_keeps_the_inputs_files_names_dtypes_and_shards(tmp_path):
    base, adapter = make_base_and_adapter(tmp_path, "mixtral", torch.bfloat16, max_shard_size="20KB")
    merged = merge_checkpoint(adapter, base, tmp_path / "merged")
    assert sorted(p.name for p in merged.iterdir()) == sorted(p.name for p in base.iterdir())
    assert json.loads((merged / "model.safetensors.index.json").read_text()) == \
        json.loads((base / "model.safetensors.index.json").read_text())
    shards = sorted(base.glob("*.safetensors"))
    assert len(shards) > 2
    changed = 0
    for shard in shards:
        with safe_open(str(shard), "pt") as a, safe_open(str(merged / shard.name), "pt") as b:
            assert list(a.keys()) == list(b.keys())
            assert a.metadata() == b.metadata()
            for key in a.keys():
                x, y = a.get_tensor(key), b.get_tensor(key)
                assert (x.dtype, x.shape) == (y.dtype, y.shape)
                changed += not torch.equal(x, y)
        assert shard.stat().st_size == (merged / shard.name).stat().st_size
    # 2 layers x (4 attention projections + 6 experts x w1, w2, w3) adapted
    assert changed == 2 * (4 + 6 * 3)


def _rss_anon() -> int:
    """Anonymous resident memory of this process (bytes): heap and allocations, not memory-mapped files."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status (Linux)")
def test_merge_peak_memory_stays_near_one_shard_plus_one_expert_stack(tmp_path):
    # OLMoE at hidden 256, 512 intermediate, 16 experts, 8 layers: gate_up stack 16 x 1024 x 256 x 4 B = 16 MiB,
    # a model of ~ 200 MiB in shards of <= 20 MB. Peak anonymous memory during the merge is sampled every ms.
    base, adapter = make_base_and_adapter(
        tmp_path, "olmoe", max_shard_size="20MB", hidden_size=256, intermediate_size=512, num_experts=16,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4)
    shard_sizes = [p.stat().st_size for p in base.glob("*.safetensors")]
    stack = 16 * 2 * 512 * 256 * 4
    total = sum(shard_sizes)
    peak, stop = [0], threading.Event()

    def sample(start: int) -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon() - start)
            time.sleep(0.001)

    import gc
    gc.collect()
    sampler = threading.Thread(target=sample, args=(_rss_anon(),))
    sampler.start()
    try:
        merge_checkpoint(adapter, base, tmp_path / "merged")
    finally:
        stop.set()
        sampler.join()
    bound = max(shard_sizes) + stack
    print(f"merge peak {peak[0] / 2**20:.1f} MiB; largest shard {max(shard_sizes) / 2**20:.1f} MiB, expert stack "
          f"{stack / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB, model {total / 2**20:.1f} MiB")
    assert total > 4 * bound  # the test means something: the whole model would not fit the bound
    assert peak[0] < bound


# --- per-expert ---------------------------------------------------------------------------------------


class _PerExpertMLP(nn.Module):
    """One expert as the per-expert checkpoint names it: gate/up/down linear layers from the 3-D stacks."""

    def __init__(self, names: tuple[str, str, str], gate_up: torch.Tensor, down: torch.Tensor, act):
        super().__init__()
        self.names = names
        half = gate_up.shape[0] // 2
        for name, weight in zip(names, (gate_up[:half], gate_up[half:], down)):
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            layer.weight.data.copy_(weight)
            self.add_module(name, layer)
        self.act = act

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act(gate(x)) * up(x))


def _per_expert_reference(fused_model, per_expert_state: dict, lora_config: LoraConfig) -> nn.Module:
    """A model of per-expert `nn.Linear`s named as the per-expert adapter names them, built from the base
    model's 3-D stacks, with the per-expert adapter applied by peft."""
    root = nn.Module()
    names = _expert_paths(per_expert_state)
    blocks = find_moe_blocks(fused_model)
    for block, (path, leaves) in zip(blocks, sorted(names.items(), key=lambda kv: _layer(kv[0]))):
        experts = block.block.experts
        leaf_order = _gate_up_down(leaves)
        holder = nn.ModuleList(
            [_PerExpertMLP(leaf_order, experts.gate_up_proj[e], experts.down_proj[e], experts.act_fn)
             for e in range(experts.gate_up_proj.shape[0])])
        _set_path(root, path, holder)
    peft_model = get_peft_model(root, lora_config)
    missing = peft_model.load_state_dict(
        {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"):
         v for k, v in per_expert_state.items() if ".experts." in k}, strict=False)
    assert not missing.unexpected_keys
    return peft_model


def _expert_paths(per_expert_state: dict) -> dict[str, set[str]]:
    """{experts module path: its per-expert leaf names} of a per-expert adapter state."""
    names: dict[str, set[str]] = {}
    for key in per_expert_state:
        match = re.match(r"base_model\.model\.(.*\.experts)\.(\d+)\.(\w+)\.lora_A\.weight$", key)
        if match:
            names.setdefault(match.group(1), set()).add(match.group(3))
    return names


def _layer(path: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", path).group(1))


def _gate_up_down(leaves: set[str]) -> tuple[str, str, str]:
    for names in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
        if set(names) == leaves:
            return names
    raise AssertionError(f"unknown per-expert names {leaves}")


def _set_path(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, leaf = path.split(".")
    for name in parents:
        if not hasattr(root, name):
            root.add_module(name, nn.Module())
        root = getattr(root, name)
    root.add_module(leaf, module)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_per_expert_adapter_computes_the_fused_adapters_expert_outputs(family, tmp_path):
    base, adapter = make_base_and_adapter(tmp_path, family)
    config, state, _ = serving_adapter(adapter, base)
    fused = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    reference = _per_expert_reference(AutoModelForCausalLM.from_pretrained(base), state, config).eval()
    x = torch.randn(5, fused.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for block in find_moe_blocks(AutoModelForCausalLM.from_pretrained(base)):
        experts = fused.base_model.model.get_submodule(block.experts_path)  # peft's wrapper: the fused adapter
        paths = [p for p in _expert_paths(state) if _layer(p) == block.decoder_layer]
        per_expert = reference.base_model.model.get_submodule(paths[0])
        outputs = []
        for e in range(len(per_expert)):
            with torch.no_grad():
                # every token routed to expert e with weight 1: the fused experts module computes expert e
                want = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
                got = per_expert[e](x)
            assert rel_error(got, want) < 1e-5, (block.decoder_layer, e)
            outputs.append(got)
        # B's expert axis: experts with different factors compute different outputs
        assert rel_error(outputs[0], outputs[1]) > 1e-2


@pytest.mark.parametrize("family", _sweep())
def test_every_per_expert_family_splits_each_experts_factors_exactly(family, tmp_path):
    """Projection by projection (whatever the family's activation): a per-expert `nn.Linear` per module the
    per-expert adapter names, initialised from its rows of the base model's 3-D stack and adapted by peft with
    that adapter, computes those rows of the stack as peft's fused adapter changes it (base + peft's own
    `get_delta_weight`)."""
    base, adapter = make_base_and_adapter(tmp_path, family)
    if family in MERGE_REFUSED and family != "lara_mini":  # lara_mini's refusal is a backbone tensor's
        with pytest.raises(ValueError, match=MERGE_REFUSED[family]):
            serving_adapter(adapter, base)
        return
    config, state, per_expert = serving_adapter(adapter, base)
    if not per_expert:  # the checkpoint stores its experts fused: so do serving engines, per the README
        with safe_open(str(next(base.glob("*.safetensors"))), "pt") as f:
            assert not any(re.search(r"\.experts\.\d+\.", k) for k in f.keys())
        return
    fused = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    plain = AutoModelForCausalLM.from_pretrained(base)
    in_memory = {_layer(b.experts_path): b.experts_path for b in find_moe_blocks(plain)}
    root, wanted = nn.Module(), {}
    for path, leaves in _expert_paths(state).items():
        experts = plain.get_submodule(in_memory[_layer(path)])
        for leaf in leaves:
            stack, rows = _rows_of(experts, leaf)
            effective = _effective_stack(fused, in_memory[_layer(path)], stack)
            for e in range(effective.shape[0]):
                weight = getattr(experts, stack)[e, rows]
                layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
                layer.weight.data.copy_(weight)
                _set_path(root, f"{path}.{e}.{leaf}", layer)
                wanted[f"{path}.{e}.{leaf}"] = effective[e, rows]
    reference = get_peft_model(root, config)
    loaded = reference.load_state_dict({re.sub(r"\.lora_([AB])\.weight$", r".lora_\1.default.weight", k): v
                                        for k, v in state.items() if k.removeprefix("base_model.model.").rsplit(
                                            ".lora_", 1)[0] in wanted}, strict=False)
    assert not loaded.unexpected_keys
    for name, want in wanted.items():
        x = torch.randn(5, want.shape[1], generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert rel_error(reference.base_model.model.get_submodule(name)(x), x @ want.T) < 1e-5, name


def _rows_of(experts: nn.Module, leaf: str) -> tuple[str, slice]:
    """(in-memory stack, its rows) a per-expert module stands for: gate and up are the halves of gate_up."""
    if leaf in ("down_proj", "w2"):
        return "down_proj", slice(None)
    if not hasattr(experts, "gate_up_proj"):
        return leaf, slice(None)  # an ungated MLP (Nemotron-H: up_proj, down_proj)
    half = experts.gate_up_proj.shape[1] // 2
    return "gate_up_proj", slice(0, half) if leaf in ("gate_proj", "w1") else slice(half, None)


def _effective_stack(fused: PeftModel, experts_path: str, stack: str) -> torch.Tensor:
    """[E, O, I]: the experts' `stack` with peft's fused delta added, by peft."""
    for name, module in fused.base_model.model.named_modules():
        if name.startswith(experts_path) and getattr(module, "parameter_name", None) == stack:
            with torch.no_grad():
                return module.get_param() + module.get_delta_weight("default")
    raise AssertionError(f"no adapted {stack} under {experts_path}")


def test_per_expert_uses_the_checkpoints_expert_names_and_targets_them_by_a_list_of_names(tmp_path):
    base, adapter = make_base_and_adapter(tmp_path, "mixtral")
    run = fake_run(tmp_path, base, adapter)
    export_run(run, "per-expert", tmp_path / "out")
    state = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.block_sparse_moe.experts.5.w3.lora_B.weight" in state
    assert not any(k.endswith("experts.lora_A.weight") for k in state)
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["target_parameters"] is None
    # module-name suffixes, as peft matches them and SGLang reads them (a regex is "all" to it, or refused)
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj", "w1", "w2", "w3"]


def test_gpt_oss_stores_experts_fused_so_per_expert_writes_the_fused_layout(tmp_path):
    base, adapter = make_base_and_adapter(tmp_path, "gpt_oss")
    assert serving_adapter(adapter, base)[2] is False
    run = fake_run(tmp_path, base, adapter)
    exported = export_run(run, "per-expert", tmp_path / "out")
    assert "fused" in exported.note
    assert load_file(tmp_path / "out" / "adapter_model.safetensors").keys() == \
        load_file(adapter / "adapter_model.safetensors").keys()
    assert isinstance(json.loads((tmp_path / "out" / "adapter_config.json").read_text())["target_modules"], list)


# --- a trained router, rank and alpha patterns, rsLoRA: every format as peft applies the adapter -----------------

ROUTER_AND_PATTERNS = {"rank_pattern": {r"experts\.down_proj": 2, "q_proj": 6},
                       "alpha_pattern": {r"experts\.gate_up_proj": 3.0, "o_proj": 16}, "use_rslora": True}
ROUTERS = {"mixtral": "gate", "qwen3_moe": "gate", "phimoe": "router"}


def _logits(model_dir: Path, adapter: Path | None = None) -> torch.Tensor:
    """fp32 logits of `_batch` by the model in `model_dir`, with the peft adapter `adapter` if given (peft's own
    loading, `PeftModel.from_pretrained`)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model = (PeftModel.from_pretrained(model, str(adapter)) if adapter else model).eval()
    with torch.no_grad():
        return model(**_batch(model.config.get_text_config().vocab_size)).logits


# mixtral and qwen3_moe: families peft's transformers-v4 conversion maps per-expert factors onto the fused experts
# for; phimoe: one it does not (peft alone would apply the attention factors only)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "phimoe"])
def test_a_router_and_rank_patterns_export_merged_and_per_expert_as_peft_applies_them(family, tmp_path):
    lora = LoraSpec(r=4, alpha=8, modules_to_save=(ROUTERS[family],),
                    **{k: tuple(v.items()) if isinstance(v, dict) else v for k, v in ROUTER_AND_PATTERNS.items()})
    base, adapter = make_base_and_adapter(tmp_path, family, lora=lora)
    run = fake_run(tmp_path, base, adapter)
    export_run(run, "merged", tmp_path / "merged")
    export_run(run, "per-expert", tmp_path / "per-expert")
    want = _logits(base, adapter)
    assert rel_error(_logits(base), want) > 1e-3
    assert rel_error(_logits(tmp_path / "merged"), want) < 1e-5  # the trained router replaced, each module's scale
    config = json.loads((tmp_path / "per-expert" / "adapter_config.json").read_text())
    # one rank and one lora_alpha / r, as serving engines apply an adapter; the router as peft saves it
    assert (config["r"], config["rank_pattern"], config["alpha_pattern"], config["use_rslora"]) == (6, {}, {}, False)
    assert config["modules_to_save"] == [ROUTERS[family]]
    with peft_layout(tmp_path / "per-expert", base) as gathered:  # what `vela generate --adapter` applies
        assert rel_error(_logits(base, gathered), want) < 1e-5
    if family != "phimoe":
        assert rel_error(_logits(base, tmp_path / "per-expert"), want) < 1e-5


@pytest.mark.parametrize("family", _sweep())
def test_every_per_expert_export_applies_as_its_adapter(family, tmp_path):
    """The per-expert export (or the fused one, where the checkpoint stores experts fused), applied as `vela
    generate` applies an adapter (`peft_layout`), computes what the trained adapter computes."""
    base, adapter = make_base_and_adapter(tmp_path, family)
    if family in MERGE_REFUSED and family != "lara_mini":  # refused with the reason (the sweep above)
        return
    config, state, _ = serving_adapter(adapter, base)
    save_file(state, str(tmp_path / "adapter_model.safetensors"))
    config.save_pretrained(str(tmp_path))
    with peft_layout(tmp_path, base) as applicable:
        assert rel_error(_logits(base, applicable), _logits(base, adapter)) < 1e-5


def test_vllm_is_named_where_it_cannot_take_an_export_as_trained(tmp_path, caplog):
    patterns = {k: tuple(v.items()) for k, v in ROUTER_AND_PATTERNS.items() if isinstance(v, dict)}
    base, adapter = make_base_and_adapter(tmp_path, "mixtral", lora=LoraSpec(r=4, alpha=8, **patterns))
    run = fake_run(tmp_path, base, adapter)
    for fmt in FORMATS:
        caplog.clear()
        export_run(run, fmt, tmp_path / fmt)
        warned = [r.getMessage() for r in caplog.records if r.name == "vela_ray.export" and r.levelname == "WARNING"]
        # vLLM applies one lora_alpha / r to every module: the per-expert export bakes each module's scale in
        assert warned == (["the adapter has a rank_pattern/alpha_pattern, which vLLM ignores (one lora_alpha / r "
                           "for every module): for vLLM, export it with --format per-expert or merged"]
                          if fmt == "peft" else []), fmt


def test_vela_generate_with_a_per_expert_export_applies_every_expert_as_the_merged_model(tmp_path, capsys):
    from tests.fixtures import init_adapter, make_checkpoint
    from vela_ray.generate import load

    # phimoe: a family whose per-expert factors peft's own loading would drop, applying the attention ones only
    model_dir = make_checkpoint(tmp_path / "model", family="phimoe")
    run = fake_run(tmp_path, model_dir, init_adapter(model_dir, tmp_path / "adapter"))
    for fmt in ("merged", "per-expert"):
        export_run(run, fmt, tmp_path / fmt)
    tuned, _ = load(model_dir, tmp_path / "per-expert")
    merged, _ = load(tmp_path / "merged")
    batch = _batch(merged.config.vocab_size)
    with torch.no_grad():
        assert rel_error(tuned(**batch).logits, merged(**batch).logits) < 1e-5
    capsys.readouterr()
    texts = []
    for args in (["--model", str(tmp_path / "merged")],
                 ["--model", str(model_dir), "--adapter", str(tmp_path / "per-expert")]):
        assert main(["generate", *args, "--prompt", "To be, or not", "--max-new-tokens", "12"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]


@pytest.mark.job
def test_a_run_with_a_trained_router_and_rank_patterns_exports_and_generates_as_its_adapter(tmp_path, caplog):
    from tests.fixtures import job_dict, make_checkpoint, run_in_process
    from vela_ray.config import JobConfig
    from vela_ray.generate import generate, load

    torch.set_num_threads(1)
    model_dir = make_checkpoint(tmp_path / "model")
    lora = {"r": 8, "alpha": 16, "modules_to_save": ["gate"], "use_rslora": True,
            "rank_pattern": {r"experts\.down_proj": 4, "q_proj": 4}, "alpha_pattern": {r"experts\.gate_up_proj": 4}}
    config = JobConfig.from_dict(job_dict(model_dir, tmp_path / "run", steps=3, lora=lora, report={"samples": 0},
                                          checkpoint={"every": 3},
                                          training={"optimizer": {"lr": 3e-2, "warmup_steps": 1}}))
    run_in_process(config)
    # its last checkpoint exports the adapter the run wrote, the trained router with it
    export_run(tmp_path / "run" / "checkpoints" / "step-000003", "peft", tmp_path / "from-checkpoint")
    written = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    got = load_file(tmp_path / "from-checkpoint" / "adapter_model.safetensors")
    assert got.keys() == written.keys() and all(torch.equal(got[k], v) for k, v in written.items())
    caplog.clear()
    for fmt in ("merged", "per-expert"):
        assert main(["export", str(tmp_path / "run"), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "vela_ray.export" and r.levelname == "WARNING"]
    assert warned == ["the run trains gate in full (lora.modules_to_save), which vLLM refuses in an adapter: for "
                      "vLLM, export it with --format merged"]  # on the per-expert export, not the merged one
    adapter = tmp_path / "run" / "adapter"
    want = _logits(model_dir, adapter)
    assert rel_error(_logits(model_dir), want) > 1e-3
    router = "model.layers.0.block_sparse_moe.gate.weight"
    trained = load_file(tmp_path / "merged" / "model.safetensors")[router]
    assert not torch.equal(trained, load_file(model_dir / "model.safetensors")[router])  # the router moved
    assert rel_error(_logits(tmp_path / "merged"), want) < 1e-5
    assert rel_error(_logits(model_dir, tmp_path / "per-expert"), want) < 1e-5  # peft loads the per-expert export
    # `vela generate --adapter <per-expert export>`: every expert's factors, as the merged model
    tuned, tokenizer = load(model_dir, tmp_path / "per-expert")
    merged, _ = load(tmp_path / "merged")
    batch = _batch(merged.config.vocab_size)
    with torch.no_grad():
        assert rel_error(tuned(**batch).logits, merged(**batch).logits) < 1e-5
    assert generate(tuned, tokenizer, "To be, or not", 16) == generate(merged, tokenizer, "To be, or not", 16)


# --- the command and bad input --------------------------------------------------------------------------


def fake_run(tmp_path: Path, base: Path, adapter: Path | None) -> Path:
    """A run dir as a finished run leaves it, as far as export reads it: config.json and adapter/."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {"path": str(base)}, "lora": {"r": 4, "alpha": 8}}))
    if adapter is not None:
        os.symlink(adapter, run / "adapter")
    return run


def test_vela_export_writes_each_format(tmp_path, capsys):
    base, adapter = make_base_and_adapter(tmp_path, "qwen3_moe")
    run = fake_run(tmp_path, base, adapter)
    for fmt in ("peft", "merged", "per-expert"):
        assert main(["export", str(run), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
    assert "model.safetensors" in {p.name for p in (tmp_path / "merged").iterdir()}
    assert (tmp_path / "peft" / "adapter_model.safetensors").read_bytes() == \
        (adapter / "adapter_model.safetensors").read_bytes()
    assert "per-expert" in capsys.readouterr().out


def test_an_output_dir_that_is_not_empty_is_refused_unless_forced(tmp_path, capsys):
    base, adapter = make_base_and_adapter(tmp_path, "mixtral")
    run = fake_run(tmp_path, base, adapter)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    assert main(["export", str(run), "--format", "peft", "--out", str(out)]) == 2
    assert re.search(r"exists and is not empty.*--force", capsys.readouterr().err)
    assert main(["export", str(run), "--format", "peft", "--out", str(out), "--force"]) == 0
    assert not (out / "old.txt").exists()


def test_a_family_the_format_cannot_take_is_refused_with_the_reason_and_the_old_output_kept(tmp_path, capsys):
    base, adapter = make_base_and_adapter(tmp_path, "lara_mini")
    run = fake_run(tmp_path, base, adapter)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    capsys.readouterr()  # what save_pretrained printed
    assert main(["export", str(run), "--format", "merged", "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert re.search(r"in_proj_qkv.*converts with \['Split'\].*cannot be exported merged.*--format peft", err)
    assert (out / "old.txt").exists()  # refused before anything was replaced


def test_a_run_without_adapter_or_checkpoint_is_refused(tmp_path, capsys):
    base, _ = make_base_and_adapter(tmp_path, "mixtral")
    run = fake_run(tmp_path, base, None)
    assert main(["export", str(run), "--format", "peft", "--out", str(tmp_path / "out")]) == 2
    assert "no adapter and no valid checkpoint" in capsys.readouterr().err


def test_a_corrupt_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "step-000003"
    ckpt.mkdir()
    (ckpt / "backbone.safetensors").write_bytes(b"12345")
    (ckpt / "manifest.json").write_text(json.dumps(
        {"step": 3, "files": {"backbone.safetensors": {"bytes": 9, "sha256": "0"}}}))
    with pytest.raises(ValueError, match="backbone.safetensors has 5 bytes"):
        export_run(ckpt, "peft", tmp_path / "out")


def test_too_little_disk_for_a_merged_model_is_refused_before_writing(tmp_path, monkeypatch):
    from collections import namedtuple

    base, adapter = make_base_and_adapter(tmp_path, "mixtral")
    run = fake_run(tmp_path, base, adapter)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(ValueError, match=r"needs 0\.\d+ GB but only 0\.00 GB are free"):
        export_run(run, "merged", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not one of peft, merged, per-expert"):
        export_run(tmp_path, "gguf", tmp_path / "out")


@pytest.mark.job
def test_a_checkpoint_exports_the_adapter_the_run_wrote_and_an_interrupted_run_exports_its_newest(tmp_path):
    from tests.fixtures import job_dict, make_checkpoint, run_in_process
    from vela_ray.config import JobConfig

    torch.set_num_threads(1)
    model_dir = make_checkpoint(tmp_path / "model")
    config = JobConfig.from_dict(job_dict(model_dir, tmp_path / "run", steps=2, checkpoint={"every": 1},
                                          report={"samples": 0}))
    run_in_process(config)
    written = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    export_run(tmp_path / "run" / "checkpoints" / "step-000002", "peft", tmp_path / "from-checkpoint")
    shutil.rmtree(tmp_path / "run" / "adapter")  # as a run stopped before its end leaves it
    exported = export_run(tmp_path / "run", "merged", tmp_path / "merged")
    assert exported.source.endswith("step-000002")
    got = load_file(tmp_path / "from-checkpoint" / "adapter_model.safetensors")
    assert got.keys() == written.keys()
    for key, value in written.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    # the merge of the newest checkpoint computes what the run's own adapter on the base computes
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir),
                                          tmp_path / "from-checkpoint").eval()
    batch = _batch(merged.config.vocab_size)
    with torch.no_grad():
        assert rel_error(merged(**batch).logits, reference(**batch).logits) < 1e-5


# --- --out never eats what is exported, and is replaced only once the export is whole ---------------------


def _files(root: Path) -> dict[str, int]:
    """Every file and dir under `root` with its size (dirs 0): what a refused export must leave as it was."""
    return {str(p.relative_to(root)): p.stat().st_size if p.is_file() else 0 for p in root.rglob("*")}


def _full_run(tmp_path: Path) -> Path:
    """A run dir with its own adapter (not a link), records and a checkpoints dir, as `vela train` leaves it."""
    base, adapter = make_base_and_adapter(tmp_path, "mixtral")
    run = fake_run(tmp_path, base, None)
    shutil.copytree(adapter, run / "adapter")
    (run / "summary.json").write_text("{}")
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / "manifest.json").write_text("{}")
    return run


REFUSED_OUTS = [("run", "is"), ("run/adapter", "is"), ("run/checkpoints", "is"), ("run/summary.json", "is"),
                (".", "holds"), ("run/adapter/x", "lies inside"), ("base", "is")]


def test_force_is_refused_onto_the_run_its_files_above_it_or_the_model_and_nothing_is_touched(tmp_path, capsys):
    run = _full_run(tmp_path)
    before = _files(tmp_path)
    capsys.readouterr()  # what save_pretrained printed
    for out, where in REFUSED_OUTS:
        assert main(["export", str(run), "--format", "peft", "--out", str(tmp_path / out), "--force"]) == 2, out
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1, err
        assert f"--out {tmp_path / out} {where} " in err and "which this export reads" in err, err
        assert f"give an --out apart from it, e.g. {tmp_path / 'run-peft'}" in err
        assert _files(tmp_path) == before, out  # nothing deleted, nothing written
    # an --out inside the run apart from its records is the user's to replace
    exports = run / "exports" / "peft"
    exports.mkdir(parents=True)
    (exports / "old.txt").write_text("x")
    assert main(["export", str(run), "--format", "peft", "--out", str(exports), "--force"]) == 0
    assert sorted(p.name for p in exports.iterdir()) == sorted(p.name for p in (run / "adapter").iterdir())
    assert {k: v for k, v in _files(tmp_path).items() if "exports" not in k} == before


def test_a_forced_export_that_fails_midway_leaves_the_old_out_as_it_was(tmp_path, capsys):
    run = _full_run(tmp_path)
    # a file of the adapter that cannot be read, after the others were copied: the write fails half-way
    os.symlink(tmp_path / "gone", run / "adapter" / "zz-unreadable")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    for target in (out, tmp_path / "new"):
        assert main(["export", str(run), "--format", "peft", "--out", str(target), "--force"]) == 1
    assert [p.name for p in out.iterdir()] == ["old.txt"]  # not emptied, not half-written
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base", "out", "run"]  # no partial export left
