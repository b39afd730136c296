"""Padding waste and training throughput of instruction data, padded one example per row vs packed.

Tokenises GSM8K (Alpaca layout, `../shared/data/instruct/gsm8k_alpaca.json`) with the
tiny model's tokenizer at `--seq-len`, both ways, and reports the share of token slots
that are padding over the whole file. Then trains the same job twice in one process
(vela-ray's JobRunner with in-process ExpertManagers; a Mixtral of the tiny model's
size with positions for `--seq-len`, random weights: throughput does not depend on
them), padded and packed, and reports non-padding tokens per second of step time.

    python benchmarks/packing.py --seq-len 512 --steps 8 --out benchmarks/results/packing.json
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/packing.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import command, parser, run, tiny_job, write_results  # noqa: E402
from vela_ray.config import JobConfig  # noqa: E402
from vela_ray.data.config import DataConfig  # noqa: E402
from vela_ray.data.datasets import build_dataset  # noqa: E402
from vela_ray.paths import data_dir  # noqa: E402
from vela_ray.runtime.local import InProcessPool  # noqa: E402
from vela_ray.runtime.runner import JobRunner  # noqa: E402
from vela_ray.training.tiny_model import TinyModelConfig, tiny_model_path  # noqa: E402

GSM8K = data_dir() / "instruct" / "gsm8k_alpaca.json"


def padding_waste(tokenizer, seq_len: int) -> dict:
    """Rows, non-padding tokens and padding share of the whole file, both ways."""
    out = {}
    for packing in (False, True):
        rows = build_dataset(DataConfig(kind="instruct", path=GSM8K, seq_len=seq_len, packing=packing), tokenizer)
        out["packed" if packing else "padded"] = {"rows": len(rows), "tokens": rows.num_tokens,
                                                  "padding_fraction": rows.padding_fraction}
    return out


def model_dir(tokenizer, seq_len: int, out: Path) -> Path:
    """A random Mixtral of the tiny model's size with positions for `seq_len`, saved with the tokenizer."""
    tiny = TinyModelConfig()
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=tiny.hidden_size,
                           intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_layers,
                           num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_kv_heads,
                           num_local_experts=tiny.num_experts, num_experts_per_tok=tiny.top_k,
                           max_position_embeddings=2 * seq_len, pad_token_id=tokenizer.pad_token_id,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def train(model: Path, out: Path, seq_len: int, steps: int, batch_size: int, limit: int, packing: bool) -> dict:
    data = {"kind": "instruct", "path": str(GSM8K), "seq_len": seq_len, "limit": limit, "packing": packing}
    training = {"steps": steps, "batch_size": batch_size, "eval_every": 0, "log_every": steps}
    config = JobConfig.from_dict(tiny_job(out, model, data=data, cluster={"num_workers": 2}, training=training,
                                          checkpoint={"every": 0}))
    config.preflight()
    summary = JobRunner(config, InProcessPool(config)).run()
    timed = summary.history[1:]  # the first step warms up allocators and caches
    seconds = sum(h.step_time_s for h in timed)
    return {"rows": summary.data.rows, "padding_fraction": summary.data.padding_fraction,
            "median_step_time_s": summary.median_step_time_s,
            "tokens_per_step": sum(h.tokens for h in timed) / len(timed),
            "tokens_per_s": sum(h.tokens for h in timed) / seconds,
            "losses": summary.losses}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=8, help="training steps per run (the first is not timed)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=2000, help="GSM8K examples the training runs use")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    result = {"command": command(__file__), "data": str(GSM8K.name), "seq_len": args.seq_len,
              "whole_file": padding_waste(tokenizer, args.seq_len)}
    with tempfile.TemporaryDirectory(prefix="vela-packing-") as tmp:
        model = model_dir(tokenizer, args.seq_len, Path(tmp) / "model")
        runs = {name: train(model, Path(tmp) / name, args.seq_len, args.steps, args.batch_size, args.limit, packing)
                for name, packing in (("padded", False), ("packed", True))}
    result["training"] = runs
    result["tokens_per_s_packed_over_padded"] = runs["packed"]["tokens_per_s"] / runs["padded"]["tokens_per_s"]
    print(write_results(args.out, result))


if __name__ == "__main__":
    run(main, level=logging.WARNING)
