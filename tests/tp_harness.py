"""Harness of tests/unit/test_tensor_parallel.py: gloo process groups on 127.0.0.1 spawned with
torch.multiprocessing, each rank running `vela_ray.model.tensor_parallel` on the same debug model, against
single-process transformers + peft run here. `in_threads` runs the ranks as threads of this process instead, over
a gloo group torch.distributed does not know (`collective.make_group`'s).

One spawn per TP size runs every family (starting processes and importing transformers costs more than the
debug models' steps on a 2-core machine); rank 0 writes what the tests compare to a file.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.ray.head import free_port
from vela_ray.model.adapters import full_lora_config
from vela_ray.model.families import debug_model
from vela_ray.model.tensor_parallel import (TensorParallelPlan, agree_on_rng, clip_grad_norm_, decoder_layers,
                                            gather_lora_state_dict, load_lora_state_dict, parallelize_backbone)
from vela_ray.training.equivalence import LORA, OPTIM, micro_batches
from vela_ray.training.optim import make_adamw
from vela_ray.training.schedule import OptimizerConfig, lr_at

logger = logging.getLogger(__name__)

# Debug models with heads (and KV heads) divisible by 4. Qwen3-MoE's first layer is a dense MLP so that a
# LoRA-adapted colwise/rowwise dense MLP is exercised too (DeepSeek's dense MLP and shared experts are not adapted:
# `linear_targets` leaves their names to peft's expert rewriting).
OVERRIDES: dict[str, dict[str, Any]] = {
    "mixtral": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4),
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, mlp_only_layers=[0]),
    "deepseek_v3": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=8),
    # beyond the three: q/k/v biases (sharded with their columns) and a LoRA-adapted shared expert
    "qwen2_moe": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4),
}
FAMILIES = sorted(OVERRIDES)
# seeding and drawing a model's weights use torch's one host generator: ranks that are threads of one process build
# their models one at a time (`in_threads`), so each draws what a process of its own would
_BUILDING = threading.Lock()


def build_peft(family: str, lora: bool = True, dropout: float = 0.0) -> nn.Module:
    """`family`'s seeded debug model with the random-B adapter every rank and the reference share (or none);
    with `dropout`, peft's LoRA dropout on the backbone's adapters (peft refuses it on the experts')."""
    with _BUILDING:
        model = debug_model(family, seed=0, **OVERRIDES[family])
        if not lora:
            return model
        cfg = full_lora_config(model, LORA)
        cfg.init_lora_weights = False  # random A and B: every factor gets gradients at step 0
        if dropout:
            cfg.lora_dropout, cfg.target_parameters = dropout, None
        torch.manual_seed(1)
        return get_peft_model(model, cfg)


# AdamW's first step moves every element by lr * g / (|g| + eps): with the default eps (1e-8) that is ~lr * sign(g)
# for all but the tiniest gradients, so an element whose gradient is ~1e-5 of its tensor's largest (rounding-level
# in a sum over 10^2 terms) lands up to ~lr * 1e-2 away in any two runs that sum in another order -- TP or not.
# The adapter is compared element by element after a step with a larger eps, where the update is a smooth function
# of the gradient (error <= lr * |grad error| / eps); the default optimizer is held to losses and gradients, and
# its adapter to reproducing peft's held-out loss.
SMOOTH_OPTIM = OPTIM.model_copy(update={"eps": 1e-3})


def one_step(model: nn.Module, clip: Callable[[], Any], optim: OptimizerConfig = OPTIM) -> dict[str, Any]:
    """The equivalence harness's reference step (loss over two micro-batches, global-norm clip, AdamW at
    step 0's lr), then the loss of step 1's batches: {"loss0", "loss1", "grads" (by parameter name), "norm" (the
    global grad norm `clip` returned)}."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_adamw(params, optim)
    batches = micro_batches(0)
    loss0 = 0.0
    for batch in batches:
        loss = model(**batch).loss / len(batches)
        loss.backward()
        loss0 += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    norm = float(clip())
    for group in optimizer.param_groups:
        group["lr"] = lr_at(optim, 0, 2)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        loss1 = sum(float(model(**b).loss) for b in micro_batches(1)) / 2
    return {"loss0": loss0, "loss1": loss1, "grads": grads, "norm": norm}


def held_out_loss(model: nn.Module) -> float:
    """The eval-mode loss on a batch no step saw."""
    with torch.no_grad():
        return float(model.eval()(**micro_batches(99)[0]).loss)


def reference(family: str) -> dict[str, Any]:
    """Single-process transformers + peft: `one_step` with the default optimizer (and peft's held-out loss
    after it), and the adapter after `one_step` with `SMOOTH_OPTIM`."""
    model = build_peft(family)
    params = [p for p in model.parameters() if p.requires_grad]
    out = one_step(model, lambda: torch.nn.utils.clip_grad_norm_(params, OPTIM.max_grad_norm))
    out["held_out"] = held_out_loss(model)
    smooth = build_peft(family)
    params = [p for p in smooth.parameters() if p.requires_grad]
    one_step(smooth, lambda: torch.nn.utils.clip_grad_norm_(params, SMOOTH_OPTIM.max_grad_norm), SMOOTH_OPTIM)
    out["adapter"] = {k: v.detach().clone() for k, v in get_peft_model_state_dict(smooth).items()}
    return out


def reloaded_held_out_loss(family: str, adapter: dict[str, torch.Tensor]) -> float:
    """peft's held-out loss with `adapter` (a gathered TP adapter) loaded into the plain model."""
    model = build_peft(family)
    result = set_peft_model_state_dict(model, adapter)
    assert not result.unexpected_keys, result.unexpected_keys
    return held_out_loss(model)


def _gathered_grads(grads: dict[str, torch.Tensor], plan: TensorParallelPlan) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(grads):
        g = grads[name]
        if name in plan.sharded:
            parts = [torch.empty_like(g) for _ in range(plan.size)]
            dist.all_gather(parts, g.contiguous(), group=plan.group)
            g = torch.cat(parts, plan.sharded[name])
        out[name] = g
    return out


def _replica_spread(model: nn.Module, grads: dict[str, torch.Tensor], plan: TensorParallelPlan) -> float:
    """Largest |difference| between ranks of any replicated trainable parameter or its step-0 gradient."""
    spread = 0.0
    tensors = [p.detach() for n, p in model.named_parameters() if p.requires_grad and n not in plan.sharded]
    tensors += [g for n, g in sorted(grads.items()) if n not in plan.sharded]
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(plan.size)]
        dist.all_gather(parts, t.contiguous(), group=plan.group)
        spread = max(spread, max(float((p - parts[0]).abs().max()) for p in parts))
    return spread


