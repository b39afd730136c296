"""A quick look at what a model (and adapter) generates: `vela generate`, and the report's Samples section.

    vela generate --model MODEL_DIR [--adapter ADAPTER_DIR] --prompt "To be, or not"

Generation is greedy (deterministic), with a repetition penalty (`REPETITION_PENALTY`), and bounded
(`max_new_tokens`). A chat model's prompt (its tokenizer has a chat template) goes in as one user turn
under that template, ready for the assistant.

At the end of a run, `add_samples(config)` (the driver, after the job) loads the base model on the
driver's CPU, generates for a few prompts (`report.prompts`, else the start of a few evaluation rows:
the tokens before the first supervised label, or a text row's first whole lines) with the base model and
with the run's exported adapter, and writes `output.dir/samples.json`, which the report shows side by
side; models over `report.samples_max_params` parameters are skipped with the reason logged.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import time
from pathlib import Path
from typing import Iterator

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from vela_ray.data.datasets import build_dataset
from vela_ray.data.examples import IGNORE_INDEX
from vela_ray.model.loading import meta_model
from vela_ray.model.merging import peft_layout
from vela_ray.observability.report import write_report
from vela_ray.observability.samples import Sample, SamplesRecord
from vela_ray.quiet import no_progress_bars
from vela_ray.storage import is_remote, pull_outputs, push_outputs

logger = logging.getLogger(__name__)

PROMPT_TOKENS = 24  # a text row's prompt: its first whole lines, at most this many tokens
# Greedy decoding of a small model falls into a loop it cannot leave ("AAAAAAAA...", "== Ray ==\n\n== Ray ==..."):
# the argmax after a token is often that token again. CTRL's penalty (Keskar et al. 2019: 1.2, with greedy
# decoding) scales down the scores of the tokens already in the text, so a loop loses to the next likeliest
# token, and the output stays deterministic.
REPETITION_PENALTY = 1.2


def load(model_dir: str | Path, adapter_dir: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer): `model_dir` with the adapter `adapter_dir` applied, if given: a peft
    adapter, or a per-expert export (`vela export --format per-expert`), whose expert factors peft alone would
    drop (`peft_layout` gathers them into peft's layout)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model_dir} is not a model directory (no config.json)")
    if adapter_dir is not None and not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise ValueError(f"--adapter {adapter_dir} is not a peft adapter directory (no adapter_config.json)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if adapter_dir is not None:
        with peft_layout(adapter_dir, model_dir) as applicable:
            model = PeftModel.from_pretrained(model, str(applicable))
    return model.eval(), tokenizer


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids of `prompt`: one user turn under the chat template of a chat model, else the text."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


# Below this many parameters a model generates on one intra-op thread: a token's matrix products are too small to
# split, and OpenMP threads wait for each other at every one (a debug-size model's 3 prompts x 32 tokens, base and
# tuned: 4.7-8 s on 2 threads of a busy 2-core machine, 1.4-2.3 s on 1).
ONE_THREAD_PARAMS = 100e6


@contextlib.contextmanager
def _threads_for(model: torch.nn.Module) -> Iterator[None]:
    """One torch thread while `model` generates if it has under `ONE_THREAD_PARAMS` parameters, else as set
    (a GPU model's generation is the GPU's: the count only decides the host's threads)."""
    threads = torch.get_num_threads()
    if sum(p.numel() for p in model.parameters()) < ONE_THREAD_PARAMS:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def continuation(model, tokenizer, ids: list[int], max_new_tokens: int = 64,
                 repetition_penalty: float = REPETITION_PENALTY) -> list[int]:
    """The greedy continuation of `ids` under `repetition_penalty` (1: none): at most `max_new_tokens` token
    ids, fewer at EOS."""
    if not ids:
        raise ValueError("the prompt is empty")
    input_ids = torch.tensor([ids], device=model.device)
    with _threads_for(model):
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens,
                             pad_token_id=_pad_id(tokenizer, model))
    return out[0, len(ids):].tolist()


def generate_ids(model, tokenizer, ids: list[int], max_new_tokens: int = 64) -> str:
    """Greedy continuation of `ids` (at most `max_new_tokens`), decoded without the prompt."""
    return tokenizer.decode(continuation(model, tokenizer, ids, max_new_tokens), skip_special_tokens=True)


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 64) -> str:
    return generate_ids(model, tokenizer, prompt_ids(tokenizer, prompt), max_new_tokens)


def _pad_id(tokenizer, model) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, model.config.get_text_config().eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


# --------------------------------------------------------------------------------------------------
# The run's samples
# --------------------------------------------------------------------------------------------------


def eval_prompts(data, tokenizer, count: int) -> list[list[int]]:
    """The prompts of the first `count` rows of `data` (a `TokenizedDataset`): the tokens before the first
    supervised label (instruct and chat data), or a text row's first whole lines (`text_prompt`)."""
    prompts = []
    for row in range(min(count, len(data))):
        ids = data.input_ids[row][data.attention_mask[row].bool()]
        labels = data.labels[row][data.attention_mask[row].bool()]
        supervised = (labels != IGNORE_INDEX).nonzero()
        first = int(supervised[0]) if len(supervised) else len(ids)
        # text rows are supervised from the start (their first label is the second token)
        prompts.append(ids[:first].tolist() if first > 1 else text_prompt(tokenizer, ids.tolist()))
    return prompts


