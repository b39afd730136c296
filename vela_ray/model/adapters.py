"""LoRA adapters in peft's format, keyed by logical expert.

vela-ray trains two kinds of adapters:
- backbone adapters (attention, shared experts, dense MLPs) with ordinary peft
  `target_modules` on the master's stripped model;
- expert adapters, one per logical (layer, expert), in `ExpertShard`s wherever
  the placement put them.

`export_adapter` writes both as ONE standard peft adapter directory for the
original (unstripped) model, where experts are adapted through
`target_parameters=["experts.gate_up_proj", "experts.down_proj"]`. peft stores
those as fused matrices; for a parameter with E experts and rank r:

    lora_A: [r*E, in]   expert e owns rows  e*r : (e+1)*r
    lora_B: [out, r*E]  expert e owns columns e, e+E, e+2E, ...  (reshape(out, r, E)[:, :, e])

`read_adapter` inverts this, so an adapter loads into any placement or worker count.
By default the router (`gate`) and `lm_head` are not adapted (the paper: all linear layers but the gate);
`LoraSpec` (the job's `lora` section) passes peft's other choices through: target and excluded modules, which
expert stacks, rank/alpha patterns (resolved per expert stack by peft's rule, `resolve_expert_lora`), rsLoRA,
init, backbone dropout and `modules_to_save` (the router trained in full), each checked by `check_lora_targets`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora.layer import ParamWrapper
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.constants import DUMMY_TARGET_MODULES
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from vela_ray.model.quantization import QuantizedLinear
from vela_ray.model.experts import ExpertKey, LoraSpec, slot_name
from vela_ray.model.modeling import find_moe_blocks

logger = logging.getLogger(__name__)

_ROUTER_NAMES = re.compile(r"(^gate$|_gate$|router)")
ADAPTER_FILE = "adapter_model.safetensors"


def plain_linear(module: nn.Module) -> bool:
    """An nn.Linear as peft's LoRA wraps it: the class itself, or a frozen one held quantized (`QuantizedLinear`,
    `model.quantization`: a linear layer with its weight stored in a format's blocks), not another subclass."""
    return type(module) in (nn.Linear, QuantizedLinear)


def linear_targets(model: nn.Module, routers: bool = False) -> str:
    """A regex over the module paths of every nn.Linear to adapt (all but lm_head, and routers unless `routers`:
    `lora.target_modules: all-linear`, peft's meaning, so a linear router or shared-expert gate is adapted).

    Exact paths (layer numbers as \\d+), and without the leaf names that peft's
    transformers-v4 compatibility layer rewrites into *expert* targets for some
    families (`gate_proj`/`up_proj`/`down_proj` in DeepSeek, Qwen3-Next and others, whose
    shared experts and dense MLPs use those names): with them, peft would adapt the
    experts' gate_up_proj with a doubled rank and drop the shared experts, and an
    exported adapter would not load; or that it refuses to rewrite alone (Beam's
    attention `gate_proj` when no `up_proj` exists). Those layers stay frozen (logged), as do
    layers whose saved keys peft renames on load, `nn.Linear` subclasses, and
    modules peft refuses for the architecture (Mamba mixers).
    """
    paths = [
        path for path, mod in model.named_modules()
        if plain_linear(mod)  # subclasses (DeepSeek-V4's grouped o_a_proj) have semantics peft's LoRA breaks
        and not path.endswith("lm_head") and (routers or not _ROUTER_NAMES.search(path.rsplit(".", 1)[-1]))
        and _peft_accepts(model, path.rsplit(".", 1)[-1])
    ]
    rewritten = _leaf_names_peft_rewrites(model, {p.rsplit(".", 1)[-1] for p in paths})
    if rewritten:
        logger.warning("%s: not adapting %s layers (peft maps these names onto experts for this family, or refuses "
                       "them as half of a fused expert matrix)", type(model).__name__, sorted(rewritten))
    paths = [p for p in paths if p.rsplit(".", 1)[-1] not in rewritten]
    renamed = _paths_peft_renames_on_load(model, paths)
    if renamed:
        logger.warning("%s: not adapting %s (peft renames their adapter keys on load, so a saved adapter would "
                       "not load back)", type(model).__name__, sorted({re.sub(r"\.\d+\.", ".N.", p) for p in renamed}))
    patterns = sorted({
        re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(path)) for path in paths if path not in renamed
    })
    return "^(?:" + "|".join(patterns) + ")$"