def tp_run(family: str, group: dist.ProcessGroup) -> dict[str, Any]:
    """`one_step` of `family` sharded over `group` with the default optimizer (gathered grads and adapter,
    replica spread, styles and vocab-parallel modules), the adapter gathered after a `SMOOTH_OPTIM` step, and that adapter loaded into a fresh
    sharded model and gathered again ("roundtrip")."""
    model = build_peft(family)
    plan = parallelize_backbone(model, group)
    out = one_step(model, lambda: clip_grad_norm_(model, plan, OPTIM.max_grad_norm))
    out["grads"] = _gathered_grads(out["grads"], plan)
    out["default_adapter"] = gather_lora_state_dict(model, plan)
    out["spread"] = _replica_spread(model, out["grads"], plan)
    out["styles"] = dict(plan.styles)
    out["vocab_parallel"] = list(plan.vocab_parallel)

    smooth = build_peft(family)
    plan = parallelize_backbone(smooth, group)
    one_step(smooth, lambda: clip_grad_norm_(smooth, plan, SMOOTH_OPTIM.max_grad_norm), SMOOTH_OPTIM)
    out["adapter"] = gather_lora_state_dict(smooth, plan)

    fresh = build_peft(family)
    plan = parallelize_backbone(fresh, group)
    load_lora_state_dict(fresh, out["adapter"], plan)
    out["roundtrip"] = gather_lora_state_dict(fresh, plan)
    return out


DROPOUT, DROPOUT_SEED = 0.3, 7


def dropout_step(model: nn.Module) -> dict[str, Any]:
    """A training forward and backward of step 0's first micro-batch, from torch's RNG as the caller left it:
    {"loss", "grads" (by parameter name), "rng" (torch's RNG state after: how much the dropouts drew)}."""
    model.train()
    loss = model(**micro_batches(0)[0]).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": float(loss.detach()), "grads": grads, "rng": torch.get_rng_state()}


