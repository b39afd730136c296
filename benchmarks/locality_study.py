"""Expert-locality study (VELA paper Sec. III: Fig. 3 a-c and Fig. 7) on the tiny local Mixtral.

Reads top to bottom:
  1. build or load the cached tiny pre-trained Mixtral (`vela build-tiny-model`);
  2. profile Tiny Shakespeare before fine-tuning (P0, router confidence; Fig. 3a/3b);
  3. measure the sampling-noise floor of a `--window`-step window of training batches;
  4. LoRA fine-tune on Tiny Shakespeare (r=8, alpha=16, attention projections and the
     fused experts via peft `target_parameters`; the router gate is frozen), feeding each
     step's expert counts to a DriftTracker and re-profiling a fixed held-out set every
     `--checkpoint-every` steps (Fig. 3c);
  5. profile WikiText-2, GSM8K and the Alpaca seed tasks with the pre-trained model and
     compare the data sets' profiles (Fig. 7);
  6. write PNGs, profiles and a JSON to `--out`, and print Markdown tables.

Run: python benchmarks/locality_study.py   (about 5-10 minutes on 2 CPU cores after the build)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/locality_study.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import SHAKESPEARE, WIKITEXT, parser, run, write_results  # noqa: E402
from vela_ray.data.config import DataConfig  # noqa: E402
from vela_ray.data.datasets import (  # noqa: E402
    TokenizedDataset, batch_at, build_dataset, iterate_batches, sequential_batches)
from vela_ray.data.locality import (  # noqa: E402
    AccessProfile,
    DriftTracker,
    RoutingRecorder,
    profile_model,
    skew,
    total_variation,
)
from vela_ray.model.modeling import find_moe_blocks, top_k_of  # noqa: E402
from vela_ray.observability import plots  # noqa: E402
from vela_ray.paths import data_dir  # noqa: E402
from vela_ray.training.tiny_model import cpu_threads, tiny_model_path  # noqa: E402

log = logging.getLogger("locality_study")


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, ROOT / "benchmarks" / "results" / "locality",
               what="directory for PNGs, profiles and results.json")
    p.add_argument("--model", type=Path, help="model directory (default: the cached default tiny Mixtral)")
    p.add_argument("--steps", type=int, default=300, help="LoRA fine-tuning steps (paper: 300)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per fine-tuning step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per text row")
    p.add_argument("--instruct-seq-len", type=int, default=256, help="tokens per instruction row")
    p.add_argument("--instruct-examples", type=int, default=1000, help="GSM8K examples to profile")
    p.add_argument("--lr", type=float, default=1e-3, help="peak LoRA learning rate (warmup 20, cosine)")
    p.add_argument("--window", type=int, default=20, help="training steps pooled per drift measurement")
    p.add_argument("--checkpoint-every", type=int, default=100, help="re-profile the held-out set every N steps")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of Shakespeare held out")
    p.add_argument("--seed", type=int, default=0, help="data order and LoRA init seed")
    p.add_argument("--threads", type=int, help="torch threads (default: idle cores)")
    return p.parse_args()


def eval_loss(model: torch.nn.Module, dataset: TokenizedDataset, batch_size: int = 16) -> float:
    """Mean LM loss per supervised token on `dataset` (no aux loss)."""
    total, count = 0.0, 0
    model.eval()
    with torch.inference_mode():
        for batch in sequential_batches(dataset, batch_size):
            out = model(**batch, output_router_logits=False)
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            total, count = total + float(out.loss) * tokens, count + tokens
    return total / count


def lora_model(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """LoRA r=8, alpha=16 on attention projections and the fused 3-D experts; the router stays frozen."""
    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,  # peft's ParamWrapper needs dropout 0
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    return get_peft_model(model, config)


def finetune(model, blocks, train: TokenizedDataset, held_out: TokenizedDataset, tracker: DriftTracker,
             args: argparse.Namespace) -> dict[int, dict]:
    """LoRA-train `model`, feeding per-step counts to `tracker`; returns held-out profile + loss per checkpoint."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = min(20, args.steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, args.steps - warmup)))))
    checkpoints = {0: _checkpoint(model, blocks, held_out)}
    recorder = RoutingRecorder(blocks, top_k_of(model), record_confidence=False).attach()
    batches = iterate_batches(train, args.batch_size, args.seed, num_steps=args.steps)
    with tqdm(batches, total=args.steps, desc="LoRA fine-tune", unit="step") as bar:
        for step, batch in enumerate(bar, start=1):
            model.train()
            recorder.set_attention_mask(batch["attention_mask"])
            loss = model(**batch, output_router_logits=False).loss  # LM loss only: the router is frozen
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            tv_L = tracker.record_step(recorder.take_counts())
            bar.set_postfix(loss=f"{loss.item():.3f}", tv=f"{tv_L.mean():.3f}")
            if step % args.checkpoint_every == 0 or step == args.steps:
                recorder.detach()
                checkpoints[step] = _checkpoint(model, blocks, held_out)
                recorder.attach()
    recorder.detach()
    return checkpoints


