"""The master's activation memory and step time with and without activation checkpointing, against peft.

One debug-width Mixtral with real depth and Mixtral-8x7B's proportions (`--layers` 16, `--hidden`
128, expert intermediate 3.5 x hidden as 14336 / 4096, 6 experts, top-2, sdpa attention), LoRA r=8 on attention and every expert, one sequence of `--seq-lens` tokens per step.
Each (setup, length) runs in a fresh subprocess of its own (MALLOC_MMAP_THRESHOLD_=65536, one
thread), so nothing one leaves resident hides in another's numbers:

- vela, vela_checkpointed: vela-ray's master (backbone + brokers + its LoRA and AdamW) in the
  measured process; every expert on one ExpertManager-like server in a second process, over the
  collective plane (gloo), as a worker on another device would be. Only the master is measured.
  The server keeps its graphs and accumulates its experts' LoRA gradients (its optimizer step is
  not run: it does not touch the master's memory).
- peft, peft_checkpointed: plain transformers + peft, experts in the measured process, with
  transformers' own (non-reentrant) activation checkpointing or without.

Per step: activation_MiB = the resident-set high-water mark during the step (VmHWM, reset before
it) minus the resident set just before it, i.e. what the step needed on top of the resident
weights, adapters and optimizer state (steps after the first, once AdamW's state exists);
seconds; and for vela the rows dispatched to the workers (the broker's counters), which
checkpointing must not change. Printed as a table and written to `--out` with a plot:

    python benchmarks/activation_memory.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/activation_memory.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import MEASURED_ENV, command, parser, reset_peak, run, status_kib, write_results  # noqa: E402
from vela_ray.model import collective  # noqa: E402
from vela_ray.model.adapters import full_lora_config  # noqa: E402
from vela_ray.model.experts import ExpertShard, LoraSpec  # noqa: E402
from vela_ray.model.families import debug_model  # noqa: E402
from vela_ray.model.modeling import expert_weights, experts_prototypes, find_moe_blocks  # noqa: E402
from vela_ray.training.schedule import OptimizerConfig  # noqa: E402
from vela_ray.training.master import build_master  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "activation_memory.json"
SETUPS = ("vela", "vela_checkpointed", "peft", "peft_checkpointed")
LORA = LoraSpec(r=8, alpha=16)
JOIN_S = 120.0
MiB = 2**20


def parse_args(argv=None):
    p = parser(__doc__, RESULTS)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first (AdamW's state appears) is left out")
    p.add_argument("--child", nargs=2, metavar=("SETUP", "SEQ_LEN"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_model(layers: int, hidden: int, seq_len: int) -> torch.nn.Module:
    model = debug_model("mixtral", seed=0, num_hidden_layers=layers, hidden_size=hidden,
                        intermediate_size=hidden * 7 // 2,
                        head_dim=hidden // 4, max_position_embeddings=max(seq_len, 512))
    model.config._attn_implementation = "sdpa"
    return model


# --- the expert server: a second process -----------------------------------------------------------------


class _ShardServer:
    """The collective plane's RowServer over one ExpertShard holding every expert (worker 0, CPU)."""

    worker = 0
    device = torch.device("cpu")

    def __init__(self, shard: ExpertShard):
        self.shard = shard

    def forward_rows(self, layer, expert_ids, rows, key=None):
        return self.shard.forward_rows(layer, expert_ids, rows, key)

    def backward_rows(self, key, grad):
        return self.shard.backward_rows(key, grad)


def _serve_experts(layers: int, hidden: int, seq_len: int, port: int) -> None:
    torch.set_num_threads(1)
    model = make_model(layers, hidden, seq_len)
    shard = ExpertShard.from_weights(expert_weights(find_moe_blocks(model)), LORA, experts_prototypes(model.config),
                                     seed=0)
    store = collective.make_store("127.0.0.1", port, 2, is_master=False, timeout_s=JOIN_S)
    collective.serve(collective.make_group(store, 1, 2, JOIN_S), _ShardServer(shard))


def _vela_master(args, seq_len: int, checkpointed: bool):
    """vela-ray's master here, its experts served by a second process; (master, step, rows dispatched)."""
    store = collective.make_store("127.0.0.1", 0, 2, is_master=True, timeout_s=JOIN_S)
    server = multiprocessing.get_context("spawn").Process(
        target=_serve_experts, args=(args.layers, args.hidden, seq_len, store.port), daemon=True)
    server.start()
    group = collective.make_group(store, 0, 2, JOIN_S)
    data = collective.form_data_plane(group, store, 1, "cpu", None, JOIN_S, JOIN_S)
    transport = collective.CollectiveTransport(group, data, ["same_node"], JOIN_S)
    model = make_model(args.layers, args.hidden, seq_len)
    blocks = find_moe_blocks(model)
    table = torch.zeros(len(blocks), blocks[0].layout.num_experts, dtype=torch.long)
    master = build_master(model, table, transport, LORA, OptimizerConfig(lr=1e-4),
                          activation_checkpointing=checkpointed)
    master.peft_model.train()

    def step(batch) -> float:
        loss = master.peft_model(**batch).loss
        loss.backward()
        master.optimizer.step()
        master.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    def rows() -> int:
        return int(np.asarray(master.dispatcher.traffic().rows)[:, :, 0].sum())

    return step, rows, lambda: (transport.close(), server.join(30))