def _paths_peft_renames_on_load(model: nn.Module, paths: list[str]) -> set[str]:
    """Module paths whose saved LoRA keys peft's load-time conversion renames (peft 0.21 applies transformers'
    checkpoint renames as regexes: laguna's "mlp.shared_expert." also hits "mlp.shared_experts.", inkling2's
    rename hits "k_sconv.weight_proj"); an adapter on them would load into the wrong place, or nowhere."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers
    except ImportError:  # older peft: no conversion on load
        return set()
    probe = {f"base_model.model.{p}.lora_A.weight": torch.zeros(1) for p in paths}
    kept = convert_peft_adapter_state_dict_for_transformers(model, LoraConfig(r=1, target_modules=paths), probe)
    return {p for p in paths if f"base_model.model.{p}.lora_A.weight" not in kept}


def _peft_accepts(model: nn.Module, leaf_name: str) -> bool:
    """peft's own per-architecture refusal (Mamba mixers' out_proj/conv1d), asked rather than copied."""
    try:
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba
    except ImportError:  # a peft without the check refuses nothing
        return True
    try:
        _check_lora_target_modules_mamba(LoraConfig(r=1), model, leaf_name)
    except ValueError:
        return False
    return True


def _leaf_names_peft_rewrites(model: nn.Module, leaf_names: set[str]) -> set[str]:
    """Which of `leaf_names` peft's v4->v5 conversion would turn into expert targets for `model`, asked one name
    at a time: a name it rewrites, or one it refuses because, alone, it is half of a fused expert matrix (Beam's
    attention `gate_proj` when every layer is MoE, so that no `up_proj` exists: "Cannot convert PEFT target(s)
    gate_proj without also targeting up_proj"). Either way the name cannot be an ordinary linear target."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # older peft: no conversion layer
        return set()

    def rewrites(leaf_name: str) -> bool:
        probe = LoraConfig(r=1, target_modules=[leaf_name])
        try:
            convert_peft_config_for_transformers(probe, model=model, conversions=None)
        except ValueError:
            return True
        return leaf_name not in (probe.target_modules or ())

    return {name for name in leaf_names if rewrites(name)}


def full_lora_config(model: nn.Module, lora: LoraSpec) -> LoraConfig:
    """The peft config of the *original* model: linear layers + fused expert parameters, with the job's
    options in peft's names (checked against `model` first, `check_lora_targets`)."""
    check_lora_targets(model, lora)
    stacks = expert_parameters(model, lora)
    if lora.target_modules in (None, "all-linear"):
        # "all-linear" as explicit paths: peft 0.21 expands it to leaf names that its transformers-v4 conversion
        # then maps onto the experts and routers of some families (Mixtral: a doubled expert rank), see linear_targets
        targets = linear_targets(model, routers=lora.target_modules == "all-linear")
    else:
        targets = _peft_list(lora.target_modules) or None
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=DUMMY_TARGET_MODULES if targets is None and not stacks else targets,
        exclude_modules=_peft_list(lora.exclude_modules),
        target_parameters=stacks or None,
        rank_pattern=dict(lora.rank_pattern),
        alpha_pattern=dict(lora.alpha_pattern),
        use_rslora=lora.use_rslora,
        init_lora_weights=lora.init_lora_weights,
        modules_to_save=list(lora.modules_to_save) or None,
    )


