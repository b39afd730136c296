"""The `vela` command line.

Each subcommand is registered by one `_add_<name>` function below and runs a
handler that imports its module lazily, so `vela place` never loads torch and
`vela --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from typing import Callable

from vela_ray.errors import first_line

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vela", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from vela_ray.quiet import silence_known_warnings

    args = build_parser().parse_args(argv)
    silence_known_warnings()  # every command (export's peft skeletons, preflight's checks), not only train's run
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C before a run can stop between steps (preflight, Ray's start): one line
        print(f"vela {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except ValueError as err:  # user-caused errors: message only, no traceback
        return _fail(args, err, code=2)
    except Exception as err:  # the run failed (a worker lost, an actor's error): one line, the cause
        from vela_ray.errors import RunInterrupted

        logging.getLogger("vela_ray.cli").debug("traceback", exc_info=True)
        code = 130 if isinstance(err, RunInterrupted) else 1
        return _fail(args, err, code, hint="" if args.verbose or code == 130 else " (-v for the traceback)")


def _fail(args: argparse.Namespace, err: BaseException, code: int, hint: str = "") -> int:
    kind = "" if isinstance(err, ValueError) or type(err).__module__.startswith("vela_ray") else f"{type(err).__name__}: "
    message = first_line(err)
    if getattr(args, "config", None):  # the resume command a run's error gives, with the config it was run with
        message = message.replace("vela train --config ...", f"vela train --config {shlex.quote(args.config)}")
    print(f"vela {args.command}: error: {kind}{message}{hint}", file=sys.stderr)
    return code


# --- subcommands -------------------------------------------------------------

_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def _subcommand(fn: Callable[[argparse._SubParsersAction], None]):
    _SUBCOMMANDS.append(fn)
    return fn


@_subcommand
def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure expert access probabilities P[L, E] of a model on data")
    p.add_argument("--model", required=True, type=Path, help="model directory (save_pretrained layout)")
    p.add_argument("--data", required=True, type=Path, help="text file / directory, or Alpaca .json / .jsonl")
    p.add_argument("--kind", choices=["text", "instruct", "chat", "preference", "unpaired_preference"],
                   help="data kind (default: text for .txt files and directories of them, else instruct)")
    p.add_argument("--name", help="the entry of a LLaMA-Factory dataset_info.json to read (--data: that file or "
                                  "its directory)")
    p.add_argument("--chat-template", help="chat, preference: Jinja template file or string (default: the "
                                         "tokenizer's)")
    p.add_argument("--packing", action="store_true", help="instruct/chat: several examples per row")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row (default 128)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (default 8)")
    p.add_argument("--batches", type=int, help="profile only the first N batches (default: all data)")
    p.add_argument("--out", required=True, type=Path, help="profile JSON to write")
    p.add_argument("--npy", type=Path, help="also write P [L, E] as .npy (the input of `vela place`)")
    p.add_argument("--plot", type=Path, help="directory for access-heatmap and confidence-CDF PNGs")
    p.set_defaults(handler=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vela_ray.observability import plots
    from vela_ray.data.config import DataConfig
    from vela_ray.data.datasets import build_dataset, sequential_batches
    from vela_ray.data.locality import profile_model

    if not (args.model / "config.json").is_file():
        raise ValueError(f"--model {args.model} is not a model directory (no config.json)")
    limit = args.batches * args.batch_size if args.batches else None
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = DataConfig(**_profile_data(args), seq_len=args.seq_len, limit=limit, packing=args.packing,
                      chat_template=args.chat_template)
    dataset = build_dataset(data, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    profile = profile_model(model, sequential_batches(dataset, args.batch_size, token_mask=True), progress=True,
                            source=f"{args.model} on {data.path} ({data.kind}, seq_len {args.seq_len})")
    profile.save(args.out, args.npy)
    if args.plot:
        plots.plot_access_heatmaps({args.data.name: profile.probs_array()}, args.plot / "access_heatmap.png",
                                   profile.top_k)
        plots.plot_confidence_cdf({args.data.name: profile}, 0, args.plot / "confidence_cdf.png")
    logging.getLogger("vela_ray.cli").info("profiled %d tokens over %d MoE layers -> %s",
                                           profile.tokens, profile.num_layers, args.out)
    return 0


@_subcommand
def _add_build_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-tiny-model", help="pre-train the tiny local Mixtral of the locality study (cached)")
    p.add_argument("--corpus", type=Path, help="plain-text pre-training corpus (default: WikiText-2 valid)")
    p.add_argument("--steps", type=int, help="pre-training steps")
    p.add_argument("--layers", dest="num_layers", type=int, help="decoder layers")
    p.add_argument("--hidden", dest="hidden_size", type=int, help="hidden size")
    p.add_argument("--experts", dest="num_experts", type=int, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, help="experts per token")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary size")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--out", type=Path, help="build into this directory instead of the cache")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: the idle cores)")
    p.set_defaults(handler=_run_build_tiny_model)


def _run_build_tiny_model(args: argparse.Namespace) -> int:
    from vela_ray.training.tiny_model import TinyModelConfig, build_tiny_model, tiny_model_path

    fields = ("corpus", "steps", "num_layers", "hidden_size", "num_experts", "top_k", "vocab_size", "seed")
    config = TinyModelConfig(**{f: getattr(args, f) for f in fields if getattr(args, f) is not None})
    if args.out:
        build_tiny_model(config, args.out, num_threads=args.threads)
        print(args.out)
    else:
        print(tiny_model_path(config, num_threads=args.threads))
    return 0


@_subcommand
def _add_place(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("place", help="place experts on workers to minimise expected communication time")
    p.add_argument("--problem", type=Path, help="YAML/JSON problem file (instead of the flags below)")
    p.add_argument("--profile", help="routing profile [layers, experts]: .npy or .json (e.g. vela profile's)")
    p.add_argument("--bandwidths", help="master-to-worker bandwidth per worker in GB/s: comma list or file")
    p.add_argument("--capacities", help="experts per worker: one integer for all, or a comma list")
    p.add_argument("--nodes", help="node id per worker, comma list (enables cross-node bytes)")
    p.add_argument("--master-node", help="node id of the master")
    p.add_argument("--nic", type=float, help="NIC bandwidth of every node in GB/s: cross-node rows share the "
                   "master node's NIC and their node's (needs --nodes and --master-node)")
    p.add_argument("--tokens", type=int, help="tokens per step entering each MoE layer (batch x sequence; "
                   "default 4096: it scales the printed times, not the placement)")
    p.add_argument("--hidden", type=int, help="hidden size, elements per token row (default 4096, likewise)")
    p.add_argument("--bits", type=int, default=16, help="bits per element (default 16)")
    p.add_argument("--top-k", type=int, help="experts per token (default: inferred from the profile's row sums)")
    p.add_argument("--forward-only", action="store_true", help="count the forward pass only (default: forward + backward)")
    p.add_argument("--solver", default="improved", help="sequential, random, vela or improved (default)")
    p.add_argument("--direct", action="store_true", help="solve the paper's per-worker LP instead of the class-aggregated one")
    p.add_argument("--seed", type=int, default=0, help="seed for random and improved (default 0)")
    p.add_argument("--time-budget", type=float, default=10.0, help="seconds the improved solver may use (default 10)")
    p.add_argument("--model", type=Path, help="checkpoint dir: print the bytes one of its experts takes on a worker "
                   "(with --quantization, in that format) and, with --memory, size the capacities by them")
    p.add_argument("--quantization", choices=["fp8", "int8", "nf4", "mxfp4"],
                   help="with --model: the experts' frozen weights held in this format (model.quantization)")
    p.add_argument("--memory", type=float, help="with --model: GB per worker for experts (instead of --capacities)")
    p.add_argument("--out", type=Path, help="write the placement here as JSON")
    p.set_defaults(handler=_run_place)


def _run_place(args: argparse.Namespace) -> int:
    from placement import PlacementProblem, build_problem, solve, solve_lp
    from placement.io import check_writable
    from placement.options import assumed_sizes_note, fields_from_options
    from placement.report import format_summary

    if args.problem and args.profile:
        raise ValueError("give either --problem or --profile (with --bandwidths, --capacities, ...), not both")
    if args.out:
        check_writable(args.out)  # before solving: a bad path must not cost the solve, nor follow its output
    note = None
    sizing = _expert_sizing(args)  # before the problem: --memory fills --capacities
    if args.problem:
        problem = PlacementProblem.from_file(args.problem)
    elif args.profile and args.bandwidths and args.capacities:
        problem = build_problem(**fields_from_options(
            profile=args.profile, bandwidths_gb_s=args.bandwidths, capacities=args.capacities,
            tokens_per_step=args.tokens, hidden_size=args.hidden, bits_per_element=args.bits,
            top_k=args.top_k, nodes=args.nodes, master_node=args.master_node,
            include_backward=not args.forward_only, nic_gb_s=args.nic,
        ))
        note = assumed_sizes_note(args.tokens, args.hidden)
    else:
        raise ValueError("give --problem FILE, or --profile with --bandwidths and --capacities")
    placement = solve(problem, args.solver, seed=args.seed, time_budget_s=args.time_budget, direct=args.direct)
    lower_bound = placement.lower_bound or solve_lp(problem, direct=args.direct)[0]
    print("\n".join(filter(None, [note, sizing, format_summary(problem, placement, lower_bound)])))
    if args.out:
        try:
            placement.to_json(args.out)
        except OSError as err:  # checked above, so only if the disk or permissions changed meanwhile
            raise ValueError(f"--out {str(args.out)!r} cannot be written: {err.strerror}") from None
        print(f"placement written to {args.out}")
    return 0


def _expert_sizing(args: argparse.Namespace) -> str | None:
    """With --model: one line on the bytes one expert's frozen weights take on a worker (at the checkpoint's width,
    the format it ships in, or --quantization's), and with --memory the capacity they give (set in `args`)."""
    if args.model is None:
        if args.quantization or args.memory:
            raise ValueError("--quantization and --memory size the experts of a --model: give the checkpoint dir")
        return None
    import json

    from vela_ray.model.dtypes import torch_dtype
    from vela_ray.model.loading import checkpoint_prototypes
    from vela_ray.model.quantized_model import frozen_bytes_per_expert
    from vela_ray.model.shipped import shipped_format

    config = json.loads((args.model / "config.json").read_text())
    dtype = torch_dtype(config.get("dtype") or config.get("torch_dtype") or "float32")
    fmt = args.quantization or shipped_format(args.model)
    prototypes = checkpoint_prototypes(args.model)
    per_expert = max(frozen_bytes_per_expert(p, fmt, dtype) for p in prototypes.values())
    line = f"frozen weights per expert: {per_expert / 1e6:.2f} MB ({fmt or dtype})"
    if args.memory:
        if args.capacities:
            raise ValueError("give --capacities or --memory, not both")
        capacity = int(args.memory * 1e9 // per_expert)
        if capacity < 1:
            raise ValueError(f"--memory {args.memory} GB holds no expert of {per_expert / 1e9:.2f} GB")
        args.capacities = str(capacity)
        line += f"; {args.memory:g} GB per worker holds {capacity} (LoRA state and activations not counted)"
    return line


def _profile_data(args: argparse.Namespace) -> dict:
    """Where `vela profile` reads: a dataset_info entry (`--name`, whose entry decides the kind unless `--kind`
    says), else `--data` with `--kind` or the kind its name suggests."""
    from vela_ray.data.datasets import TEXT_SUFFIXES

    if args.name:
        source = "dataset_info" if args.data.name == "dataset_info.json" else "path"
        return {source: args.data, "name": args.name, **({"kind": args.kind} if args.kind else {})}
    saved_dataset = (args.data / "dataset_info.json").is_file()  # a datasets save_to_disk directory
    text = args.data.suffix in TEXT_SUFFIXES or (args.data.is_dir() and not saved_dataset)
    return {"path": args.data, "kind": args.kind or ("text" if text else "instruct")}


@_subcommand
def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="fine-tune a MoE model with vela-ray (local Ray or RAY_ADDRESS)")
    p.add_argument("--config", required=True, help="job YAML (see deploy/ for examples)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="DIR|latest",
                   help="continue from a checkpoint (default: the latest valid one under the checkpoint dir)")
    p.add_argument("--overwrite", action="store_true",
                   help="output.dir holds another run: move it aside to <dir>.old-<run id> instead of refusing")
    p.set_defaults(handler=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from vela_ray.config import JobConfig
    from vela_ray.errors import StartupInterrupts

    StartupInterrupts.install()  # a Ctrl-C from here on ends the start-up, even one lost where Python raised it

    config = JobConfig.from_yaml(args.config).with_resume(args.resume)  # a typo fails here, before torch loads
    if args.overwrite:
        config = config.model_copy(update={"output": config.output.model_copy(update={"overwrite": True})})
    checked = config.preflight()  # and a file or capacity problem here, before Ray loads

    from vela_ray.api import VelaJob
    from vela_ray.observability.report import summary_text

    print(summary_text(VelaJob(checked).run()))
    return 0


@_subcommand
def _add_families(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("families", help="the MoE families of the installed transformers: trained, or refused and why")
    p.set_defaults(handler=_run_families)


def _run_families(args: argparse.Namespace) -> int:
    from vela_ray.model.families import family_support
    from vela_ray.training.family_check import suite_verified, verified_families

    support = family_support()
    tested = verified_families()
    width = max(map(len, support))
    by_suite = {family for family, reason in support.items() if reason is None and suite_verified(family)}
    for family, reason in support.items():
        if reason is not None:
            status = "refused: " + reason
        elif family in by_suite:
            status = f"trained (equal to peft), verified by the test suite on transformers {tested.transformers}"
        else:
            status = "trained if preflight shows a debug-size copy equal to peft (not verified by the test suite here)"
        print(f"{family:<{width}}  {status}")
    trained = sum(r is None for r in support.values())
    print(f"{trained} of {len(support)} families trained: {len(by_suite)} verified by the test suite, "
          f"{trained - len(by_suite)} checked at preflight")
    return 0


@_subcommand
def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="fine-tune the tiny pre-trained MoE on Tiny Shakespeare over 3 workers")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the demo's, vela_ray.demo.DEMO_STEPS)")
    p.add_argument("--out", default="runs/demo", help="output directory")
    p.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from vela_ray.api import VelaJob
    from vela_ray.demo import DEMO_STEPS, demo_config
    from vela_ray.observability.report import summary_text

    steps = DEMO_STEPS if args.steps is None else args.steps
    print(summary_text(VelaJob(demo_config(args.out, steps)).run()))
    return 0


def _run_location(arg: str) -> Path:
    """A run directory or checkpoint named on the command line, as a local directory: a URI on object storage
    is downloaded first (a checkpoint verified in full, a run's outputs without its checkpoints)."""
    from vela_ray.storage import is_remote, local_mirror, name_of, pull_outputs

    if not is_remote(arg):
        return Path(arg)
    from vela_ray.training.checkpoint import local_copy

    if name_of(arg).startswith("step-"):
        return local_copy(arg.rstrip("/"))
    return pull_outputs(arg.rstrip("/"), local_mirror(arg.rstrip("/")), fresh=False)


@_subcommand
def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="summarise a finished run and write its self-contained HTML report")
    p.add_argument("run_dir", help="the run's output.dir (holds summary.json), a directory or "
                   "a URI on object storage (s3://..., read into a local copy)")
    p.add_argument("--out", type=Path, help="HTML file to write (default: RUN_DIR/report.html, for a URI its "
                   "local copy's)")
    p.set_defaults(handler=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from vela_ray.observability.report import summary_text, write_report

    run_dir = _run_location(args.run_dir)
    print(summary_text(run_dir))
    print(f"report: {write_report(run_dir, args.out)}")
    return 0


@_subcommand
def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a run or checkpoint for serving: peft adapter, merged model, per-expert")
    p.add_argument("run", help="a run's output.dir, or one of its checkpoints (step-*): a "
                   "directory or a URI on object storage (s3://..., read into a local copy)")
    p.add_argument("--format", required=True, choices=["peft", "merged", "per-expert"],
                   help="peft: the adapter as trained; merged: base model with the LoRA folded in, in the base "
                        "checkpoint's layout; per-expert: the adapter under per-expert module names")
    p.add_argument("--out", required=True, type=Path, help="directory to write (must be empty, or --force)")
    p.add_argument("--model", type=Path, help="the base model dir (default: the run's model.path)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from vela_ray.export import export_run

    exported = export_run(_run_location(args.run), args.format, args.out, model_dir=args.model, force=args.force)
    print(f"{exported.format} export of {exported.source} -> {exported.out_dir}"
          + (f"\n{exported.note}" if exported.note else ""))
    return 0


@_subcommand
def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="greedy generation from a model (and adapter), for a quick look")
    p.add_argument("--model", required=True, type=Path, help="model directory (a base or a merged export)")
    p.add_argument("--adapter", type=Path, help="peft adapter directory to apply (a run's adapter/ or an export)")
    p.add_argument("--prompt", required=True, help="the prompt (a chat model's goes in as one user turn)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from vela_ray.generate import generate, load

    model, tokenizer = load(args.model, args.adapter)
    print(generate(model, tokenizer, args.prompt, args.max_new_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
