"""Benchmark: LoRA fine-tuning of a model bigger than the GPU, on one GPU, four ways side by side (issues 18, 50).

    peft_offload  transformers + peft with accelerate's CPU offload: `from_pretrained(device_map="auto",
                  max_memory={0: --gpu-memory, "cpu": ...})`, LoRA on attention and on the experts (peft's
                  `target_parameters`, as `vela_ray.model.adapters.full_lora_config` writes it), AdamW:
                  what a user tries first
    vela_tiers    vela-ray, first order: the backbone (attention, norms, embeddings, its LoRA and AdamW) on
                  the GPU, one in-process ExpertManager on the master's process with APTMoE's tiers
                  (`expert_tiers`): frozen expert weights in pinned host memory, a bounded device
                  cache of `--cache-experts` experts, each expert of a request computed on the CPU or the GPU
                  as Eq. 1 decides (`vela_ray.training.tiered`)
    vela_zo       the same placement, `training.method: zo` (MeZO's ZO-SGD, `vela_ray.training.zo`): two
                  forwards per step, no backward (ZO-Offloading's setting)
    vela_streamed vela_tiers with the backbone streamed too (`masters.streaming`, `vela_ray.model.streaming`):
                  every decoder layer's frozen attention, norms and gate in pinned host memory, uploaded into
                  `--buffer-blocks` reusable GPU slots as the layer runs, forward and again backward; the GPU
                  keeps LoRA, the embedding and the head. The master is built in host memory (never on the GPU
                  whole): a model too big for the GPU with nothing on it but the slots and the expert cache

Model: Mixtral-8x7B's dimensions (mistralai/Mixtral-8x7B-v0.1's config.json: 32 layers, 8 experts top-2,
hidden 4096, expert intermediate 14336, 32 heads / 8 KV heads, vocab 32000) with random weights, bf16;
one micro-batch of `--batch` x `--seq` = 4 x 512 tokens; LoRA r=8 alpha=16. Reported per setup: tokens/s
(median step over `--steps` after `--warmup`), peak GPU memory of the steps (allocated, after the build)
next to the budget, peak host RSS (sampled every 20 ms, build included), and for the vela setups the tiers'
counters: rows and experts per tier per step, uploads and their bytes per step, and the measured per-row
CPU and GPU seconds and upload rate that Eq. 1 weighs (on 16 CPU cores the CPU's per-row time is what says
whether CPU experts are slow). Then the ratios to peft_offload (the issue's goal: vela_tiers >= 3x) beside
the speedups APTMoE and ZO-Offloading report (`PAPERS`).

Sizes (bf16; GB = 1e9 bytes). One expert: 3 x 4096 x 14336 = 176.2M parameters = 352 MB; a layer's 8
experts 2.82 GB; a layer's attention 42M parameters = 84 MB; embeddings + lm_head 0.52 GB. So
`--layers` L weighs 2.90 L + 0.52 GB: 32 layers 93.4 GB, 16 layers 46.9 GB, 8 layers 23.7 GB.
The GPU machine this is meant for: one H100 (80 GB, 78 GiB usable) or H200 (141 GB), 16 CPU cores,
128 GiB RAM, 64 GiB disk.
  - peft_offload reads its checkpoint from disk: at 32 layers 93 GB do not fit a 64 GiB disk, so with
    `--peft-load auto` (the default) it builds the model in host memory instead and offloads it with
    accelerate's `infer_auto_device_map` + `dispatch_model` (what `from_pretrained(device_map="auto")`
    calls once it has read the files: the same hooks, the same placement); the result says which
    (`load`). `auto` writes the checkpoint where `--offload-dir` has its size + 2 GiB free: on that
    machine about 16-19 layers, after the environment's own files.
  - In training, accelerate's offload does not keep the GPU within `max_memory`: a layer's weights are
    uploaded for its forward and autograd keeps them (saved for the backward) until the backward, so
    the GPU ends up holding every layer at once. Expected peak: the whole model plus activations, i.e.
    out of GPU memory at 32 layers on an H100 (reported as such; the other setups go on); on an H200
    it should fit. `--layers 16` (47 GB) runs all three on an H100.
  - peft cannot train through accelerate's offload as it comes: it creates the LoRA factors of offloaded
    modules on the meta device, and its `ParamWrapper` (LoRA on the experts' weight stacks) reads the
    weights before accelerate's hook loads them. `offload_fixups` does the least that makes it train
    (factors made on the execution device, the experts' hook moved onto peft's wrapper); the result
    counts both. Without them this setup fails at its first step.
  - vela_tiers / vela_zo hold the experts in pinned host memory: 2.82 GB a layer, 90 GB at 32 layers, more
    if PyTorch's caching host allocator rounds each pinned stack up to a power of two (2 + 1 GiB a
    layer: 96 GiB at 32 layers), so 32 layers need ~100 GiB of the 128 GiB RAM, after peft_offload has
    released its model. vela_zo reuses vela_tiers' model, ExpertManager and cache (one build; its LoRA as
    vela_tiers left it).
  - GPU memory of the vela setups: the backbone (3.2 GB at 32 layers), activations (estimated as 16
    hidden-size vectors per token per layer on the master and, per routed row, the expert's input and
    three intermediate-size vectors: ~0.65 GB a layer at 4 x 512 tokens), the working set of the largest
    device call (a whole layer's routed rows through its cached experts, computed from the cache in place:
    `tiers.device_working_bytes`, 1.13 GB at 4 x 512 tokens) plus the kernels' workspace (64 MiB), and the
    cache; `--cache-experts` defaults to what `--gpu-memory` leaves for it after the rest (`cache_experts_for`).
  - Building: the experts are drawn once per layer and copied to every expert of the layer (the
    arithmetic does not depend on the values), so building never needs a second copy of the model in
    host memory (peft_offload's checkpoint is written layer by layer; vela's ExpertManager stacks its
    own copies of the per-layer draws, `gpu_step.expert_specs`).

Never run on a GPU yet (written in a session without one): the CPU smoke run below runs every setup
at toy sizes (tests/unit/test_big_on_one_gpu.py), the offloaded peft path included, emulated with
disk offload and the CPU as accelerate's execution device (`--emulate-offload`); the sizes, the memory
expectations and the timings above are arithmetic, not measurements, until a GPU run writes
benchmarks/results/big_on_one_gpu.json.

    python benchmarks/big_on_one_gpu.py                              # all three, 32 layers (one GPU)
    python benchmarks/big_on_one_gpu.py --layers 16 --gpu-memory 40
    python benchmarks/big_on_one_gpu.py --setups vela_tiers vela_zo   # without the peft baseline
    python benchmarks/big_on_one_gpu.py --device cpu --tiny --out /tmp/smoke.json   # toy sizes, no GPU

Results: a table, and benchmarks/results/big_on_one_gpu.json on a GPU (with the command), rewritten after
every setup (a crash keeps what ran before it); a setup that fails is recorded with its error's first line
and the others go on. Without CUDA and without `--device cpu` it exits 2 with one line saying so.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/big_on_one_gpu.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._harness import Sampler, benchmark_device, command, parser, run, write_results  # noqa: E402
from benchmarks.gpu_step import (  # noqa: E402
    LR, MAX_GRAD_NORM, Setup, error_line, expert_specs, random_model)

RESULTS = ROOT / "benchmarks" / "results" / "big_on_one_gpu.json"
SETUPS = ("peft_offload", "vela_tiers", "vela_zo", "vela_streamed")
HOST_OF = {"vela_tiers": "resident", "vela_zo": "resident", "vela_streamed": "streamed"}  # which VelaHost runs it
ZO_LR = 1e-6  # MeZO's scale of learning rates; the step's cost does not depend on it
GIB, GB = 2.0 ** 30, 1e9
KERNEL_WORKSPACE = 64 * 2**20  # cuBLAS's workspace on sm90 is 32 MiB per stream: the compute and upload streams
GOAL = 3.0  # the issue's goal: vela_tiers' tokens/s >= 3x peft_offload's

# What the papers report, to print beside ours (../shared/papers/aptmoe.md, zo-offloading.md).
PAPERS = [
    {"paper": "APTMoE (SC'24)", "where": "abstract; §IV-B, Fig. 11",
     "figure": "up to 1.33x throughput (33%) over Mobius (MoE-S-16, G=0.4); 1.32x MoE-S-8, 1.17x MoE-M-8",
     "compares": "pipeline fine-tuning with offloading on 4 A800-40GB GPUs (C1+G2): APTMoE vs Mobius, "
                 "both offloading"},
    {"paper": "APTMoE (SC'24)", "where": "§IV-E 3), real case",
     "figure": "Mixtral-8x7B: ~1.04x (4%) over Mobius, ~1.20x (20%) over GPipeOffload",
     "compares": "the same pipelines on the real model (G ~ 0.2, load-balanced routing)"},
    {"paper": "ZO-Offloading", "where": "§6.1, Table 1",
     "figure": "throughput x1.00 of MeZO's (FP32: OPT-1.3B to OPT-13B, e.g. OPT-6.7B 499 vs 499 tokens/s) "
               "with x0.26 of its GPU memory (8329 vs 32083 MB); FP16 OPT-13B 1340 vs 1406 tokens/s (x0.95) "
               "in 6445 vs 29411 MB; OPT-175B at 37 tokens/s in 24.7 GB (FP16), where MeZO runs out of memory",
     "compares": "ZO-SGD with CPU offload vs MeZO with the whole model on one GPU: no speedup is claimed, "
                 "the same throughput in less GPU memory"},
]


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, what=f"results JSON (default on a GPU: {RESULTS.relative_to(ROOT)})")
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS), help="setups to run")
    p.add_argument("--layers", type=int, default=32, help="Mixtral-8x7B layers of its 32 (fewer for quick tries)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--rank", type=int, default=8, help="LoRA r (alpha = 2r)")
    p.add_argument("--gpu-memory", type=float, default=40.0,
                   help="GiB of GPU memory the setups may use: peft_offload's max_memory, the vela cache's sizing")
    p.add_argument("--host-memory", type=float, default=None,
                   help="GiB of host memory for peft_offload's max_memory['cpu'] (default: available - 8)")
    p.add_argument("--buffer-blocks", type=int, default=2, help="vela_streamed: GPU slots of streamed layers")
    p.add_argument("--cache-experts", type=int, default=None,
                   help="experts the vela setups' GPU cache holds (default: what --gpu-memory leaves)")
    p.add_argument("--peft-load", choices=("auto", "from_pretrained", "dispatch"), default="auto",
                   help="peft_offload: read a checkpoint written to --offload-dir, or dispatch the model built "
                        "in memory; auto: from_pretrained where the disk has room")
    p.add_argument("--offload-dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where peft_offload writes its random checkpoint (and accelerate its disk offload)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (speeds, kernels, allocator)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per setup")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="toy dimensions (2 layers, hidden 64) and batch 2 x 32")
    p.add_argument("--emulate-offload", action="store_true",
                   help="cpu only: peft_offload offloads its second half of layers to disk, the CPU executing "
                        "(accelerate's hooks and the peft fix-ups without a GPU)")
    p.add_argument("--seed", type=int, default=0, help="weights, LoRA init and tokens")
    args = p.parse_args(argv)
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 32)
    if args.emulate_offload and args.device != "cpu":
        p.error("--emulate-offload is for --device cpu (a GPU offloads for real)")
    if not 1 <= args.layers <= 32:
        p.error(f"--layers {args.layers}: Mixtral-8x7B has 32 layers; give 1 to 32")
    return args


# -- the model --------------------------------------------------------------------------------------------

def mixtral_config(args: argparse.Namespace):
    """Mixtral-8x7B's transformers config with `--layers` layers (or toy dimensions with --tiny)."""
    from transformers import MixtralConfig

    common = dict(attn_implementation="sdpa", experts_implementation="grouped_mm", use_cache=False,
                  tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0)
    if args.tiny:  # Mixtral's ratios: intermediate 3.5 x hidden, 4 query heads per KV head
        return MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                             bos_token_id=None, eos_token_id=None, pad_token_id=None, **common)
    return MixtralConfig(  # mistralai/Mixtral-8x7B-v0.1's config.json, with --layers of its 32 layers
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, sliding_window=None, **common)