def expert_parameters(model: nn.Module, lora: LoraSpec = LoraSpec()) -> list[str]:
    """peft `target_parameters` of the experts: every weight stack of every MoE block's experts class, or
    those `lora.expert_stacks` names."""
    return sorted({f"experts.{stack}" for block in find_moe_blocks(model) for stack in block.layout.stacks
                   if lora.expert_stacks is None or stack in lora.expert_stacks})


def resolve_expert_lora(model: nn.Module, lora: LoraSpec) -> LoraSpec:
    """`lora` with `resolved` filled: (MoE layer, stack, r, alpha) of every adapted expert stack, by peft's own
    rule for `target_parameters` (`get_pattern_key` over "<experts path>.<stack>", as `LoraModel.
    _create_and_replace` matches rank_pattern/alpha_pattern keys), so workers need no module paths."""
    resolved = []
    for block in find_moe_blocks(model):
        for stack in block.layout.stacks:
            if lora.expert_stacks is not None and stack not in lora.expert_stacks:
                continue
            key = f"{block.experts_path}.{stack}"
            ranks, alphas = dict(lora.rank_pattern), dict(lora.alpha_pattern)
            r = ranks.get(get_pattern_key(ranks.keys(), key), lora.r)
            alpha = alphas.get(get_pattern_key(alphas.keys(), key), lora.alpha)
            resolved.append((block.index, stack, int(r), float(alpha)))
    return dataclasses.replace(lora, resolved=tuple(resolved))


def resolve_expert_lora_of(model_dir: str | Path, lora: LoraSpec, trust_remote_code: bool = False) -> LoraSpec:
    """`resolve_expert_lora` against a checkpoint's architecture (on the meta device: no weights read)."""
    from vela_ray.model.loading import meta_model  # loading reads checkpoints; adapters sits below it

    return resolve_expert_lora(meta_model(model_dir, trust_remote_code), lora)


def check_lora_targets(model: nn.Module, lora: LoraSpec) -> None:
    """The job's LoRA options against `model`, refused in one line (ValueError) where peft would adapt nothing
    or something else than asked: a target module or expert stack that matches nothing, a rank/alpha pattern
    that matches no adapted module or stack, a router (or other non-linear module) as a LoRA target, dropout
    on expert stacks (peft's `ParamWrapper` refuses it)."""
    blocks = find_moe_blocks(model)
    stacks = {stack for block in blocks for stack in block.layout.stacks}
    unknown = sorted(set(lora.expert_stacks or ()) - stacks)
    if unknown:
        raise ValueError(f"lora.expert_stacks {unknown} match no expert weight stack of {type(model).__name__} "
                         f"(it has {sorted(stacks)})")
    if lora.lora_dropout and expert_parameters(model, lora):
        raise ValueError(f"lora.lora_dropout {lora.lora_dropout} with adapted expert stacks: peft's ParamWrapper "
                         "cannot apply dropout to expert weights; set lora.expert_stacks: [] or lora_dropout: 0")
    paths = [path for path, _ in model.named_modules() if path]
    for name in lora.modules_to_save:  # peft's match: a module path ending with the name
        matched = [path for path in paths if path.endswith(name)]
        if not matched:
            raise ValueError(f"lora.modules_to_save entry {name!r} matches no module of {type(model).__name__}")
        on_workers = [path for path in matched if any(path.startswith(b.experts_path) for b in blocks)]
        if on_workers:
            raise ValueError(f"lora.modules_to_save entry {name!r} matches {on_workers[0]}, expert weights that "
                             "live on the ExpertManagers; adapt them with lora.expert_stacks instead")
    adapted = _backbone_targets(model, lora, blocks)
    adapted += [f"{block.experts_path}.{stack}" for block in blocks for stack in block.layout.stacks
                if lora.expert_stacks is None or stack in lora.expert_stacks]
    for field in ("rank_pattern", "alpha_pattern"):
        for pattern, _ in getattr(lora, field):
            if not any(re.match(rf"(.*\.)?({pattern})$", path) for path in adapted):
                raise ValueError(f"lora.{field} key {pattern!r} matches no adapted module or expert stack of "
                                 f"{type(model).__name__} (e.g. {adapted[:2]})")
    if not adapted and not lora.modules_to_save:
        raise ValueError("lora: nothing to train (no target_modules, no expert_stacks, no modules_to_save)")


