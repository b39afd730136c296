"""vela-ray against plain transformers + peft on one model, in one process: the equivalence harness.

Both sides start from the same random model and the same adapter (peft's, with a random B so
every LoRA factor gets gradients from step 0), see the same micro-batches and learning rates,
and clip the global grad norm. vela-ray's side splits the experts over `num_workers` shards
under a scattered placement and moves rows through whichever transport
`make_transport(shards)` returns (in-process calls by default).

The test suite runs it on every family of the pinned transformers (tests/unit/test_every_family.py);
preflight runs it on a debug-size copy of a family outside that set (`family_check`), so a
family is trained only where vela-ray's numbers are shown equal to peft's; the GPU battery
(`scripts/gpu_exactness.py`) runs it on a GPU (`build_pair(..., device="cuda")`).

Low precision: rounding makes the two sides' updates differ, so `expert_drifts` measures by how much
against what rounding does to peft alone (`exact_reference`: peft on the same weights computed in
fp32), and `rounding_excess` says where vela-ray's updates leave that spread. Whole jobs:
`peft_losses` is plain peft over a job's very batches, learning rates and clipping.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from vela_ray.model.adapters import ADAPTER_FILE, backbone_state_of, full_lora_config, resolve_expert_lora
from vela_ray.model.experts import ExpertShard, LoraSpec
from vela_ray.model.modeling import expert_weights, experts_prototypes, find_moe_blocks
from vela_ray.model.quantized_model import QuantizationSpec, quantize_backbone, quantize_expert_params, round_trip_model
from vela_ray.model.transport import InProcessTransport
from vela_ray.training.optim import ShardTrainer, make_adamw
from vela_ray.training.schedule import OptimizerConfig, lr_at
from vela_ray.training.adapter_io import export, import_adapter
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.master import MasterModel, build_master
from vela_ray.training.step import train_step

LORA = LoraSpec(r=4, alpha=8)
OPTIM = OptimizerConfig(lr=1e-2, max_grad_norm=0.5, warmup_steps=1)
LOSS_RTOL = 1e-5  # fp32: what reordered sums over the shards' rows leave of equal math


def scattered_placement(num_layers: int, num_experts: int, num_workers: int = 3) -> torch.Tensor:
    """A placement that is neither sequential nor blocked: [L, E] -> worker."""
    return torch.tensor([[(l + 2 * e + e // 3) % num_workers for e in range(num_experts)] for l in range(num_layers)])


def micro_batches(step: int, vocab: int = 128, count: int = 2, batch: int = 2, seq: int = 12,
                  device: str | torch.device = "cpu"):
    """The step's micro-batches: random token ids in [3, vocab), labels = inputs (drawn on the CPU, so
    every device sees the same ones)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (batch, seq), generator=g).to(device)
        out.append({"input_ids": ids, "labels": ids})
    return out


@dataclass
class Pair:
    reference: nn.Module  # the peft model
    ref_optimizer: torch.optim.Optimizer
    master: MasterModel | None  # None: a peft-only pair (a reference run in another precision)
    workers: ExpertWorkers | None
    adapter_dir: str  # the adapter both sides start from (peft's save_pretrained before any step)
    optim: OptimizerConfig = OPTIM  # both sides' AdamW, schedule and clipping
    trainers: list[ShardTrainer] = field(default_factory=list)  # the in-process workers build_pair made
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # both sides' (and the batches')