def _checkpoint(model, blocks, held_out: TokenizedDataset) -> dict:
    profile = profile_model(model, sequential_batches(held_out, 16), blocks=blocks, source="held-out Shakespeare")
    return {"profile": profile, "loss": eval_loss(model, held_out)}


def profile_dataset(model, blocks, name: str, dataset: TokenizedDataset, batch_size: int = 16) -> AccessProfile:
    log.info("profiling %s: %d rows, %d tokens", name, len(dataset), dataset.num_tokens)
    return profile_model(model, sequential_batches(dataset, batch_size), blocks=blocks, progress=True,
                         source=f"{name} ({dataset.source})")


def drift_rows(tracker: DriftTracker, checkpoints: dict[int, dict], p0: AccessProfile,
               first_window: AccessProfile, window: int) -> list[dict]:
    """One row per checkpoint: held-out TV per layer vs step 0, training-window TV vs P0, skew G."""
    base, top_k = checkpoints[0]["profile"].probs_array(), p0.top_k
    window_tv, window_skew = tracker.tv(window), tracker.skew(window)
    rows, previous = [], base
    for step, point in sorted(checkpoints.items()):
        probs = point["profile"].probs_array()
        last = min(max(step, window), tracker.num_steps) - 1  # window of `window` steps ending at `step`
        rows.append({
            "step": step, "eval_loss": point["loss"],
            "tv_held_out_per_layer": total_variation(probs, base, top_k).tolist(),
            "tv_held_out_vs_previous_checkpoint": total_variation(probs, previous, top_k).tolist(),
            "skew_held_out": skew(probs, top_k),
            "tv_train_window_per_layer": window_tv[last].tolist(), "skew_train_window": float(window_skew[last]),
            "train_window_steps": [last - window + 2, last + 1],
        })
        previous = probs
    # step 0: the pre-trained model on the first window's batches, i.e. the sampling-noise floor
    first_probs = first_window.probs_array()
    rows[0]["tv_train_window_per_layer"] = total_variation(first_probs, p0.probs_array(), top_k).tolist()
    rows[0]["skew_train_window"] = skew(first_probs, top_k)
    rows[0]["train_window_steps"] = [1, window]
    return rows