def _backbone_targets(model: nn.Module, lora: LoraSpec, blocks) -> list[str]:
    """Module paths `lora.target_modules` adapts in `model` (peft's `check_target_module_exists`; None and
    "all-linear" as `full_lora_config` expands them); ValueError for a target that matches nothing, a module
    peft's LoRA cannot wrap, or a name peft's v4 conversion would move onto the experts."""
    if lora.target_modules in (None, "all-linear"):
        pattern = re.compile(linear_targets(model, routers=lora.target_modules == "all-linear"))
        probe = LoraConfig(r=1, target_modules=pattern.pattern, exclude_modules=_peft_list(lora.exclude_modules),
                           modules_to_save=_peft_list(lora.modules_to_save))
        return [path for path, _ in model.named_modules() if check_target_module_exists(probe, path)]
    inside_experts = tuple(f"{block.experts_path}." for block in blocks)
    routers = {f"{block.path}.{name}" for block in blocks for name, child in block.block.named_children()
               if child is not block.block.experts and not any(True for _ in child.children())
               and _ROUTER_NAMES.search(name)}
    modules = {path: mod for path, mod in model.named_modules() if path and not path.startswith(inside_experts)}
    probe = LoraConfig(r=1, target_modules=_peft_list(lora.target_modules),
                       exclude_modules=_peft_list(lora.exclude_modules),
                       modules_to_save=_peft_list(lora.modules_to_save))
    matched = [path for path in modules if check_target_module_exists(probe, path)]
    if isinstance(lora.target_modules, tuple):
        for name in lora.target_modules:
            if not any(path == name or path.endswith(f".{name}") for path in matched):
                raise ValueError(f"lora.target_modules entry {name!r} matches no module of {type(model).__name__}")
    elif lora.target_modules and not matched:
        raise ValueError(f"lora.target_modules {lora.target_modules!r} matches no module of {type(model).__name__}")
    for path in matched:
        if not plain_linear(modules[path]):
            what = "the router" if path in routers else "a module"
            raise ValueError(f"lora.target_modules adapts {what} {path} of {type(model).__name__}, a "
                             f"{type(modules[path]).__name__}, not a linear layer peft's LoRA can wrap; "
                             + ("train it in full with lora.modules_to_save instead" if path in routers
                                else "target linear layers only"))
    if isinstance(lora.target_modules, tuple):
        rewritten = _leaf_names_peft_rewrites(model, {path.rsplit(".", 1)[-1] for path in matched})
        if rewritten:
            raise ValueError(f"lora.target_modules names {sorted(rewritten)}, which peft maps onto the experts of "
                             f"{type(model).__name__} (its transformers-v4 conversion); name those modules by a "
                             "regex over their paths instead")
    return matched


def _peft_list(value):
    """A LoraSpec field as peft takes it: a regex string, a list of names, or None."""
    return value if value is None or isinstance(value, str) else list(value)


def backbone_lora_config(full: LoraConfig) -> LoraConfig:
    """The same config without the expert parameters, for the master's stripped model (peft's dummy target
    where only experts or modules_to_save train: a PeftModel that adapts nothing of the backbone)."""
    kwargs = full.to_dict()
    kwargs.pop("peft_type", None)
    kwargs.pop("task_type", None)
    kwargs["target_parameters"] = None
    kwargs["target_modules"] = kwargs.get("target_modules") or DUMMY_TARGET_MODULES
    return LoraConfig(**{k: v for k, v in kwargs.items() if k in LoraConfig.__dataclass_fields__})


def fuse_expert_factors(per_expert: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(A_e [r, in], B_e [out, r]) for e in 0..E-1] -> peft's fused (A [r*E, in], B [out, r*E])."""
    lora_A = torch.cat([a for a, _ in per_expert], dim=0)
    lora_B = torch.stack([b for _, b in per_expert], dim=-1)  # [out, r, E]
    return lora_A, lora_B.reshape(lora_B.shape[0], -1)