def model_bytes(config, dtype: torch.dtype) -> tuple[int, int]:
    """(backbone bytes, bytes of one expert's frozen weights) of the model, from its meta skeleton."""
    from transformers import AutoModelForCausalLM

    from vela_ray.model.modeling import find_moe_blocks

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts = {id(p) for b in find_moe_blocks(skeleton) for p in b.block.experts.parameters()}
    size = torch.tensor([], dtype=dtype).element_size()
    backbone = sum(p.numel() for p in skeleton.parameters() if id(p) not in experts) * size
    stacks = find_moe_blocks(skeleton)[0].block.experts
    return backbone, sum(p[0].numel() for p in stacks.parameters()) * size


def random_parts(config, dtype: torch.dtype, seed: int):
    """The causal LM on the meta device, then its parts made real on the CPU one at a time with random
    weights: yields (model, [paths]) after each part (embeddings; each decoder layer; norm and lm_head).
    Backbone weights by the model's own init; each layer's experts all copy one draw per weight stack
    (std 0.02), so a part costs its own size, never the model's twice. The caller keeps or frees each."""
    from transformers import AutoModelForCausalLM

    from vela_ray.model.modeling import find_moe_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts_of = {b.decoder_layer: b.block.experts for b in find_moe_blocks(model)}
    layers = [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
    parts = [["model.embed_tokens", "model.rotary_emb"], *[[p] for p in layers], ["model.norm", "lm_head"]]
    torch.manual_seed(seed)
    for paths in parts:
        modules = [model.get_submodule(p) for p in paths]
        for module in modules:
            module.to_empty(device="cpu")
        for i, path in enumerate(layers):
            if path in paths:  # the experts: one draw per stack, copied to every expert
                generator = torch.Generator().manual_seed(seed * 1000 + i)
                with torch.no_grad():
                    for param in experts_of[i].parameters(recurse=False):
                        draw = torch.randn(param.shape[1:], generator=generator).mul_(0.02).to(dtype)
                        param.copy_(draw.expand_as(param))
                        param._is_hf_initialized = True  # the model's init leaves it alone
        for module in modules:
            for sub in module.modules():  # what model.initialize_weights does, on this part
                model._init_weights(sub)
        yield model, paths


def write_random_checkpoint(config, dtype: torch.dtype, folder: Path, seed: int) -> int:
    """A safetensors checkpoint of `random_parts` in `folder`, one file per part (each freed once written),
    with its index and config.json: what `from_pretrained` reads. Returns the bytes written."""
    from safetensors.torch import save_file

    weight_map, total = {}, 0
    for n, (model, paths) in enumerate(random_parts(config, dtype, seed)):
        tensors = {f"{path}.{name}": t.contiguous() for path in paths
                   for name, t in model.get_submodule(path).state_dict().items()}
        if tensors:
            file = f"model-{n:05d}.safetensors"
            save_file(tensors, str(folder / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        for path in paths:
            model.get_submodule(path).to("meta")  # freed: the next part reuses the memory
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(folder)
    return total


def in_memory_model(config, dtype: torch.dtype, seed: int) -> nn.Module:
    """The whole model in host memory, by `random_parts` (rotary tables included), in training mode."""
    model = None
    for model, _ in random_parts(config, dtype, seed):
        pass
    return model.train()


# -- setups ----------------------------------------------------------------------------------------------

@dataclass
class Run(Setup):
    """`gpu_step.Setup` plus what the results report about it."""

    info: dict = field(default_factory=dict)  # how it was built (load path, offload, fix-ups, cache)
    tiers: Callable[[], object] | None = None  # the ExpertManager's tier counters, for the vela setups
    streamed: Callable[[], float] | None = None  # vela_streamed: the most GB its GPU slots held
    model: nn.Module | None = None  # the trained (peft) model, for tests


def build_peft_offload(config, dtype, device, args) -> Run:
    """transformers + peft with accelerate's CPU offload (see the module docstring), and its AdamW step."""
    cuda = device.type == "cuda"
    backbone, per_expert = model_bytes(config, dtype)
    total = backbone + per_expert * config.num_local_experts * config.num_hidden_layers
    workdir = Path(tempfile.mkdtemp(prefix="big_on_one_gpu-", dir=args.offload_dir))
    free = shutil.disk_usage(workdir).free
    load = args.peft_load
    if load == "auto":
        load = "from_pretrained" if free > total + 2 * GIB else "dispatch"
    elif load == "from_pretrained" and free <= total + 2 * GIB:
        shutil.rmtree(workdir, ignore_errors=True)
        raise RuntimeError(f"--peft-load from_pretrained: the checkpoint needs {total / GB:.1f} GB, "
                           f"{workdir.parent} has {free / GB:.1f} GB free")
    host = args.host_memory if args.host_memory is not None else psutil.virtual_memory().available / GIB - 8
    max_memory = {device.index or 0: f"{args.gpu_memory}GiB", "cpu": f"{max(host, 1):.0f}GiB"}
    device_map: str | dict | None = None
    if cuda:
        device_map = "auto"
    elif args.emulate_offload:  # layers of the second half on disk, the CPU executing them
        half = config.num_hidden_layers // 2
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                      **{f"model.layers.{i}": "cpu" if i < half else "disk" for i in range(config.num_hidden_layers)}}
    info = {"load": load, "checkpoint_gb": total / GB, "disk_free_gb": free / GB,
            "max_memory": max_memory if cuda else None}
    try:
        return _peft_offload(config, dtype, cuda, args, workdir, load, device_map, max_memory, info)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)  # the checkpoint may be most of the disk
        raise


def _peft_offload(config, dtype, cuda: bool, args, workdir: Path, load: str, device_map, max_memory: dict,
                  info: dict) -> Run:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from vela_ray.model.adapters import full_lora_config
    from vela_ray.model.experts import LoraSpec
    from vela_ray.training.optim import apply_step, clip_coefficient, grad_sq_norm, make_adamw
    from vela_ray.training.schedule import OptimizerConfig

    offload_dir = str(workdir / "offload")
    kwargs = dict(dtype=dtype, attn_implementation="sdpa", experts_implementation="grouped_mm")
    if load == "from_pretrained":
        write_start = time.perf_counter()
        write_random_checkpoint(config, dtype, workdir, args.seed)
        info["checkpoint_write_s"] = time.perf_counter() - write_start
        if device_map is None:
            model = AutoModelForCausalLM.from_pretrained(workdir, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(workdir, device_map=device_map, max_memory=max_memory
                                                         if cuda else None, offload_folder=offload_dir, **kwargs)
    else:
        model = in_memory_model(config, dtype, args.seed)
        if device_map is not None:
            model = dispatch(model, device_map, max_memory if cuda else None, offload_dir)
    model.config.use_cache = False
    info["device_map"] = placement_summary(model, config)
    if not cuda and not args.emulate_offload:
        info["note"] = "no GPU: the whole model on the CPU, nothing offloaded"
    model = get_peft_model(model, full_lora_config(model, LoraSpec(r=args.rank, alpha=2.0 * args.rank)))
    info["fixups"] = offload_fixups(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_adamw(params, OptimizerConfig(lr=LR))

    def step(batch: dict) -> float:  # what gpu_step's peft setup does (train_step for a lone master)
        loss = model(**batch).loss
        loss.backward()
        apply_step(optimizer, LR, clip_coefficient(grad_sq_norm(params), MAX_GRAD_NORM))
        return float(loss.detach())

    run = Run(step, info=info, model=model)

    def close() -> None:
        nonlocal model, optimizer, params
        del model, optimizer, params
        run.model = None
        gc.collect()
        shutil.rmtree(workdir, ignore_errors=True)
    run.close = close
    return run


def dispatch(model: nn.Module, device_map, max_memory: dict | None, offload_dir: str) -> nn.Module:
    """accelerate's offload of a model in host memory, by the two calls `from_pretrained` makes once it has
    read its files: transformers' `_get_device_map` (accelerate's `infer_auto_device_map` under
    `max_memory`, for "auto") and `accelerate_dispatch` (accelerate's `dispatch_model`)."""
    from transformers.integrations.accelerate import _get_device_map, accelerate_dispatch

    device_map = _get_device_map(model, device_map, max_memory, None)
    model.hf_device_map = dict(device_map)
    accelerate_dispatch(model, None, device_map, offload_dir, None, False)
    return model


def placement_summary(model: nn.Module, config) -> dict:
    """Decoder layers per device of accelerate's map, and the bytes of the layers not on a GPU."""
    device_map = getattr(model, "hf_device_map", None) or {"": str(next(model.parameters()).device)}
    layers: dict[str, int] = {}
    offloaded = 0
    for i in range(config.num_hidden_layers):
        path = f"model.layers.{i}"
        where = next((str(d) for p, d in device_map.items() if p == "" or path == p or path.startswith(p + ".")),
                     "?")
        where = f"cuda:{where}" if where.isdigit() else where
        layers[where] = layers.get(where, 0) + 1
        on_gpu = any(str(d).isdigit() or str(d).startswith("cuda") for d in device_map.values())
        if where == "disk" or (where == "cpu" and on_gpu):  # weights the hooks load for every forward
            offloaded += sum(int(t.numel()) * t.element_size() for t in model.get_submodule(path).parameters())
    return {"layers": layers, "offloaded_gb": offloaded / GB}


def offload_fixups(peft_model: nn.Module) -> dict:
    """The least that lets peft train through accelerate's offload (without it the first step fails):

    - peft makes the LoRA factors of a module on its base weight's device, which accelerate's offload left
      on the meta device: those factors are created on the hook's execution device with peft's default
      init (A Kaiming-uniform, B zero);
    - peft's `ParamWrapper` (LoRA on the experts' weight stacks) parametrizes the stacks before calling the
      experts module, whose accelerate hook would only then load them: the hook moves onto the outermost
      wrapper, so the stacks are on the execution device when peft reads them, and back off after.
    Counts of both (0 and 0 where nothing was offloaded)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    made = 0
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in module.lora_A:
            lora_A, lora_B = module.lora_A[adapter], module.lora_B[adapter]
            if not (lora_A.weight.is_meta or lora_B.weight.is_meta):
                continue
            hook = getattr(module.get_base_layer(), "_hf_hook", None)
            execution = getattr(hook, "execution_device", None)  # a GPU's index (0 included), or a device
            target = torch.device("cuda", execution) if isinstance(execution, int) else torch.device(execution or "cpu")
            lora_A.to_empty(device=target)
            lora_B.to_empty(device=target)
            with torch.no_grad():
                nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5))
                nn.init.zeros_(lora_B.weight)
            made += 1
    moved = 0
    wrappers = [m for m in peft_model.modules() if isinstance(m, ParamWrapper)]
    inner = {id(m.base_layer) for m in wrappers}
    for wrapper in wrappers:
        base = wrapper.get_base_layer()
        hook = getattr(base, "_hf_hook", None)
        if id(wrapper) in inner or hook is None or not getattr(hook, "offload", False):
            continue
        # accelerate's remove_hook_from_module without its detach_hook, which would load the weights back
        del base._hf_hook
        base.forward = base._old_forward
        del base._old_forward
        wrapper.register_forward_pre_hook(
            lambda _, args, kwargs, b=base, h=hook: h.pre_forward(b, *args, **kwargs), with_kwargs=True)
        wrapper.register_forward_hook(lambda _, args, output, b=base, h=hook: h.post_forward(b, output))
        moved += 1
    return {"lora_factors_made_off_meta": made, "experts_hooks_moved_to_peft_wrapper": moved}


def cache_experts_for(args, config, dtype) -> tuple[int, dict]:
    """(--cache-experts, or what --gpu-memory leaves after the backbone, the estimated activations and the
    largest device call's working set; the sums)."""
    from vela_ray.training.tiers import device_working_bytes

    backbone, per_expert = model_bytes(config, dtype)
    tokens, size = args.batch * args.seq, torch.tensor([], dtype=dtype).element_size()
    hidden, inter = config.hidden_size, config.intermediate_size
    activations = config.num_hidden_layers * tokens * size * (
        16 * hidden + config.num_experts_per_tok * (hidden + 3 * inter))
    # slack: the largest device call, every routed row of a layer on the device (Mixtral's stacks gate_up, down)
    working = device_working_bytes(tokens * config.num_experts_per_tok, [(hidden, 2 * inter), (inter, hidden)],
                                   args.rank, size, config.num_local_experts) + KERNEL_WORKSPACE
    room = args.gpu_memory * GIB - backbone - activations - working
    fits = int(room // per_expert)
    everything = config.num_hidden_layers * config.num_local_experts
    cache = args.cache_experts or min(max(fits, 1), everything)
    return cache, {"cache_experts": cache, "expert_gb": per_expert / GB, "backbone_gb": backbone / GB,
                   "activations_gb_estimate": activations / GB, "working_gb": working / GB, "fits_in_budget": fits,
                   "cache_gb": cache * per_expert / GB}


class VelaHost:
    """vela-ray with tiered experts in this process: built once, shared by vela_tiers and vela_zo; with `streamed`
    its backbone streamed through `--buffer-blocks` GPU slots (vela_streamed)."""

    def __init__(self, config, dtype, device, args, streamed: bool = False):
        from vela_ray.model.experts import LoraSpec
        from vela_ray.model.transport import InProcessTransport
        from vela_ray.training.expert_manager import ExpertManager
        from vela_ray.training.schedule import OptimizerConfig
        from vela_ray.training.expert_workers import ExpertWorkers
        from vela_ray.model.streaming import stream_backbone
        from vela_ray.training.master import build_master
        from vela_ray.training.tiers import ExpertTiersConfig

        cache, self.info = cache_experts_for(args, config, dtype)
        tiers = ExpertTiersConfig(enabled=True, cache_experts=cache)
        # drawn on the CPU: a tiered manager keeps its shard in host memory (and would stack on the device)
        table, specs = expert_specs(config, dtype, 1, "cpu", args)
        self.manager = ExpertManager(specs[0].model_copy(update={"device": device.type, "tiers": tiers}))
        # the per-layer draws: the shard holds its own stacked copies; only `rehost` would read them again
        self.manager.spec = self.manager.spec.model_copy(update={"weights": {}})
        del specs
        gc.collect()
        # the measurement Eq. 1 needs, taken now and with grad enabled: left to the manager's first request it
        # runs inside the broker's autograd Function, whose no-grad mode fails its backward (in-process only:
        # an actor's thread has grad on; `tiered.seconds_per_row` would need its own torch.enable_grad())
        with torch.enable_grad():
            self.manager.tiers.measured_speeds()
        # streamed: built in host memory, as the runner builds a streamed master (the layers never on the GPU)
        model = random_model(config, dtype, torch.device("cpu") if streamed else device, with_experts=False,
                             seed=args.seed)
        self.master = build_master(model, table, InProcessTransport([self.manager]),
                                   LoraSpec(r=args.rank, alpha=2.0 * args.rank), OptimizerConfig(lr=LR))
        self.stream = None
        if streamed:
            self.stream = stream_backbone(self.master.peft_model, args.buffer_blocks, device)
            self.info.update(buffer_blocks=self.stream.buffer_blocks,
                             streamed_layers_gb=self.stream.frozen_bytes / GB)
        else:
            self.master.peft_model.to(device)  # as the runner does; everything but the brokers is there already
        self.workers = ExpertWorkers.in_process([self.manager])
        self.zo_steps, self.seed = 0, args.seed

    def first_order(self, batch: dict) -> float:
        from vela_ray.training.step import train_step

        return train_step(self.master, self.workers, [batch], LR, MAX_GRAD_NORM)

    def zo(self, batch: dict) -> float:
        from vela_ray.config import ZoSection
        from vela_ray.training.zo import ZoTrainer

        if not hasattr(self, "trainer"):
            self.trainer = ZoTrainer(ZoSection().eps, seed=self.seed)
        self.zo_steps += 1
        return self.trainer.step(self.master, self.workers, [batch], ZO_LR, self.zo_steps - 1).loss

    def run(self, method: str) -> Run:
        step = self.first_order if method == "first_order" else self.zo
        return Run(step, info={"method": method, **self.info}, tiers=lambda: self.manager.report().tiers,
                   streamed=(lambda: self.stream.peak_bytes / GB) if self.stream is not None else None)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.__dict__.clear()
        gc.collect()


# -- measuring -------------------------------------------------------------------------------------------

class PeakRss(Sampler):
    """Peak resident memory of this process (pinned memory included), sampled every `every_s` on a thread."""

    def __init__(self, every_s: float = 0.02):
        super().__init__(every_s)
        self.peak, self._process = 0, psutil.Process()

    def sample(self) -> None:
        self.peak = max(self.peak, self._process.memory_info().rss)


def tier_delta(before, after, steps: int) -> dict:
    """Per step over the timed steps: what the tiered manager computed where, and what it uploaded."""
    counts = ("rows_cpu", "rows_device", "experts_cpu", "experts_device", "uploads", "upload_bytes", "cache_hits",
              "evictions")
    per_step = {name: (getattr(after, name) - getattr(before, name)) / steps for name in counts}
    rows = per_step["rows_cpu"] + per_step["rows_device"]
    requests = per_step["experts_cpu"] + per_step["experts_device"]
    speeds = after.speeds
    mean_rows = rows / requests if requests else None
    return {
        "per_step": per_step,
        "cpu_row_share": per_step["rows_cpu"] / rows if rows else None,
        # Eq. 1's two sides for an expert with the mean rows of a request: computing it on the CPU, or loading it
        "rows_per_expert_request": mean_rows,
        "cpu_s_per_expert_request": speeds.cpu_seconds(mean_rows) if speeds and mean_rows else None,
        "upload_gb_per_step": per_step["upload_bytes"] / GB,
        "cpu_s_per_row": speeds.cpu_s_per_row if speeds else None,
        "device_s_per_row": speeds.device_s_per_row if speeds else None,
        "upload_gb_per_s": speeds.upload_bytes_per_s / GB if speeds and speeds.upload_bytes_per_s else None,
        "expert_load_s": speeds.load_seconds() if speeds and speeds.has_device else None,
    }


def run_setup(name: str, build: Callable[[], Run], args, device: torch.device, batch: dict) -> dict:
    """Build `name`, run its steps; tokens/s, memory and the tiers' counters, or the error that stopped it."""
    cuda = device.type == "cuda"
    run, seconds, losses, error, before = None, [], [], None, None
    with PeakRss() as rss:
        try:
            build_start = time.perf_counter()
            run = build()
            build_s = time.perf_counter() - build_start
            if cuda:
                torch.cuda.synchronize()
                resident = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            for i in range(args.warmup + args.steps):
                if i == args.warmup and run.tiers is not None:
                    before = run.tiers()
                start = time.perf_counter()
                losses.append(run.step(batch))  # float(loss) waits for the GPU
                if cuda:
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    seconds.append(time.perf_counter() - start)
        except torch.OutOfMemoryError as exc:
            error = f"out of GPU memory: {str(exc).splitlines()[0]}"
        except Exception as exc:  # noqa: BLE001  a setup that breaks is reported, and the others go on
            error = error_line(exc)
            print(traceback.format_exc(), file=sys.stderr)
        peak_gpu = torch.cuda.max_memory_allocated() / GIB if cuda and error is None else None
        info = dict(run.info) if run is not None else {}
        after = run.tiers() if run is not None and run.tiers is not None and error is None else None
        if run is not None and run.streamed is not None and error is None:
            info["peak_buffer_gb"] = run.streamed()
        if run is not None:
            run.close()  # the vela setups' close is a no-op: their host goes on to the next (closed by main)
        del run
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    result: dict = {"info": info, "peak_host_rss_gib": rss.peak / GIB}
    if error is not None:
        return {"error": error, **result}
    median = statistics.median(seconds)
    result.update({
        "tokens_per_s": args.batch * args.seq / median, "median_step_s": median, "step_s": seconds,
        "losses": losses, "build_s": build_s, "peak_gpu_gib": peak_gpu,
        "resident_gpu_gib": resident / GIB if cuda else None,
        "gpu_budget_gib": args.gpu_memory if cuda else None,
    })
    if after is not None:
        result["tiers"] = tier_delta(before, after, len(seconds))
    return result


def ratios(results: dict, on_gpu: bool) -> dict:
    """tokens/s of each vela setup over peft_offload's, and whether the issue's goal is met (None: not
    measured, as in a CPU smoke run, where nothing is offloaded)."""
    base = results.get("peft_offload", {}).get("tokens_per_s")
    out = {f"{name}/peft_offload": (r["tokens_per_s"] / base if base and "tokens_per_s" in r else None)
           for name, r in results.items() if name != "peft_offload"}
    tiers = out.get("vela_tiers/peft_offload")
    out["goal"] = f"vela_tiers >= {GOAL:g}x peft_offload"
    out["goal_met"] = None if tiers is None or not on_gpu else tiers >= GOAL
    return out


def print_table(results: dict, summary: dict) -> None:
    print(f"\n{'setup':<14}{'tokens/s':>10}{'step s':>9}{'peak GPU GiB':>14}{'budget':>8}{'peak RSS GiB':>14}"
          f"{'/ peft':>8}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<14}  {r['error'][:100]}")
            continue
        peak = f"{r['peak_gpu_gib']:.1f}" if r["peak_gpu_gib"] is not None else "-"
        budget = f"{r['gpu_budget_gib']:g}" if r["gpu_budget_gib"] is not None else "-"
        ratio = summary.get(f"{name}/peft_offload")
        print(f"{name:<14}{r['tokens_per_s']:>10.1f}{r['median_step_s']:>9.2f}{peak:>14}{budget:>8}"
              f"{r['peak_host_rss_gib']:>14.2f}{(f'{ratio:.2f}x' if ratio else '-'):>8}")
    for name, r in results.items():
        info = r.get("info", {})
        if name == "peft_offload" and info:
            fix = info.get("fixups", {})
            print(f"  {name}: load {info.get('load')}, layers {info.get('device_map', {}).get('layers')}, "
                  f"offloaded {info.get('device_map', {}).get('offloaded_gb', 0):.1f} GB; peft fix-ups: "
                  f"{fix.get('lora_factors_made_off_meta', 0)} LoRA pairs off meta, "
                  f"{fix.get('experts_hooks_moved_to_peft_wrapper', 0)} experts hooks moved"
                  + (f"; {info['note']}" if info.get("note") else ""))
        if "peak_buffer_gb" in info:
            print(f"  {name}: layers' frozen {info['streamed_layers_gb']:.2f} GB in host memory, streamed through "
                  f"{info['buffer_blocks']} GPU slots that held at most {info['peak_buffer_gb']:.2f} GB")
        tiers = r.get("tiers")
        if tiers:
            per = tiers["per_step"]
            dev = f"{tiers['device_s_per_row']:.2e}" if tiers["device_s_per_row"] else "- (no GPU)"
            bw = f"{tiers['upload_gb_per_s']:.1f} GB/s" if tiers["upload_gb_per_s"] else "-"
            print(f"  {name}: per step {per['rows_cpu']:.0f} rows on CPU / {per['rows_device']:.0f} on GPU "
                  f"({per['experts_cpu']:.0f} / {per['experts_device']:.0f} expert-requests), {per['uploads']:.0f} "
                  f"uploads = {tiers['upload_gb_per_step']:.2f} GB; s/row CPU {tiers['cpu_s_per_row']:.2e}, "
                  f"GPU {dev}; upload {bw}; cache {info.get('cache_experts')} experts")
            if tiers["cpu_s_per_expert_request"] is not None:
                load = f"{tiers['expert_load_s']:.3f} s" if tiers["expert_load_s"] else "- (no GPU)"
                print(f"    an expert with the mean {tiers['rows_per_expert_request']:.0f} rows of a request: "
                      f"{tiers['cpu_s_per_expert_request']:.3f} s on the CPU, {load} to upload")
    met = summary.get("goal_met")
    print(f"goal {summary['goal']}: " + ("not measured (no GPU run of both)" if met is None else
                                         "met" if met else "not met"))
    print("reported by the papers (not this machine):")
    for paper in PAPERS:
        print(f"  {paper['paper']} ({paper['where']}): {paper['figure']} -- {paper['compares']}")


def report(argv, args, device: torch.device, config, dtype: torch.dtype, results: dict) -> dict:
    """The results JSON: the command, the machine, the model, each setup's results and the ratios so far."""
    return {
        "command": command(__file__, argv), "args": vars(args),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "model": {"name": "Mixtral-8x7B dimensions, random weights" + (" (tiny)" if args.tiny else ""),
                  "layers": config.num_hidden_layers, "experts": config.num_local_experts,
                  "hidden": config.hidden_size, "intermediate": config.intermediate_size, "dtype": str(dtype)},
        "results": results, "ratios": ratios(results, device.type == "cuda"), "papers": PAPERS}


def main(argv=None) -> int:
    from vela_ray.quiet import silence_known_warnings

    args = parse_args(argv)
    silence_known_warnings()
    device = benchmark_device(args.device, "big_on_one_gpu")
    if device is None:
        return 2
    config = mixtral_config(args)
    dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    batch = {"input_ids": input_ids, "labels": input_ids}
    host: VelaHost | None = None

    def vela(method: str, streamed: bool = False) -> Callable[[], Run]:
        def build() -> Run:
            nonlocal host
            if host is None:
                host = VelaHost(config, dtype, device, args, streamed=streamed)
            return host.run(method)
        return build

    builders = {"peft_offload": lambda: build_peft_offload(config, dtype, device, args),
                "vela_tiers": vela("first_order"), "vela_zo": vela("zo"),
                "vela_streamed": vela("first_order", streamed=True)}
    out = args.out or (RESULTS if device.type == "cuda" else None)
    results: dict[str, dict] = {}
    chosen = [s for s in SETUPS if s in args.setups]  # peft_offload first: it must release the host first
    for name, after in zip(chosen, [*chosen[1:], None]):
        print(f"{name} ...", flush=True)
        results[name] = run_setup(name, builders[name], args, device, batch)
        if host is not None and HOST_OF.get(after) != HOST_OF.get(name):  # the next setup needs another host
            host.close()
            host = None
        if out:  # after every setup: a later crash (or timeout) keeps what ran
            write_results(out, report(argv, args, device, config, dtype, results))
    print_table(results, ratios(results, device.type == "cuda"))
    return 0

if __name__ == "__main__":
    run(main)