def markdown_tables(rows: list[dict], profiles: dict[str, AccessProfile], pairwise: np.ndarray,
                    p0: AccessProfile, p_after: AccessProfile, window: int) -> str:
    num_layers = p0.num_layers
    lines = ["### Drift during LoRA fine-tuning on Tiny Shakespeare", "",
             "| step | held-out loss | TV held-out vs step 0, per layer | TV held-out vs previous row | "
             f"G held-out | TV train window ({window} steps) vs P0, per layer | G train window |",
             "|---:|---:|---|---|---:|---|---:|"]
    for row in rows:
        held, since, train = (" / ".join(f"{x:.3f}" for x in row[key]) for key in (
            "tv_held_out_per_layer", "tv_held_out_vs_previous_checkpoint", "tv_train_window_per_layer"))
        lines.append(f"| {row['step']} | {row['eval_loss']:.3f} | {held} | {since} | {row['skew_held_out']:.4f} | "
                     f"{train} | {row['skew_train_window']:.4f} |")
    full_tv = total_variation(p_after.probs_array(), p0.probs_array(), p0.top_k)
    lines += ["", f"Step 0 train-window TV = sampling-noise floor (pre-trained model on the first {window} "
              "training batches vs P0). Full-data TV(P0, P after fine-tuning) per layer: "
              + " / ".join(f"{x:.3f}" for x in full_tv), "",
              "### Expert access per data set (pre-trained model)", "",
              f"| data set | tokens | G (uniform = {1 / p0.num_experts:.3f}) | busiest expert share per layer "
              "| mean router confidence, layer 0 |", "|---|---:|---:|---|---:|"]
    for name, profile in profiles.items():
        shares = profile.probs_array().max(axis=1) / profile.top_k
        lines.append(f"| {name} | {profile.tokens} | {skew(profile.probs_array(), profile.top_k):.4f} | "
                     + " / ".join(f"{x:.3f}" for x in shares) + f" | {profile.confidence_mean[0]:.3f} |")
    names = list(profiles)
    lines += ["", f"### Pairwise TV distance between data sets' profiles (mean over {num_layers} layers)", "",
              "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for i, name in enumerate(names):
        lines.append(f"| {name} | " + " | ".join(f"{pairwise[i, j]:.3f}" for j in range(len(names))) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    # 1. the pre-trained model (cached; built here if missing)
    model_dir = args.model or tiny_model_path()
    torch.set_num_threads(args.threads or cpu_threads())
    log.info("model %s, %d torch threads", model_dir, torch.get_num_threads())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    blocks, top_k = find_moe_blocks(model), top_k_of(model)
    study_started = time.perf_counter()

    # 2. Tiny Shakespeare before fine-tuning: all of it, as the paper does (Fig. 3a, 3b)
    shakespeare = build_dataset(DataConfig(kind="text", path=SHAKESPEARE, seq_len=args.seq_len), tokenizer)
    p0 = profile_dataset(model, blocks, "Tiny Shakespeare", shakespeare)
    train, held_out = shakespeare.split(args.eval_fraction, args.seed)

    # 3. noise floor: how far a window of training batches is from P0 with no fine-tuning at all
    first_batches = [batch_at(train, s, args.batch_size, args.seed) for s in range(args.window)]
    first_window = profile_model(model, first_batches, blocks=blocks, source="first training window")

    # 4. LoRA fine-tuning with drift tracking (Fig. 3c)
    peft_model = lora_model(model, args.seed)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    tracker = DriftTracker.from_profile(p0)
    finetune_started = time.perf_counter()
    checkpoints = finetune(peft_model, blocks, train, held_out, tracker, args)
    finetune_seconds = time.perf_counter() - finetune_started
    p_after = profile_dataset(peft_model, blocks, "Tiny Shakespeare after fine-tuning", shakespeare)

    # 5. other data sets with the pre-trained model (adapters disabled), Fig. 7
    with peft_model.disable_adapter():
        profiles = {"Tiny Shakespeare": p0}
        others = {
            "WikiText-2 (pre-training)": DataConfig(kind="text", path=WIKITEXT, seq_len=args.seq_len),
            "GSM8K": DataConfig(kind="instruct", path=data_dir() / "instruct" / "gsm8k_alpaca.json",
                                seq_len=args.instruct_seq_len, limit=args.instruct_examples),
            "Alpaca seed tasks": DataConfig(kind="instruct", path=data_dir() / "instruct" / "alpaca_seed_tasks.jsonl",
                                            seq_len=args.instruct_seq_len),
        }
        for name, config in others.items():
            profiles[name] = profile_dataset(peft_model, blocks, name, build_dataset(config, tokenizer))
    names = list(profiles)
    pairwise = np.array([[total_variation(profiles[a].probs_array(), profiles[b].probs_array(), top_k).mean()
                          for b in names] for a in names])

    # 6. pictures, files, tables
    plots.plot_access_heatmaps({n: p.probs_array() for n, p in profiles.items()},
                               args.out / "access_heatmaps_datasets.png", top_k)
    plots.plot_access_heatmaps({"before fine-tuning (P0)": p0.probs_array(),
                                f"after {args.steps} LoRA steps": p_after.probs_array()},
                               args.out / "access_heatmap_shakespeare_before_after.png", top_k)
    for layer in (0, p0.num_layers - 1):
        plots.plot_confidence_cdf(profiles, layer, args.out / f"confidence_cdf_layer{layer}.png")
    for layer in range(p0.num_layers):
        plots.plot_layer_drift(tracker.probs(args.window), layer, args.out / f"drift_layer{layer}.png",
                               initial_probs=p0.probs_array(),
                               title=f"Tiny Shakespeare, LoRA, {args.window}-step windows (dotted: P0)")
    for name, profile in [("shakespeare", p0), ("shakespeare_after", p_after)] + [
            (n.split()[0].lower().replace("-", ""), profiles[n]) for n in names[1:]]:
        profile.save(args.out / f"profile_{name}.json", args.out / f"P_{name}.npy")

    rows = drift_rows(tracker, checkpoints, p0, first_window, args.window)
    table = markdown_tables(rows, profiles, pairwise, p0, p_after, args.window)
    results = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": str(model_dir), "model_build_info": json.loads((Path(model_dir) / "build_info.json").read_text()),
        "lora_trainable_parameters": trainable, "torch_threads": torch.get_num_threads(),
        "seconds": {"study_excluding_build": time.perf_counter() - study_started,
                    "finetune": finetune_seconds, "total": time.perf_counter() - started},
        "drift": rows,
        "tv_full_before_after_per_layer": total_variation(p_after.probs_array(), p0.probs_array(), top_k).tolist(),
        "per_step_tv_window1": tracker.tv(1).tolist(),
        f"per_step_tv_window{args.window}": tracker.tv(args.window).tolist(),
        "per_step_skew_window1": tracker.skew(1).tolist(),
        "datasets": {n: {"probs": p.probs, "tokens": p.tokens, "skew": skew(p.probs_array(), top_k),
                         "confidence_mean": p.confidence_mean} for n, p in profiles.items()},
        "pairwise_tv": {"names": names, "matrix": pairwise.tolist()},
        "table_markdown": table,
    }
    results["model_build_info"].pop("losses", None)
    write_results(args.out / "results.json", results)
    print(table)
    log.info("study took %.0f s (fine-tuning %.0f s); results in %s",
             results["seconds"]["study_excluding_build"], finetune_seconds, args.out)


if __name__ == "__main__":
    run(main)