def split_expert_factors(lora_A: torch.Tensor, lora_B: torch.Tensor, num_experts: int):
    """Inverse of `fuse_expert_factors`: [(A_e, B_e)] per expert."""
    A_ErI = lora_A.reshape(num_experts, -1, lora_A.shape[-1])
    B_OrE = lora_B.reshape(lora_B.shape[0], -1, num_experts)
    return [(A_ErI[e].clone(), B_OrE[:, :, e].clone()) for e in range(num_experts)]


def _peft_skeleton(config: PretrainedConfig, lora_config: LoraConfig):
    """The original model with `lora_config` applied, on the meta device: names and shapes, no memory.

    peft rewrites the config's `base_model_name_or_path` to the model it wraps (and warns when that
    changes it); the skeleton gets a copy, so the caller's config keeps the adapter's own base path."""
    lora_config = copy.copy(lora_config)
    lora_config.base_model_name_or_path = None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
        blocks = find_moe_blocks(skeleton)  # before peft wraps the experts
        return get_peft_model(skeleton, lora_config), blocks


def _expert_param_keys(peft_skeleton, blocks) -> dict[tuple[int, str], str]:
    """{(moe layer, "gate_up"|"down"): state-dict key prefix} of a `_peft_skeleton`."""
    layer_of = {b.experts_path: b.index for b in blocks}
    prefixes = {}
    for name, module in peft_skeleton.named_modules():
        if isinstance(module, ParamWrapper) and layer_of.get(_experts_path(name)) is not None:
            prefixes[(layer_of[_experts_path(name)], slot_name(module.parameter_name))] = name
    return prefixes


def _experts_path(peft_name: str) -> str:
    """`base_model.model.<experts path>.base_layer...` -> `<experts path>`."""
    return re.sub(r"^base_model\.model\.|(\.base_layer)+$", "", peft_name)


def _check_shapes(adapter_dir: Path, state: dict[str, torch.Tensor], peft_skeleton) -> None:
    """Every tensor of the adapter exists in this model's peft state with the same shape: an adapter
    of another model (hidden size, expert count, layers) or rank is refused before any is loaded."""
    wanted = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_skeleton).items()}
    unknown = sorted(set(state) - set(wanted))
    if unknown:
        raise ValueError(f"{adapter_dir}: adapter keys not in this model: {unknown[:3]}; use an adapter of "
                         "this model")
    for key, tensor in state.items():
        if tuple(tensor.shape) != wanted[key]:
            raise ValueError(f"{adapter_dir}: {key} has shape {list(tensor.shape)} but this model needs "
                             f"{list(wanted[key])}; use an adapter of this model")


def export_adapter(
    out_dir: str | Path,
    config: PretrainedConfig,
    lora_config: LoraConfig,
    backbone_state: dict[str, torch.Tensor],
    expert_state: dict[ExpertKey, dict[str, torch.Tensor]],
) -> Path:
    """Write a peft adapter directory for the original model; `PeftModel.from_pretrained` loads it.

    backbone_state: `get_peft_model_state_dict` of the master's peft model.
    expert_state: {(layer, expert): {"lora_A_gate_up", "lora_B_gate_up", "lora_A_down", "lora_B_down"}}.
    Raises ValueError if any expert of any MoE layer has no adapter.
    """
    skeleton, blocks = _peft_skeleton(config, lora_config)
    prefixes = _expert_param_keys(skeleton, blocks)
    num_experts = blocks[0].layout.num_experts
    missing = [(l, e) for l in {layer for layer, _ in prefixes} for e in range(num_experts)
               if (l, e) not in expert_state]
    if missing:
        raise ValueError(
            f"cannot export adapter: {len(missing)} experts have no LoRA state, e.g. {missing[:6]}; "
            "every ExpertManager must report its experts before export"
        )
    state = {k: v.detach().cpu().contiguous() for k, v in backbone_state.items()}
    for (layer, slot), prefix in prefixes.items():
        per_expert = [(expert_state[(layer, e)][f"lora_A_{slot}"], expert_state[(layer, e)][f"lora_B_{slot}"])
                      for e in range(num_experts)]
        lora_A, lora_B = fuse_expert_factors(per_expert)
        state[f"{prefix}.lora_A.weight"] = lora_A.detach().cpu().contiguous()
        state[f"{prefix}.lora_B.weight"] = lora_B.detach().cpu().contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    lora_config.save_pretrained(str(out))
    return out