def build_pair(make_model: Callable[[], nn.Module], make_transport: Callable | None = None,
               dtype: torch.dtype = torch.float32, num_workers: int = 3,
               optim: OptimizerConfig = OPTIM, lora: LoraSpec = LORA, device: str | torch.device = "cpu",
               overlap_shared_experts: bool = True, quantization: QuantizationSpec | None = None) -> Pair:
    """The peft reference and vela-ray's master + shards, both from `make_model()` (called twice: it
    must return the same weights each time), with one shared random-B adapter. `lora`: the LoRA options
    both sides train with (peft's `LoraConfig` from `full_lora_config`, the same spec for vela-ray).
    `device`: where both sides compute: peft's model, vela-ray's master and its in-process shards (the
    one-GPU configuration, `cluster.workers_on_master = num_workers`). `overlap_shared_experts`: vela-ray's
    blocks compute their shared experts while their rows are away (`training.overlap.shared_experts`).
    `quantization`: vela-ray holds the frozen weights it names quantized (`model.quantization`), and peft trains
    the same model with those weights dequantized (`quantization.round_trip_model`)."""
    device = torch.device(device)
    reference = make_model().to(dtype)
    if quantization is not None:
        round_trip_model(reference, quantization)
    cfg = full_lora_config(reference, lora)
    cfg.init_lora_weights = False  # random A and B: every factor gets gradients at step 0
    torch.manual_seed(1)
    reference = get_peft_model(reference, cfg)
    adapter_dir = tempfile.mkdtemp(prefix="vela-eq-")
    reference.save_pretrained(adapter_dir)

    model = make_model().to(dtype)
    blocks = find_moe_blocks(model)
    table = scattered_placement(len(blocks), blocks[0].layout.num_experts, num_workers)
    weights = expert_weights(blocks)
    resolved = resolve_expert_lora(model, lora)
    prototypes = experts_prototypes(model.config)
    if quantization is not None and quantization.experts:
        weights = {k: quantize_expert_params(w, prototypes[k[0]], quantization) for k, w in weights.items()}
    shards = [
        ExpertShard.from_weights({k: w for k, w in weights.items() if table[k] == n}, resolved, prototypes,
                                 dtype=dtype)
        for n in range(num_workers)
    ]
    shards = [shard.to(device) for shard in shards]
    transport = (make_transport or InProcessTransport)(shards)
    master = build_master(model, table, transport, lora, optim, overlap_shared_experts=overlap_shared_experts)
    if quantization is not None and quantization.backbone:
        quantize_backbone(master.peft_model, quantization)  # as a master does after reading its backbone
    master.peft_model.to(device)  # as the runner does: after the brokers replaced the experts
    trainers = [ShardTrainer(s, optim) for s in shards]
    workers = ExpertWorkers.in_process(trainers)
    import_adapter(master, workers, adapter_dir)
    reference.to(device)
    ref_optimizer = make_adamw([p for p in reference.parameters() if p.requires_grad], optim)
    return Pair(reference, ref_optimizer, master, workers, adapter_dir, optim, trainers, device)


def reference_step(pair: Pair, batches, lr: float) -> float:
    """One optimizer step of plain peft: the loss summed over micro-batches, global-norm clip, AdamW."""
    model = pair.reference
    model.train()
    total = 0.0
    for batch in batches:
        loss = model(**batch).loss / len(batches)
        loss.backward()
        total += float(loss.detach())
    params = [p for p in model.parameters() if p.requires_grad]
    if pair.optim.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, pair.optim.max_grad_norm)
    for group in pair.ref_optimizer.param_groups:
        group["lr"] = lr
    pair.ref_optimizer.step()
    pair.ref_optimizer.zero_grad()
    return total


def run_both(pair: Pair, steps: int = 5, vocab: int = 128, count: int = 2, in_flight: int = 1
             ) -> tuple[list[float], list[float]]:
    """`steps` steps of `count` micro-batches on both sides, vela-ray's with `in_flight` of them at once
    (`training.overlap`); (peft's losses, vela-ray's losses)."""
    ref_losses, vela_losses = [], []
    for step in range(steps):
        batches = micro_batches(step, vocab, count, device=pair.device)
        lr = lr_at(pair.optim, step, steps)
        torch.manual_seed(step)  # both sides draw the same numbers (PhiMoE's router samples in training)
        ref_losses.append(reference_step(pair, batches, lr))
        torch.manual_seed(step)
        vela_losses.append(train_step(pair.master, pair.workers, batches, lr, pair.optim.max_grad_norm,
                                      in_flight=in_flight))
    return ref_losses, vela_losses