def dropout_reference(family: str) -> dict[str, Any]:
    """`dropout_step` of single-process peft with LoRA dropout, from seed DROPOUT_SEED."""
    model = build_peft(family, dropout=DROPOUT)
    torch.manual_seed(DROPOUT_SEED)
    return dropout_step(model)


def dropout_run(family: str, group: dist.ProcessGroup) -> dict[str, Any]:
    """`dropout_step` sharded over `group`, each rank starting from an RNG state of its own (rank 0 from
    DROPOUT_SEED) until `agree_on_rng` gives them all rank 0's: gathered grads and the ranks' RNG states after."""
    model = build_peft(family, dropout=DROPOUT)
    plan = parallelize_backbone(model, group)
    torch.manual_seed(DROPOUT_SEED if plan.rank == 0 else DROPOUT_SEED + 1000 * plan.rank)
    agree_on_rng(plan)
    out = dropout_step(model)
    out["grads"] = _gathered_grads(out["grads"], plan)
    states = [torch.empty_like(out["rng"]) for _ in range(plan.size)]
    dist.all_gather(states, out["rng"], group=plan.group)
    out["rng_of_ranks"] = states
    out["draws_dropout"] = plan.draws_dropout
    return out


def mesh_run(family: str, mesh) -> dict[str, Any]:
    """Step 0 of `family` on a (dp, tp) mesh of masters: TP over "tp", the frozen backbone FSDP2-sharded over "dp"
    (`shard_frozen`), each data-parallel master taking its share of every micro-batch (`ReplicaShare`) and the
    LoRA gradients summed over "dp" (`ProcessGroupReplicas`), as the runtime's masters do. {"loss0": the summed
    loss, "grads": gathered over "tp", "frozen_fraction": what FSDP2 left of this TP rank's frozen weights of a
    decoder layer}."""
    from vela_ray.model.tensor_parallel import shard_frozen
    from vela_ray.training.replicas import ProcessGroupReplicas, ReplicaShare

    model = build_peft(family)
    layer = decoder_layers(model)[-1]
    plan = parallelize_backbone(model, mesh["tp"])
    frozen = sum(p.numel() for p in layer.parameters() if not p.requires_grad)  # this TP rank's
    shard_frozen(model, mesh["dp"])
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in layer.parameters()
                if not p.requires_grad)
    dp = ProcessGroupReplicas(mesh["dp"].get_group())
    share = ReplicaShare(mesh["dp"].get_local_rank(), mesh["dp"].size())
    model.train()
    batches = micro_batches(0)
    loss0 = 0.0
    for batch in batches:
        loss = share.loss(model, batch) / len(batches)
        loss.backward()
        loss0 += float(loss.detach())
    params = [p for p in model.parameters() if p.requires_grad]
    dp.sync_grads(params)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"loss0": dp.sum(loss0), "grads": _gathered_grads(grads, plan), "frozen_fraction": local / frozen}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives dispatched while active (plain `torch.distributed` ops, which `_EnterRegion`/
    `_ExitRegion` call, and the functional ones DTensor's redistributes call), by op and by `where`: the decoder
    layer whose forward or backward is running ("layers.<i>"), else "outside" (embedding, LM head, loss).

    CommDebugMode counts the same ops, but its module tracker fails on transformers' decoder layers (an
    IndexError in its forward hook), and it cannot say which layer's backward a collective belongs to."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops, funcol_native, funcol_py

        self.ops = {*c10d_collective_ops, funcol_native.all_reduce, funcol_native.all_gather_into_tensor,
                    funcol_native.reduce_scatter_tensor, funcol_native.all_to_all_single, funcol_py.all_reduce,
                    funcol_py.all_gather_into_tensor, funcol_py.reduce_scatter_tensor}
        self.where = "outside"
        self.counts: dict[tuple[str, str], int] = {}
        self.elements = 0  # numel of every collective's input, summed


    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = getattr(func, "_overloadpacket", func)
        if packet in self.ops:
            key = (self.where, packet.__name__.rstrip("_").lstrip("_"))
            self.counts[key] = self.counts.get(key, 0) + 1
            first = args[0] if args else None
            self.elements += sum(t.numel() for t in (first if isinstance(first, (list, tuple)) else [first])
                                 if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))

    def track(self, layers: nn.ModuleList) -> list:
        """Hooks setting `where` around each decoder layer's forward and backward; returns their handles."""
        handles = []
        for i, layer in enumerate(layers):
            inside = functools.partial(setattr, self, "where", f"layers.{i}")
            outside = functools.partial(setattr, self, "where", "outside")
            handles += [layer.register_forward_pre_hook(lambda *_, f=inside: f()),
                        layer.register_forward_hook(lambda *_, f=outside: f()),
                        layer.register_full_backward_pre_hook(lambda *_, f=inside: f()),
                        layer.register_full_backward_hook(lambda *_, f=outside: f())]
        return handles


