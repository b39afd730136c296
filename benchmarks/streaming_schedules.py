"""APTMoE's schedules on one device, as settings of vela-ray's streamed master: step time, uploads and device bytes.

One model and batch, five setups side by side in one process, each on a master of its own built from the same
seeded weights (a debug Mixtral widened to `--hidden`, `--layers` decoder layers, its experts on one in-process
ExpertManager), `--micro-batches` micro-batches of `--rows` x `--seq` tokens a step, `train_step` with AdamW:

    resident_serial    the backbone resident, micro-batches one at a time (vela-ray's serial step)
    resident_gpipe     GPipe in device memory only: resident, the micro-batches in flight on threads
    naive_offload      GPipe with naive offload: `masters.streaming` with `prefetch: false`, micro-batches in flight
                       passing the slots in step; each layer uploaded when it runs, its compute waiting for the copy
    prefetch_serial    Mobius's prefetch, micro-batches one at a time: every micro-batch streams every layer again
    prefetch_gpipe     Mobius's (and APTMoE's backbone) schedule: prefetch, micro-batches in flight passing the
                       slots in step (`training.step._through_the_buffer`)
    prefetch_gpipe_offload  the same, the saved activations beyond `--activation-budget` offloaded to host memory

Reported per setup: median step seconds and the ratio to resident_serial, uploads and upload MiB per step, the most
the slots held, the device's saved-activation peak and what was offloaded, and the last loss (every setup computes
the same numbers: the streamed ones equal the resident serial to rounding). What the figures leave out: on a CPU
the "device" is the stand-in `vela_ray.model.streaming` describes (an upload is a copy on a background thread, which
competes with the compute for the same cores rather than crossing PCIe), so the times say what the schedule costs
in bookkeeping and copies here, not what a GPU gains; uploads, bytes and peaks are the same on a GPU. The experts'
side (their tiers, APTMoE's other half) is off, so only the master's backbone differs between setups.

    python benchmarks/streaming_schedules.py --out benchmarks/results/streaming_schedules.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/streaming_schedules.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import command, parser, write_results  # noqa: E402
from placement import sequential_table  # noqa: E402
from vela_ray.model.experts import LoraSpec  # noqa: E402
from vela_ray.model.families import debug_model  # noqa: E402
from vela_ray.model.streaming import stream_backbone  # noqa: E402
from vela_ray.training.master import build_local  # noqa: E402
from vela_ray.training.schedule import OptimizerConfig  # noqa: E402
from vela_ray.training.step import train_step  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "streaming_schedules.json"
MiB = 2**20
# setup -> (streamed, prefetch, micro-batches in flight: 0 for all of them, activations offloaded)
SETUPS = {"resident_serial": (False, True, 1, False), "resident_gpipe": (False, True, 0, False),
          "naive_offload": (True, False, 0, False), "prefetch_serial": (True, True, 1, False),
          "prefetch_gpipe": (True, True, 0, False), "prefetch_gpipe_offload": (True, True, 0, True)}


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, RESULTS)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--buffer-blocks", type=int, default=2)
    p.add_argument("--activation-budget", type=int, default=4 * MiB, help="prefetch_gpipe's, in bytes")
    p.add_argument("--steps", type=int, default=6, help="steps per setup; the first is left out of the median")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    config = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8)
    generator = torch.Generator().manual_seed(0)
    vocab = debug_model("mixtral", **config).config.vocab_size
    batches = [[{"input_ids": (ids := torch.randint(3, vocab, (args.rows, args.seq), generator=generator)).to(device),
                 "labels": ids.to(device)} for _ in range(args.micro_batches)] for _ in range(args.steps)]
    results = {name: run_setup(name, config, batches, device, args) for name in SETUPS}
    base = results["resident_serial"]["median_step_s"]
    for result in results.values():
        result["step_vs_resident_serial"] = result["median_step_s"] / base
    payload = {"command": command(__file__, argv), "device": str(device), "torch_threads": torch.get_num_threads(),
               "model": {"family": "mixtral", **config}, "micro_batches": args.micro_batches,
               "tokens_per_micro_batch": args.rows * args.seq, "buffer_blocks": args.buffer_blocks,
               "activation_budget_bytes": args.activation_budget, "steps": args.steps, "setups": results}
    print(table(results))
    write_results(args.out, payload)
    return payload


def run_setup(name: str, config: dict, batches: list, device: torch.device, args) -> dict:
    streamed, prefetch, in_flight, offload = SETUPS[name]
    in_flight = in_flight or args.micro_batches
    model = debug_model("mixtral", seed=0, **config)
    table = sequential_table(args.layers, model.config.num_local_experts, 1)
    master, workers = build_local(model, table, LoraSpec(r=8, alpha=16), OptimizerConfig(lr=1e-4))
    stream = None
    if streamed:
        budget = args.activation_budget if offload else None
        master.stream = stream = stream_backbone(master.peft_model, args.buffer_blocks, device,
                                                 activation_budget=budget, prefetch=prefetch)
    else:
        master.peft_model.to(device)
    seconds, losses, uploads = [], [], []
    for micro in batches:
        before = stream.uploads if stream else 0
        start = time.perf_counter()
        losses.append(train_step(master, workers, micro, 1e-4, None, in_flight=in_flight))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        uploads.append((stream.uploads if stream else 0) - before)
    result = {"median_step_s": statistics.median(seconds[1:]), "last_loss": losses[-1],
              "uploads_per_step": statistics.median(uploads[1:]), "in_flight": in_flight}
    if stream is not None:
        block_mib = max(block.upload_bytes for block in stream.blocks) / MiB
        result.update(upload_mib_per_step=result["uploads_per_step"] * block_mib,
                      slots_peak_mib=stream.peak_bytes / MiB, frozen_layers_mib=stream.frozen_bytes / MiB,
                      activation_peak_mib=stream.peak_activation_bytes / MiB,
                      offloaded_mib_total=stream.offloaded_bytes / MiB)
        stream.close()
    print(f"{name}: {result['median_step_s']:.3f} s/step, {result['uploads_per_step']} uploads/step", flush=True)
    return result


def table(results: dict) -> str:
    lines = [f"{'setup':<24}{'s/step':>8}{'x serial':>10}{'uploads':>9}{'MiB up':>9}{'slots MiB':>11}{'loss':>10}"]
    for name, r in results.items():
        lines.append(f"{name:<24}{r['median_step_s']:>8.3f}{r['step_vs_resident_serial']:>10.2f}"
                     f"{r['uploads_per_step']:>9}{r.get('upload_mib_per_step', 0):>9.1f}"
                     f"{r.get('slots_peak_mib', 0):>11.1f}{r['last_loss']:>10.5f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