def run_reference(pair: Pair, steps: int, vocab: int = 128) -> list[float]:
    """The peft side of `run_both` alone: the same micro-batches, learning rates and seeds."""
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        losses.append(reference_step(pair, micro_batches(step, vocab, device=pair.device),
                                     lr_at(pair.optim, step, steps)))
    return losses


def reference_adapter_state(pair: Pair) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(pair.reference).items()}


def start_adapter(pair: Pair) -> dict[str, torch.Tensor]:
    """The adapter both sides started from, by peft key."""
    return load_file(f"{pair.adapter_dir}/{ADAPTER_FILE}")


def exported_adapter(pair: Pair) -> dict[str, torch.Tensor]:
    """vela-ray's adapter now, exported as peft's (`vela_ray.training.adapter_io.export`), by peft key."""
    out = tempfile.mkdtemp(prefix="vela-eq-export-")
    export(pair.master, pair.workers, out)
    return load_file(f"{out}/{ADAPTER_FILE}")


def reloaded_export(pair: Pair, make_model: Callable[[], nn.Module], out_dir) -> PeftModel:
    """vela-ray's adapter exported to `out_dir` and loaded by plain peft into `make_model()`."""
    export(pair.master, pair.workers, out_dir)
    return PeftModel.from_pretrained(make_model(), out_dir)


def held_out_loss(model: nn.Module, vocab: int = 128) -> torch.Tensor:
    """The eval-mode loss of `model` on a batch no training step saw."""
    batch = micro_batches(99, vocab)[0]
    with torch.no_grad():
        return model.eval()(**batch).loss


# -- low precision: vela-ray's updates against the spread rounding gives peft's own ---------------------

def exact_reference(pair: Pair, make_model: Callable[[], nn.Module], dtype: torch.dtype) -> Pair:
    """peft on `pair`'s model in exact arithmetic: the same `dtype`-valued weights (`make_model()`) and start
    adapter, computed in fp32 on `pair.device` (no master or workers). `run_reference` it as far as
    `run_both` ran `pair` to see what rounding in `dtype` alone does to peft's updates."""
    model = make_model().to(dtype).float()
    reference = PeftModel.from_pretrained(model, pair.adapter_dir, is_trainable=True).to(pair.device)
    optimizer = make_adamw([p for p in reference.parameters() if p.requires_grad], pair.optim)
    return Pair(reference, optimizer, None, None, pair.adapter_dir, pair.optim, device=pair.device)


def expert_keys(pair: Pair) -> list[str]:
    """peft keys of the fused expert factors: the adapter's keys the master's backbone lacks."""
    backbone = backbone_state_of(pair.master.peft_model)
    return sorted(k for k in start_adapter(pair) if k not in backbone)


@dataclass(frozen=True)
class Drifts:
    """Per fused expert LoRA tensor (peft key), after the same steps: how far one side's update is from
    another's (`factor_drift`). `exact`: peft on the same weights in exact arithmetic (`exact_reference`)."""

    vela_vs_peft: dict[str, float]
    peft_vs_exact: dict[str, float]
    vela_vs_exact: dict[str, float]

    @property
    def rounding(self) -> float:
        """What rounding alone does to peft's own update: its largest drift from the exact run."""
        return max(self.peft_vs_exact.values())

    def summary(self) -> dict[str, float]:
        """The largest drift of each comparison, as a results file records it."""
        return {"peft_vs_exact": self.rounding, "vela_vs_peft": max(self.vela_vs_peft.values()),
                "vela_vs_exact": max(self.vela_vs_exact.values())}


def expert_drifts(pair: Pair, make_model: Callable[[], nn.Module], dtype: torch.dtype, steps: int) -> Drifts:
    """`run_both(pair, steps)` and peft's exact run of the same steps; how the expert updates compare."""
    run_both(pair, steps)
    exact = exact_reference(pair, make_model, dtype)
    run_reference(exact, steps)
    keys, start = expert_keys(pair), start_adapter(pair)
    vela, peft, truth = exported_adapter(pair), reference_adapter_state(pair), reference_adapter_state(exact)
    return Drifts(factor_drift(vela, peft, start, keys), factor_drift(peft, truth, start, keys),
                  factor_drift(vela, truth, start, keys))