def text_prompt(tokenizer, ids: list[int], max_tokens: int = PROMPT_TOKENS) -> list[int]:
    """A text row's prompt: from its first line start, the whole lines that fit in `max_tokens` tokens, else
    the whole words of that first line that do; the row's first tokens where not even a word fits.

    A packed row starts wherever the one before it stopped, often mid-word ("itizen:"): a prompt cut there
    shows the model a fragment it never sees in text, and the reader a broken sample."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    rest = text[text.find("\n") + 1 or text.find(" ") + 1:].lstrip("\n")  # from a line start, else a word start
    line_ends = [m.end() for m in re.finditer("\n", rest)]  # the row's last line, cut by the row's end, is not one
    word_ends = [m.end() for m in re.finditer(r"\S+(?=\s)", rest.split("\n", 1)[0])]
    for ends in (line_ends, word_ends):
        fitting = list(itertools.takewhile(lambda end: _count(tokenizer, rest[:end]) <= max_tokens, ends))
        if fitting and rest[:fitting[-1]].strip():
            return tokenizer(rest[:fitting[-1]], add_special_tokens=False)["input_ids"]
    return ids[:min(max_tokens, max(1, len(ids) // 2))]


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def model_params(model_dir: str | Path) -> int:
    """Parameters of the model in `model_dir`, counted on the meta device (nothing loaded)."""
    return sum(p.numel() for p in meta_model(model_dir).parameters())


def run_samples(model_dir: Path, adapter_dir: Path, prompts: list[list[int]] | list[str],
                max_new_tokens: int) -> SamplesRecord:
    """Greedy generations (`continuation`) of the base model and of base + adapter for each prompt (text or token
    ids)."""
    base, tokenizer = load(model_dir)
    ids = [prompt_ids(tokenizer, p) if isinstance(p, str) else p for p in prompts]
    start = time.perf_counter()
    base_out = [generate_ids(base, tokenizer, i, max_new_tokens) for i in ids]
    tuned = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    tuned_out = [generate_ids(tuned, tokenizer, i, max_new_tokens) for i in ids]
    seconds = time.perf_counter() - start
    texts = [p if isinstance(p, str) else tokenizer.decode(i, skip_special_tokens=False) for p, i in zip(prompts, ids)]
    return SamplesRecord(samples=[Sample(prompt=t, base=b, tuned=u) for t, b, u in zip(texts, base_out, tuned_out)],
                         max_new_tokens=max_new_tokens, repetition_penalty=REPETITION_PENALTY, seconds=seconds)


def add_samples(config) -> SamplesRecord | None:
    """The end of a run (a `JobConfig`): write `samples.json` into output.dir and rebuild the report with it.
    None when the config asks for no samples; a record with `skipped` when they cannot be made here."""
    report, out_dir = config.report, config.output_local_dir
    if report.samples == 0 and not report.prompts:
        return None
    remote = is_remote(config.output.dir)
    if remote:  # the run's outputs as uploaded (the master may have run on another node)
        pull_outputs(config.output.dir, out_dir, fresh=False)
    adapter = out_dir / "adapter"
    try:
        record = _samples_or_reason(config, adapter)
    except Exception as err:  # noqa: BLE001 - the run is done and saved: samples never fail it
        logger.warning("report samples failed", exc_info=True)
        record = SamplesRecord(skipped=f"generating failed: {type(err).__name__}: {err}")
    record.write(out_dir)
    if record.skipped:
        logger.info("report samples skipped: %s", record.skipped)
    if (out_dir / "summary.json").is_file():
        write_report(out_dir)
    if remote:
        push_outputs(config.output.dir, out_dir)
    return record


def _samples_or_reason(config, adapter: Path) -> SamplesRecord:
    report = config.report
    if not (adapter / "adapter_config.json").is_file():
        return SamplesRecord(skipped=f"the run wrote no adapter ({adapter})")
    if config.model.trust_remote_code:
        return SamplesRecord(skipped="the model runs its own code (model.trust_remote_code); generate with "
                                     "`vela generate` where that is wanted")
    params = model_params(config.model.path)
    if params > report.samples_max_params:
        return SamplesRecord(skipped=f"the model has {params / 1e9:.1f}B parameters, over report.samples_max_params "
                                     f"({report.samples_max_params / 1e9:.1f}B) for generating on the driver's CPU")
    prompts: list = list(report.prompts)
    if not prompts:
        tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        data = build_dataset(config.data, tokenizer, warn=False)
        _, held_out = data.split(config.training.eval_fraction, config.training.seed)
        prompts = eval_prompts(held_out, tokenizer, report.samples)
    return run_samples(Path(config.model.path), adapter, prompts, report.max_new_tokens)