def _peft_model(args, seq_len: int, checkpointed: bool):
    from peft import get_peft_model

    model = make_model(args.layers, args.hidden, seq_len)
    peft_model = get_peft_model(model, full_lora_config(model, LORA))
    if checkpointed:
        model.activation_checkpointing_enable({"use_reentrant": False})
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)

    def step(batch) -> float:
        loss = peft_model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return step, lambda: 0, lambda: None


def measure(args) -> dict:
    setup, seq_len = args.child[0], int(args.child[1])
    torch.set_num_threads(1)
    build = _vela_master if setup.startswith("vela") else _peft_model
    step, rows, close = build(args, seq_len, setup.endswith("_checkpointed"))
    ids = torch.randint(3, 128, (1, seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    steps = []
    for _ in range(args.steps):
        rows_before, rss_before = rows(), status_kib("VmRSS")
        reset_peak()
        start = time.perf_counter()
        loss = step(batch)
        seconds = time.perf_counter() - start
        steps.append({"loss": loss, "seconds": seconds, "activation_MiB": (status_kib("VmHWM") - rss_before) / 1024,
                      "resident_MiB": rss_before / 1024, "rows_dispatched": rows() - rows_before})
    close()
    return {"setup": setup, "seq_len": seq_len, "steps": steps}


# --- all of them, side by side ---------------------------------------------------------------------------


def run_child(argv: list[str], setup: str, seq_len: int) -> dict:
    env = {**os.environ, **MEASURED_ENV}
    done = subprocess.run([sys.executable, __file__, *argv, "--child", setup, str(seq_len)], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def view(result: dict) -> dict:
    later = result["steps"][1:] or result["steps"]
    return {"activation_MiB": round(float(np.median([s["activation_MiB"] for s in later])), 1),
            "step_s": round(float(np.median([s["seconds"] for s in later])), 3),
            "rows_dispatched": later[-1]["rows_dispatched"], "loss": round(later[0]["loss"], 4)}


def ratios(rows: dict[int, dict[str, dict]]) -> dict[int, dict[str, float]]:
    out = {}
    for seq_len, by_setup in rows.items():
        vela, checkpointed = by_setup.get("vela"), by_setup.get("vela_checkpointed")
        peft_checkpointed = by_setup.get("peft_checkpointed")
        if not (vela and checkpointed):
            continue
        out[seq_len] = {"memory_checkpointed_over_unchecked": round(checkpointed["activation_MiB"] /
                                                                    vela["activation_MiB"], 3),
                        "time_checkpointed_over_unchecked": round(checkpointed["step_s"] / vela["step_s"], 3),
                        "rows_equal": checkpointed["rows_dispatched"] == vela["rows_dispatched"]}
        if peft_checkpointed:
            out[seq_len]["memory_checkpointed_over_peft_checkpointed"] = round(
                checkpointed["activation_MiB"] / peft_checkpointed["activation_MiB"], 3)
    return out


def table(rows: dict[int, dict[str, dict]]) -> str:
    lines = [f"{'tokens':>7} {'setup':<18} {'activation MiB':>15} {'step s':>8} {'rows':>8}"]
    for seq_len, by_setup in rows.items():
        for setup, r in by_setup.items():
            lines.append(f"{seq_len:>7} {setup:<18} {r['activation_MiB']:>15.1f} {r['step_s']:>8.3f} "
                         f"{r['rows_dispatched']:>8}")
    return "\n".join(lines)


def plot(rows: dict[int, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, seconds) = plt.subplots(1, 2, figsize=(10, 4))
    for setup in SETUPS:
        lengths = [n for n in rows if setup in rows[n]]
        if lengths:
            memory.plot(lengths, [rows[n][setup]["activation_MiB"] for n in lengths], marker="o", label=setup)
            seconds.plot(lengths, [rows[n][setup]["step_s"] for n in lengths], marker="o", label=setup)
    for ax, label in ((memory, "activation memory per step (MiB)"), (seconds, "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per step")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("master activation memory: vela-ray vs peft, with and without activation checkpointing")
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    passed = list(sys.argv[1:] if argv is None else argv)
    rows: dict[int, dict[str, dict]] = {}
    for seq_len in args.seq_lens:
        for setup in args.setups:
            rows.setdefault(seq_len, {})[setup] = view(run_child(passed, setup, seq_len))
            print(table({seq_len: {setup: rows[seq_len][setup]}}).splitlines()[-1], flush=True)
    print(table(rows))
    payload = {"command": command(__file__, argv), "settings": {k: v for k, v in vars(args).items() if k != "child"},
               "machine": {"cpus": os.cpu_count(), "torch": torch.__version__}, "results": rows,
               "ratios": ratios(rows)}
    write_results(args.out, payload)
    if args.out is not None:
        plot(rows, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    run(main)