def factor_drift(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                 start: dict[str, torch.Tensor], keys: list[str]) -> dict[str, float]:
    """Per key, how far `state`'s change from `start` is from `reference`'s: |d_state - d_ref| / |d_ref|
    (L2 over the tensor; 0: the same update, ~1: unrelated or no update)."""
    drift = {}
    for key in keys:
        moved_ref = reference[key].float().cpu() - start[key].float()
        moved = state[key].float().cpu() - start[key].float()
        drift[key] = float((moved - moved_ref).norm() / moved_ref.norm())
    return drift


def rounding_excess(drifts: Drifts) -> list[str]:
    """Where vela-ray's expert updates leave what rounding explains (empty: within it). Rounding is
    `drifts.rounding`: two runs each off the exact one by that much differ by up to sqrt(2) times it, and
    vela-ray's own drift from the exact run stays within 25% of peft's. Above 0.5 the runs no longer follow
    the exact one, and the bound says nothing."""
    eps = drifts.rounding
    if eps >= 0.5:
        return [f"peft's own run drifted {eps:.2f} from exact arithmetic"]
    problems = [f"{key}: vela-ray's update is {drift:.3f} off peft's (rounding alone: {eps:.3f})"
                for key, drift in drifts.vela_vs_peft.items() if drift > math.sqrt(2) * eps]
    if max(drifts.vela_vs_exact.values()) > 1.25 * eps:
        problems.append(f"vela-ray is {max(drifts.vela_vs_exact.values()):.3f} from exact, peft {eps:.3f}")
    return problems


# -- whole jobs ---------------------------------------------------------------------------------------------

def peft_losses(model_dir: str, adapter_dir: str, step_batches: Sequence[list[dict[str, torch.Tensor]]],
                optim: OptimizerConfig, device: str | torch.device = "cpu", step_seeds: Sequence[int] | None = None,
                lora_dropout: float = 0.0, quantization: QuantizationSpec | None = None,
                loss_for: Callable[[nn.Module], Callable[[dict], torch.Tensor]] | None = None,
                ) -> tuple[list[float], dict]:
    """Plain transformers + peft from `model_dir` and the start adapter `adapter_dir`, a step per entry of
    `step_batches` (its micro-batches, the loss of each divided by their number), global-norm clipping,
    `optim`'s AdamW and schedule: the reference a whole job is held to. (losses, the adapter's state after).
    `step_seeds`: torch's seed at each step's start (the job's `step.step_seed`), so `lora_dropout` (the job's,
    replacing the start adapter's) draws the job's masks. `quantization`: the job's (`model.quantization`): the
    weights it names are dequantized from their format (`quantization.round_trip_model`). `loss_for(model)`: the
    loss of a micro-batch another library computes (TRL's DPO, for preference objectives); default the model's own."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, use_cache=False)  # as vela-ray's master: packed rows
    if quantization is not None:
        round_trip_model(base, quantization)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).to(device)
    if lora_dropout:
        for module in model.modules():
            if isinstance(getattr(module, "lora_dropout", None), nn.ModuleDict):
                for name in module.lora_dropout:
                    module.lora_dropout[name] = nn.Dropout(lora_dropout)
    loss_of = (lambda micro: model(**micro).loss) if loss_for is None else loss_for(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)
    model.train()
    losses = []
    for step, batches in enumerate(step_batches):
        if step_seeds is not None:
            torch.manual_seed(step_seeds[step])
        total = 0.0
        for micro in batches:
            loss = loss_of({k: v.to(device) for k, v in micro.items()}) / len(batches)
            loss.backward()
            total += float(loss.detach())
        if optim.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(optim, step, len(step_batches))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, get_peft_model_state_dict(model)