def read_adapter(adapter_dir: str | Path, config: PretrainedConfig):
    """Read a peft adapter dir -> (LoraConfig, backbone_state, expert_state keyed by (layer, expert)).

    Every tensor must have the name and shape this model's peft state has (ValueError naming it)."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_FILE).is_file():
        raise ValueError(f"{adapter_dir} is not a peft adapter directory (no {ADAPTER_FILE})")
    lora_config = LoraConfig.from_pretrained(str(adapter_dir))
    state = load_file(str(adapter_dir / ADAPTER_FILE))
    skeleton, blocks = _peft_skeleton(config, lora_config)
    _check_shapes(adapter_dir, state, skeleton)
    prefixes = _expert_param_keys(skeleton, blocks)
    num_experts = blocks[0].layout.num_experts
    # every expert, with no factors where its stacks are frozen (`lora.expert_stacks`)
    expert_state: dict[ExpertKey, dict[str, torch.Tensor]] = {
        (block.index, e): {} for block in blocks for e in range(block.layout.num_experts)}
    for (layer, slot), prefix in prefixes.items():
        keys = (f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight")
        if not all(k in state for k in keys):
            raise ValueError(f"{adapter_dir}: adapter has no {slot} factors for MoE layer {layer} ({keys[0]})")
        for e, (a, b) in enumerate(split_expert_factors(state.pop(keys[0]), state.pop(keys[1]), num_experts)):
            expert_state.setdefault((layer, e), {})[f"lora_A_{slot}"] = a
            expert_state[(layer, e)][f"lora_B_{slot}"] = b
    return lora_config, state, expert_state


# The options an adapter's numbers depend on beyond its tensors' shapes (`check_adapter_matches`), by peft's names
ADAPTER_OPTIONS = {"r": "r", "lora_alpha": "alpha", "use_rslora": "use_rslora", "rank_pattern": "rank_pattern",
                   "alpha_pattern": "alpha_pattern", "modules_to_save": "modules_to_save"}


def lora_options(config: LoraConfig) -> dict:
    """`ADAPTER_OPTIONS` of a peft LoraConfig, normalised for comparing (unset or empty: None; lists sorted)."""
    def normal(value):
        return (sorted(value) or None) if isinstance(value, (list, tuple, set)) else (value or None)

    return {name: normal(getattr(config, name)) for name in ADAPTER_OPTIONS}


def check_adapter_matches(adapter: LoraConfig, job: LoraConfig, adapter_dir: str | Path) -> None:
    """An adapter trained with other LoRA options (rank, alpha, rsLoRA, patterns, modules trained in full)
    cannot continue as this job's: refuse it naming each option and the job's field."""
    have, want = lora_options(adapter), lora_options(job)
    differ = [f"{name} {have[name]!r} (lora.{ADAPTER_OPTIONS[name]}: {want[name]!r})" for name in ADAPTER_OPTIONS
              if have[name] != want[name]]
    if differ:
        raise ValueError(f"{adapter_dir}: the adapter was trained with {', '.join(differ)}; set the job's lora "
                         "options to match")


def backbone_state_of(peft_model, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """peft's adapter state of the master's model; from `state` (parameters by name) instead of the model's own
    tensors when given (a tensor-parallel master's, gathered whole)."""
    return get_peft_model_state_dict(peft_model, state_dict=state)