def comm_counts(family: str, group: dist.ProcessGroup, lora: bool) -> dict[str, Any]:
    """Collectives of one forward and one backward of `family` sharded over `group`, with or without its
    adapter: {"forward"/"backward": {(where, op): count}}. The input embeddings require grad so that backward
    crosses every layer either way (without LoRA nothing else would)."""
    model = build_peft(family, lora=lora)
    if not lora:
        model.requires_grad_(False)  # the frozen backbone LoRA trains on: base TP alone
    plan = parallelize_backbone(model, group)
    batch = micro_batches(0)[0]
    base = model.get_base_model() if lora else model
    with torch.no_grad():
        embeds = base.get_input_embeddings()(batch["input_ids"])
    embeds = embeds.detach().requires_grad_()
    model.train()
    fwd, bwd = CollectiveCounter(), CollectiveCounter()
    for counter in (fwd, bwd):
        counter.track(base.model.layers)
    with fwd:
        loss = model(inputs_embeds=embeds, labels=batch["labels"]).loss
    with bwd:
        loss.backward()
    replicated = sum(model.get_submodule(path).get_parameter(name).numel()
                     for path, names in plan.replicated.items() for name in names)
    return {"forward": fwd.counts, "backward": bwd.counts, "forward_elements": fwd.elements,
            "backward_elements": bwd.elements, "replicated_elements": replicated}


