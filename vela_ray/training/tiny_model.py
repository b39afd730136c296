"""A tiny pre-trained Mixtral-architecture MoE model, built locally on CPU (no model hub).

The locality study and tests need a *pre-trained* MoE model: routing of a random
model carries no locality. `build_tiny_model` trains a byte-level BPE tokenizer
on a corpus (WikiText-2 by default, its tokenisation undone), pre-trains a small
`MixtralForCausalLM` (load-balancing aux loss on, AdamW, warmup + cosine) for a
bounded number of steps, showing its progress (`vela_ray.progress`), and saves model and tokenizer so
that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load them.
`tiny_model_path(config)` caches the result under ``cache_dir()/tiny-mixtral-<hash of the build settings>``
and builds only if missing (into a temporary directory renamed into place, so a killed build never leaves a
half model; a build another live process has under way is waited for, not repeated).
``vela build-tiny-model`` does the same from the command line. Usage::

    model_dir = tiny_model_path()            # default build: ~2 min on 2 idle cores, ~4 on 1
    model = AutoModelForCausalLM.from_pretrained(model_dir)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, MixtralConfig, PreTrainedTokenizerFast

from vela_ray.data.datasets import TokenizedDataset, iterate_batches, pack_string, pack_text, sequential_batches
from vela_ray.data.locality import profile_model, skew_per_layer
from vela_ray.paths import cache_dir, data_dir
from vela_ray.progress import Progress
from vela_ray.quiet import no_progress_bars

log = logging.getLogger(__name__)

# bump when the build recipe changes, to invalidate cached models (2: chat template, 3: WikiText detokenised,
# 4: WikiText's <unk> left out)
BUILD_VERSION = 4
BUILD_INFO = "build_info.json"
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
# ChatML-like: BOS, then each message as "<|role|>\n{content}" + "\n" (EOS right after an assistant's
# content, so the model learns to stop). Each turn renders the same whatever follows it (prefix-stable),
# which `vela_ray.data.chat.encode_chat` needs to find the assistant tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def cpu_threads() -> int:
    """Torch threads for CPU training: the cores idle now, at least 1 (all of them on an idle machine).

    OpenMP threads wait for each other at every parallel region, so on a shared
    machine more threads than idle cores make training up to ~10x slower
    (measured: 0.64 s/step on 1 thread vs 6.3 s/step on 2 with a load of 6 on 2 cores;
    again 1.56 vs 0.20 steps/s at a load of 6-10). Busy cores are measured over the
    last second (/proc/stat), not the 1-minute load average, which stays high for a
    minute after other work (a `make setup`) has finished.
    """
    cores = os.cpu_count() or 1
    return max(1, min(cores, round(cores - _busy_cores(cores))))


def _busy_cores(cores: int, window: float = 1.0) -> float:
    """Cores busy over the last `window` seconds (Linux /proc/stat), else the 1-minute load average."""
    def busy_and_total() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    try:
        busy0, total0 = busy_and_total()
        time.sleep(window)
        busy1, total1 = busy_and_total()
        return cores * (busy1 - busy0) / max(total1 - total0, 1)
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def _default_corpus() -> Path:
    return data_dir() / "wikitext-2" / "valid.txt"


def default_skew_data() -> Path:
    """The fine-tuning data the build reports router skew on (Tiny Shakespeare)."""
    return data_dir() / "tinyshakespeare" / "input.txt"


class TinyModelConfig(BaseModel):
    """Settings of a tiny Mixtral build; all of them (and the corpus content) key the cache."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    corpus: Path = Field(default_factory=_default_corpus)
    """Plain-text pre-training corpus (also trains the tokenizer)."""
    max_corpus_chars: int | None = Field(default=None, ge=1000)
    """Use only the first this many characters of the corpus."""
    vocab_size: int = Field(default=4096, ge=300)
    """Byte-level BPE vocabulary size (including 256 byte tokens and 3 special tokens)."""
    num_layers: int = Field(default=4, ge=1)
    hidden_size: int = Field(default=128, ge=8)
    intermediate_size: int = Field(default=256, ge=8)
    """Hidden size of each expert's gated MLP."""
    num_heads: int = Field(default=4, ge=1)
    num_kv_heads: int = Field(default=2, ge=1)
    num_experts: int = Field(default=8, ge=2)
    top_k: int = Field(default=2, ge=1)
    router_aux_loss_coef: float = Field(default=0.01, ge=0.0)
    """Weight of the load-balancing aux loss in the pre-training loss."""
    seq_len: int = Field(default=128, ge=8)
    batch_size: int = Field(default=16, ge=1)
    steps: int = Field(default=500, ge=1)
    """Optimizer steps of pre-training."""
    learning_rate: float = Field(default=3e-3, gt=0.0)
    """Peak AdamW learning rate (linear warmup, cosine decay to 10%)."""
    warmup_steps: int = Field(default=50, ge=0)
    seed: int = 0

    @model_validator(mode="after")
    def _check_shapes(self) -> TinyModelConfig:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}) "
                             f"and num_heads by num_kv_heads ({self.num_kv_heads})")
        return self

    def digest(self) -> str:
        """12 hex digits identifying the build: settings, corpus content and `BUILD_VERSION`."""
        if not self.corpus.is_file():
            raise ValueError(f"tiny-model corpus {self.corpus} is not a file")
        settings = self.model_dump(mode="json", exclude={"corpus"})
        corpus_sha = hashlib.sha256(self.corpus.read_bytes()).hexdigest()
        key = json.dumps({"settings": settings, "corpus": corpus_sha, "version": BUILD_VERSION}, sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    def mixtral_config(self, tokenizer: PreTrainedTokenizerFast) -> MixtralConfig:
        return MixtralConfig(
            vocab_size=len(tokenizer), hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, num_local_experts=self.num_experts,
            num_experts_per_tok=self.top_k, max_position_embeddings=max(2 * self.seq_len, 256),
            output_router_logits=True, router_aux_loss_coef=self.router_aux_loss_coef,
            tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )


# --- tokenizer -------------------------------------------------------------------------------


# WikiText is stored tokenised ("lobster , is a species", "well @-@ known", "do n't", " \n" ending every
# line). A model pre-trained on it as is never sees a comma, colon or newline right after a word, and
# puts ~e^-17 on them in ordinary text: on Tiny Shakespeare it started at loss 9.1, above a uniform
# guess (ln 4096 = 8.3); undone, 5.9. Ordinary text barely changes (13 of Tiny Shakespeare's 1.1M characters).
# Its rare words are all one placeholder, "<unk>" (5% of WikiText-2's words): kept, it was the model's likeliest
# word, and on Shakespeare's names and old words a greedy generation went "<unk> <unk> <unk> ...". Left out
# (with a hyphen that joined it, and the quotes or brackets it alone filled), the text around it stays.
_WIKITEXT_DETOKENISE = [
    (re.compile(r"(?: @.@)? <unk>(?: @.@(?= ))?"), ""),  # a species of <unk> lobster -> a species of lobster
    (re.compile(r' (?:" "|\( \))(?= )'), ""),  # called " <unk> " or ( <unk> ) , -> called ,
    (re.compile(r" @(.)@ "), r"\1"),  # 1 @,@ 000 -> 1,000; well @-@ known -> well-known; 0 @.@ 7 -> 0.7
    (re.compile(r" ([.,;:!?%)\]])(?=[\s.,;:!?'\")\]]|$)"), r"\1"),  # claws , and -> claws, and
    (re.compile(r"([(\[]) "), r"\1"),  # ( 24 in ) -> (24 in)
    (re.compile(r" (n't|'s|'re|'ve|'m|'ll|'d)(?=\s)"), r"\1"),  # do n't -> don't; Paul 's -> Paul's
    (re.compile(r"(?<=s) '(?=\s)"), "'"),  # Linnaeus ' concept -> Linnaeus' concept
    (re.compile(r'" ([^"\n]*?) "'), r'"\1"'),  # " lobster red " -> "lobster red"
    (re.compile(r"(?<==) (?==)"), ""),  # = = Description = = -> == Description ==
    (re.compile(r"^ | $", re.MULTILINE), ""),  # the space that opens and ends every line
]


def detokenise_wikitext(text: str) -> str:
    """`text` with WikiText's tokenisation undone (see `_WIKITEXT_DETOKENISE`)."""
    for pattern, replacement in _WIKITEXT_DETOKENISE:
        text = pattern.sub(replacement, text)
    return text


def corpus_text(config: TinyModelConfig) -> str:
    """The pre-training text: the corpus (its first `max_corpus_chars`), WikiText's tokenisation undone."""
    text = config.corpus.read_text(encoding="utf-8")
    return detokenise_wikitext(text[:config.max_corpus_chars] if config.max_corpus_chars else text)


def train_tokenizer(text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `text`, with <pad>, <s> (prepended by default) and </s>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS.values()), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


# --- pre-training ------------------------------------------------------------------------------


def _lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1, then cosine decay to 0.1 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def pretrain(model: torch.nn.Module, dataset: TokenizedDataset, config: TinyModelConfig) -> list[float]:
    """Train `model` in place for `config.steps` steps; returns the LM loss (without aux loss) per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, config.warmup_steps, config.steps))
    batches = iterate_batches(dataset, config.batch_size, config.seed, num_steps=config.steps)
    losses: list[float] = []
    model.train()
    tokens_per_step = config.batch_size * config.seq_len
    with Progress(config.steps, "pre-train tiny mixtral", tokens_per_step=tokens_per_step) as progress:
        for batch in batches:
            out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            aux_loss = float(out.aux_loss.detach())
            losses.append(float(out.loss.detach()) - config.router_aux_loss_coef * aux_loss)
            progress.update(loss=f"{losses[-1]:.3f}", aux=f"{aux_loss:.3f}")
    return losses


def report_router_skew(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, data: Path,
                       seq_len: int, max_batches: int = 16, batch_size: int = 16) -> dict:
    """Profile the start of `data` and log per-layer skew (sum of squared access shares) and busiest-expert share."""
    dataset = pack_text(tokenizer, data, seq_len, max_blocks=max_batches * batch_size)
    profile = profile_model(model, sequential_batches(dataset, batch_size), source=str(data))
    shares_LE = profile.probs_array() / profile.top_k
    report = {
        "data": str(data), "tokens": profile.tokens, "uniform": 1.0 / profile.num_experts,
        "skew_per_layer": skew_per_layer(profile.probs_array(), profile.top_k).round(4).tolist(),
        "busiest_expert_share": shares_LE.max(axis=1).round(4).tolist(),
        "mean_router_confidence": np.round(profile.confidence_mean, 4).tolist(),
    }
    log.info("router skew on %s (%d tokens): per-layer sum p^2 %s (uniform %.3f), busiest expert share %s, "
             "mean confidence %s", data.name, profile.tokens, report["skew_per_layer"], report["uniform"],
             report["busiest_expert_share"], report["mean_router_confidence"])
    return report


def _save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with no_progress_bars():  # no "Writing model shards" bar for one 17 MB file
        model.save_pretrained(out_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)


def build_tiny_model(config: TinyModelConfig, out_dir: Path, skew_data: Path | None = None,
                     num_threads: int | None = None) -> dict:
    """Train tokenizer and model per `config` and save both to `out_dir`; returns the build info.

    The build info (also written to ``out_dir/build_info.json``) holds the config,
    seconds, parameter count, first/last losses and the router skew on `skew_data`
    (default Tiny Shakespeare; skipped if the file is missing).
    """
    start = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or cpu_threads())
    log.info("building tiny mixtral %s on %d torch threads (%d cores)", config.digest(), torch.get_num_threads(),
             os.cpu_count() or 1)
    try:
        torch.manual_seed(config.seed)
        text = corpus_text(config)
        tokenizer = train_tokenizer(text, config.vocab_size)
        dataset = pack_string(tokenizer, text, config.seq_len, source=str(config.corpus))
        model = AutoModelForCausalLM.from_config(config.mixtral_config(tokenizer), dtype=torch.float32)
        losses = pretrain(model, dataset, config)
        model.eval()
        _save(model, tokenizer, out_dir)
        skew_data = skew_data or default_skew_data()
        skew = report_router_skew(model, tokenizer, skew_data, config.seq_len) if skew_data.is_file() else None
    finally:
        torch.set_num_threads(previous_threads)
    window = max(1, min(20, len(losses) // 4))
    info = {
        "config": config.model_dump(mode="json"), "digest": config.digest(),
        "seconds": round(time.perf_counter() - start, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus_tokens": dataset.num_tokens,
        "loss_first": float(np.mean(losses[:window])), "loss_last": float(np.mean(losses[-window:])),
        "losses": [round(x, 4) for x in losses], "router_skew": skew,
    }
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=1))
    log.info("built tiny mixtral (%.1fM parameters) in %.0f s: pre-training loss %.3f -> %.3f",
             info["parameters"] / 1e6, info["seconds"], info["loss_first"], info["loss_last"])
    return info


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _builders(target: Path) -> dict[int, Path]:
    """Builds of `target` under way: {their process id: their staging directory}."""
    found = {}
    for staging in target.parent.glob(f".{target.name}.building-*"):
        pid = staging.name.rsplit(".building-", 1)[1].split("-")[0]
        if pid.isdigit():
            found[int(pid)] = staging
    return found


def _remove_dead_staging(target: Path) -> None:
    """Delete staging directories of `target` left by builds whose process is gone (killed builds)."""
    for pid, staging in _builders(target).items():
        if not _process_alive(pid):
            log.info("removing %s left by an interrupted build", staging)
            shutil.rmtree(staging, ignore_errors=True)


def _await_other_builds(target: Path, poll_s: float = 1.0) -> None:
    """Wait while another live process builds `target` (a second run, or the test session's background build):
    the same minutes of CPU spent twice would only slow both. Returns when it is built or no builder is left."""
    waited = False
    while not (target / BUILD_INFO).is_file():
        others = [pid for pid in _builders(target) if pid != os.getpid() and _process_alive(pid)]
        if not others:
            return
        if not waited:
            log.info("waiting for process %d, which is building %s", others[0], target)
            waited = True
        time.sleep(poll_s)


def tiny_model_path(config: TinyModelConfig | None = None, build: bool = True,
                    num_threads: int | None = None) -> Path:
    """``cache_dir()/tiny-mixtral-<digest>``, built first if missing (and `build`; else ValueError)."""
    config = config or TinyModelConfig()
    target = cache_dir() / f"tiny-mixtral-{config.digest()}"
    if (target / BUILD_INFO).is_file():
        return target
    if not build:
        raise ValueError(f"tiny model {target} is not built; run `vela build-tiny-model`")
    _await_other_builds(target)
    if (target / BUILD_INFO).is_file():
        return target
    _remove_dead_staging(target)
    log.info("building the tiny pre-trained model (once; later runs load it from %s)", target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-{os.getpid()}-", dir=target.parent))
    try:
        build_tiny_model(config, staging, num_threads=num_threads)
        staging.chmod(0o755)  # mkdtemp made it private
        try:
            os.rename(staging, target)
            log.info("tiny model cached at %s", target)
        except OSError:  # another process finished the same build first; keep theirs
            if not (target / BUILD_INFO).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