def shard_loading(model_dir: str, dp: int, tp: int, node: dist.ProcessGroup | None,
                  dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A runtime rank of a `dp` x `tp` mesh of master processes (this process's default group, tp fastest) built two
    ways from the checkpoint in `model_dir`: whole then sharded (`build_master_replica` + `shard_master`) and by
    `build_master_rank`, which reads each tensor once per `node` group (None: this rank alone reads its shards).
    {"mismatched": names whose tensors differ, "read": bytes the second read (`loading.BACKBONE_READS`, the
    benchmark's counter), "received", "backbone": bytes of the whole backbone, "staged": the most host bytes its
    `read_backbone` held beyond the model by its own account (`ReadStats.staged_bytes`), "allocated": the most
    torch allocated meanwhile by the profiler's (`allocation_peak`), "chunk": its chunk size}."""
    from torch.distributed.device_mesh import init_device_mesh

    from vela_ray.model import sharded_loading
    from vela_ray.model.loading import BACKBONE_READS, meta_model
    from vela_ray.model.modeling import find_moe_blocks
    from vela_ray.model.sharded_loading import backbone_specs
    from vela_ray.model.transport import InProcessTransport
    from vela_ray.training.master import MasterSpec, build_master_rank, build_master_replica, shard_master

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))["tp"] if tp > 1 else None
    spec = MasterSpec(model_dir=Path(model_dir), dtype=dtype, lora=LORA, optim=OPTIM, seed=3)
    blocks = find_moe_blocks(meta_model(model_dir))
    table = torch.zeros(len(blocks), blocks[0].layout.num_experts, dtype=torch.long)
    whole = build_master_replica(spec, table, InProcessTransport([object()]))
    if mesh is not None:
        shard_master(whole, mesh)
    before, peaks, read_backbone = BACKBONE_READS.bytes, [], sharded_loading.read_backbone

    def profiled(*args, **kwargs):
        stats, peak = allocation_peak(lambda: read_backbone(*args, **kwargs))
        peaks.append(peak)
        return stats

    sharded_loading.read_backbone = profiled  # what build_master_rank calls
    try:
        lean, stats = build_master_rank(spec, table, InProcessTransport([object()]), mesh, node=node)
    finally:
        sharded_loading.read_backbone = read_backbone
    read = BACKBONE_READS.bytes - before
    want = whole.peft_model.state_dict()
    got = lean.peft_model.state_dict()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    mismatched = [k for k in want if want[k].device.type != "meta" and not torch.equal(local(want[k]), local(got[k]))]
    backbone = sum(int(torch.Size(s.shape).numel()) * 4 for s in backbone_specs(model_dir, lambda name: None))
    return {"mismatched": mismatched, "read": read, "received": stats.bytes_received, "backbone": backbone,
            "staged": stats.staged_bytes, "allocated": peaks[0], "chunk": sharded_loading.chunk_bytes(backbone)}


def allocation_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn(), the most host bytes torch's allocator held meanwhile above any earlier level within the call), from
    the profiler's memory events: what a load allocates, whatever it frees around it. It sees torch's allocations
    only (not, say, safetensors' own buffers)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    level = low = peak = 0
    for _, nbytes in events:
        level += nbytes
        low = min(low, level)
        peak = max(peak, level - low)
    return out, peak


def _worker(rank: int, world: int, port: int, job: str, families: list[str], out: str) -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        results: dict[str, Any] = {}
        for family in families:
            if job == "step":
                results[family] = tp_run(family, group)
            elif job == "dropout":
                results[family] = dropout_run(family, group)
            elif job == "mesh":  # 4 ranks: 2 data-parallel masters of 2 TP ranks
                from torch.distributed.device_mesh import init_device_mesh

                results[family] = mesh_run(family, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
            elif job.startswith("load"):  # "load:DPxTP[:node]"; `family` is a checkpoint directory
                parts = job.split(":")  # "load:DPxTP[:node][:DTYPE]"
                dp, tp = map(int, parts[1].split("x"))
                node = dist.new_group(backend="gloo") if "node" in parts else None  # one node: all ranks
                dtype = getattr(torch, parts[-1]) if parts[-1] not in ("node", parts[1]) else torch.float32
                results[family] = {rank: shard_loading(family, dp, tp, node, dtype)}
            else:
                results[family] = {"lora": comm_counts(family, group, True),
                                   "plain": comm_counts(family, group, False)}
        if job.startswith("load"):  # every rank's own figures
            torch.save(results, f"{out}.{rank}")
        elif rank == 0:
            torch.save(results, out)
    except Exception:
        Path(f"{out}.error{rank}").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn(size: int, job: str = "step", families: list[str] | None = None) -> dict[str, Any]:
    """Run `job` ("step": `tp_run`, "dropout": `dropout_run`, "comm": `comm_counts`, "mesh": `mesh_run` on 4 ranks;
    "load:DPxTP[:node][:DTYPE]": `shard_loading` on a DP x TP mesh, with every rank in one node group or each alone,
    in DTYPE (float32), `families` then being checkpoint directories, and every rank's results) on `size` gloo
    ranks; rank 0's results by family."""
    families = families or FAMILIES
    # a forked rank would inherit the parent's default group and fail to create its own
    assert not dist.is_initialized(), "a test left a torch.distributed process group initialized in this process"
    out = os.path.join(tempfile.mkdtemp(prefix="vela-tp-"), "results.pt")
    try:
        # fork: the children inherit the imported torch/transformers/peft (a spawned child re-imports them, ~6 s
        # of CPU each, which dominated on 2 cores); no process group exists in the parent to be copied.
        mp.start_processes(_worker, args=(size, free_port(), job, families, out), nprocs=size, join=True,
                           start_method="fork")
    except Exception as exc:
        errors = sorted(Path(out).parent.glob("results.pt.error*"))
        raise RuntimeError(errors[0].read_text() if errors else str(exc)) from exc
    if job.startswith("load"):
        return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(size)]
    return torch.load(out, weights_only=False)


def in_threads(size: int, run: Callable[[dist.ProcessGroup], Any]) -> list[Any]:
    """`run(group)` on `size` threads of this process, each a rank of a gloo group that torch.distributed does not
    know (`collective.make_group`, over one in-memory store): what every rank returned, in rank order."""
    from vela_ray.model.collective import make_group

    store = dist.HashStore()
    results: list[Any] = [None] * size
    errors: list[str] = []

    def rank(r: int) -> None:
        try:
            results[r] = run(make_group(store, r, size, timeout_s=120))
        except BaseException:  # noqa: BLE001  # reported below; the other ranks time out on their collectives
            errors.append(f"rank {r}: {traceback.format_exc()}")

    threads = [threading.Thread(target=rank, args=(r,), name=f"tp-rank-{r}") for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results
