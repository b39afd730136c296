"""Small local checkpoints for runtime tests: a debug-size MoE model plus a BPE tokenizer, saved HF-style."""

from __future__ import annotations

import json
import subprocess
import weakref
from pathlib import Path

import yaml

import torch
from peft import get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast

from vela_ray.config import JobConfig
from vela_ray.data.datasets import batch_at, build_dataset, micro_batches
from vela_ray.data.examples import IGNORE_INDEX
from vela_ray.model.adapters import full_lora_config
from vela_ray.model.experts import LoraSpec
from vela_ray.model.families import debug_config_like, debug_model, seeded_model
from vela_ray.observability.metrics import MetricsSink
from vela_ray.runtime.local import InProcessPool
from vela_ray.runtime.pool import WorkerPool
from vela_ray.runtime.runner import JobRunner
from vela_ray.training.equivalence import peft_losses
from vela_ray.paths import data_dir
from vela_ray.training.step import step_seed
from vela_ray.training.summary import RunSummary
from vela_ray.training.tiny_model import CHAT_TEMPLATE, train_tokenizer

VOCAB = 256


def make_checkpoint(out_dir: Path, family: str = "mixtral", seed: int = 0, vocab: int = VOCAB,
                    chat_template: str | None = None, **config_overrides) -> Path:
    """A random `family` model with a `vocab`-token BPE tokenizer trained on Tiny Shakespeare (and
    `chat_template`, if given)."""
    tokenizer = shakespeare_tokenizer(vocab, chat_template)
    model = debug_model(family, seed=seed, vocab_size=len(tokenizer), **config_overrides)
    return _save(model, tokenizer, out_dir)


# What a stand-in keeps of the real model's config: the numbers the preflight checks a job against
# (MoE layers x experts vs expert slots, seq_len vs positions).
STAND_IN_KEEPS = ("num_hidden_layers", "num_local_experts", "num_experts_per_tok", "max_position_embeddings")


def make_stand_in(real: PretrainedConfig, out_dir: Path, vocab: int = VOCAB, chat_template: str | None = None) -> Path:
    """A random model of `real`'s architecture (a cluster model's config, e.g. `MixtralConfig()` for
    Mixtral-8x7B) at debug width, with its layer and expert counts and position limit (`STAND_IN_KEEPS`): a job
    written for the real model passes or fails the preflight on it as on the real one, on a CPU, in seconds.
    `chat_template`: an instruct model's."""
    tokenizer = shakespeare_tokenizer(vocab, chat_template)
    config = debug_config_like(real)
    for name in STAND_IN_KEEPS:
        if hasattr(real, name):
            setattr(config, name, getattr(real, name))
    config.vocab_size = len(tokenizer)
    return _save(seeded_model(config), tokenizer, out_dir)


def shakespeare_tokenizer(vocab: int = VOCAB, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A `vocab`-token BPE tokenizer trained on the first 200 kB of Tiny Shakespeare."""
    text = (data_dir() / "tinyshakespeare" / "input.txt").read_text()[:200_000]
    tokenizer = train_tokenizer(text, vocab)
    tokenizer.chat_template = chat_template
    return tokenizer


def chat_tokenizer(chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A 400-token BPE tokenizer trained on the first 30 kB of Tiny Shakespeare, with `chat_template`: the data
    tests' (their rows are what TRL or the chat renderers must reproduce token for token)."""
    tokenizer = train_tokenizer((data_dir() / "tinyshakespeare" / "input.txt").read_text()[:30_000], vocab_size=400)
    tokenizer.chat_template = chat_template
    return tokenizer


def _save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> Path:
    """Model and tokenizer side by side in `out_dir`, as a Hugging Face checkpoint directory holds them."""
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def job_dict(model_dir: Path, out_dir: Path, steps: int = 3, **sections) -> dict:
    job = {
        "model": {"path": str(model_dir)},
        "data": {"kind": "text", "path": str(data_dir() / "tinyshakespeare" / "input.txt"), "seq_len": 32,
                 "limit": 200},
        "cluster": {"num_workers": 3, "num_cpus_per_worker": 0.25},
        # A fixed placement: what a noisy link probe measured must not decide what a test sees.
        "placement": {"solver": "sequential", "profile": "measure", "profile_batches": 2},
        "training": {"steps": steps, "batch_size": 4, "micro_batch_size": 2},
        "output": {"dir": str(out_dir)},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def peft_job(model_dir: Path, tmp_path: Path, steps: int = 3, **sections) -> dict:
    """`job_dict` as the jobs held to plain peft run: r=4 LoRA from a start adapter both sides load, lr 5e-3 with a
    warmup step, clipping at 0.5; output under `tmp_path / "out"`; `sections` merged over these."""
    job = job_dict(model_dir, tmp_path / "out", steps=steps,
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def run_equal_to_peft(job: dict, rtol: float = 1e-5) -> tuple[JobConfig, RunSummary]:
    """`job` preflighted and run in one process, its losses held to plain peft's over the same batches (rel `rtol`)."""
    config = JobConfig.from_dict(job)
    config.preflight()
    summary = run_in_process(config)
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
    return config, summary


def write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records))
    return path


def write_job(path: Path, job: dict) -> Path:
    path.write_text(yaml.safe_dump(job))
    return path


def run_in_process(config: JobConfig, *, pool: WorkerPool | None = None, metrics: MetricsSink | None = None,
                   should_stop=lambda: None, **pool_kwargs) -> RunSummary:
    """A whole job without Ray, the one way every runtime test runs one: its ExpertManagers are plain objects
    in this process (`InProcessPool(config, **pool_kwargs)`, e.g. `links=`, `worker_nodes=`) unless a test
    brings its own `pool`; `metrics` and `should_stop` as `JobRunner` takes them."""
    if pool is None:
        pool = InProcessPool(config, **pool_kwargs)
    return JobRunner(config, pool, metrics, should_stop=should_stop).run()


def init_adapter(model_dir: Path, out: Path, lora: LoraSpec = LoraSpec(r=4, alpha=8)) -> Path:
    """A random (non-zero B) adapter both sides start from (`lora`: e.g. `expert_stacks=()` for none on the
    experts)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = full_lora_config(model, lora)
    cfg.init_lora_weights = False
    torch.manual_seed(5)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


def reference_losses(config: JobConfig, device: str = "cpu", trl_metrics: dict | None = None
                     ) -> tuple[list[float], dict]:
    """Plain transformers + peft over the very batches, learning rates, clipping, step seeds and LoRA dropout of
    the job. A preference objective's losses are TRL's (`trl_dpo_loss`), its logged metrics put in `trl_metrics`."""
    train = config.training
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    train_set, _ = build_dataset(config.data, tokenizer).split(train.eval_fraction, train.seed)
    steps = [micro_batches(batch_at(train_set, step, train.batch_size, train.seed),
                           (train.micro_batch_size or train.batch_size) * train_set.group)
             for step in range(train.steps)]
    loss_for = None
    if train.preference.on:
        def loss_for(model):
            trl_loss = trl_dpo_loss if train.preference.objective == "dpo" else trl_kto_loss
            loss = trl_loss(model, train.preference, tokenizer, config.output.dir / "trl")
            if trl_metrics is not None:
                trl_metrics["train"] = loss.metrics  # filled as TRL logs
            return loss
    return peft_losses(config.model.path, config.lora.init_adapter, steps, train.optimizer, device,
                       step_seeds=[step_seed(train.seed, step) for step in range(train.steps)],
                       lora_dropout=config.lora.lora_dropout, quantization=config.quantization_spec,
                       loss_for=loss_for)


def trl_dpo_loss(model: torch.nn.Module, preference, tokenizer, out_dir: Path):
    """TRL's `DPOTrainer.compute_loss` over `model` (a PeftModel) with `preference`'s settings, as a function of a
    micro-batch in vela-ray's layout (pairs as adjacent rows, labels on the answers). The reference is the base
    model, adapters disabled: the frozen copy of the start adapter TRL adds for a model that already has one is
    deleted, which leaves TRL on its own path for an adapter it creates (`use_adapter(model, None)`). The
    trainer's logged metrics are the function's `metrics` (TRL's names, one entry per micro-batch)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(out_dir), loss_type=list(preference.losses), loss_weights=preference.loss_weights,
                     beta=preference.beta, label_smoothing=preference.label_smoothing,
                     router_aux_loss_coef=preference.router_aux_loss_coef, report_to=[], use_cpu=True,
                     disable_dropout=False)
    placeholder = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])  # TRL needs one; unused
    trainer = DPOTrainer(model=model, args=args, train_dataset=placeholder, processing_class=tokenizer)
    if "ref" in model.peft_config:
        model.delete_adapter("ref")

    def loss(micro: dict) -> torch.Tensor:
        rows = micro["input_ids"].shape[0]
        order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])  # TRL's: every chosen, every rejected
        inputs = {"input_ids": micro["input_ids"][order], "attention_mask": micro["attention_mask"][order],
                  "completion_mask": (micro["labels"][order] != IGNORE_INDEX).long()}
        return trainer.compute_loss(trainer.model, inputs)

    loss.metrics = trainer._metrics["train"]
    return loss


def trl_kto_loss(model: torch.nn.Module, preference, tokenizer, out_dir: Path):
    """TRL's `KTOTrainer.compute_loss` over `model` with `preference`'s settings, as a function of a micro-batch in
    vela-ray's layout (one row per example, labels on the answer, `desirable`), as `trl_dpo_loss`. The KL
    sequences are TRL's: each example's prompt with the answer of the example before it in the micro-batch (TRL
    rotates the answers within each batch), written here from the rows' prompts and answers."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=str(out_dir), loss_type=preference.losses[0], beta=preference.beta,
                     desirable_weight=preference.desirable_weight, undesirable_weight=preference.undesirable_weight,
                     router_aux_loss_coef=preference.router_aux_loss_coef, report_to=[], use_cpu=True,
                     disable_dropout=False, train_sampling_strategy="sequential", per_device_train_batch_size=2)
    placeholder = Dataset.from_list([{"prompt": "a", "completion": "b", "label": True},
                                     {"prompt": "c", "completion": "d", "label": False}])
    trainer = KTOTrainer(model=model, args=args, train_dataset=placeholder, processing_class=tokenizer)
    if "ref" in model.peft_config:
        model.delete_adapter("ref")

    def loss(micro: dict) -> torch.Tensor:
        ids, labels = micro["input_ids"], micro["labels"]
        prompts, answers = [], []
        for row, row_labels in zip(ids.tolist(), labels.tolist()):
            marked = [i for i, label in enumerate(row_labels) if label != IGNORE_INDEX]
            prompts.append(row[:marked[0]])
            answers.append(row[marked[0]:marked[-1] + 1])
        rotated = answers[-1:] + answers[:-1]
        width = ids.shape[1]
        kl = [(p + a)[:width] for p, a in zip(prompts, rotated)]
        kl_ids = torch.zeros(len(kl), width, dtype=torch.long)
        kl_mask, kl_answer = torch.zeros_like(kl_ids), torch.zeros_like(kl_ids)
        for i, (row, prompt) in enumerate(zip(kl, prompts)):
            kl_ids[i, :len(row)], kl_mask[i, :len(row)], kl_answer[i, len(prompt):len(row)] = torch.tensor(row), 1, 1
        inputs = {"input_ids": ids, "attention_mask": micro["attention_mask"],
                  "completion_mask": (labels != IGNORE_INDEX).long(), "label": micro["desirable"].bool(),
                  "KL_input_ids": kl_ids, "KL_attention_mask": kl_mask, "KL_completion_mask": kl_answer}
        return trainer.compute_loss(trainer.model, inputs)

    loss.metrics = trainer._metrics["train"]
    return loss


# The MoE families of the installed transformers that vela-ray refuses, with what the refusal says,
# and those that fail loudly on a gap still open (tests/unit/test_every_family.py, test_loading.py).
REFUSED = {  # family -> what the refusal must say
    "dbrx": r"DbrxExperts keeps its experts in flat 2-D matrices .* peft cannot adapt them",
    "doge": r"its MoE modules \(DogeCDMoE\) do not keep a layer's experts as an `experts` child",
    "jetmoe": r"its MoE modules \(JetMoeMoA, JetMoeMoE, JetMoeParallelExperts\) do not keep",
    "longcat_flash": r"LongcatFlashExperts's weight stacks hold different numbers of experts .* identity 'zero' experts",
}
KNOWN_FAILURES: dict[str, str] = {}  # family -> the gap, when a new transformers brings one


def label_runs(labels: list[int]) -> list[list[int]]:
    """The labelled tokens of a row, as contiguous runs (what the loss sees, turn by turn)."""
    runs, current = [], []
    for label in labels:
        if label == IGNORE_INDEX:
            runs, current = runs + ([current] if current else []), []
        else:
            current.append(label)
    return runs + ([current] if current else [])


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors ops create while active that are alive at once, at their peak (a storage counts
    from the op that made it until it is freed), and the storages the ops read."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.alive: set[int] = set()
        self.read: set[int] = set()

    def _freed(self, ptr: int, nbytes: int) -> None:
        self.live -= nbytes
        self.alive.discard(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        self.read |= inputs
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.alive and ptr not in inputs:  # new, not a view or an in-place result
                    self.alive.add(ptr)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, ptr, storage.nbytes())
        return out


def side_by_side(commands: list[list[str]], timeout: float = 600, **popen) -> list[str]:
    """Each command's stdout, the commands run at once: independent processes (each measuring its own memory, or
    starting a Ray of its own) need not wait for each other, and a fresh process spends seconds importing on one core.
    A command that fails raises `subprocess.CalledProcessError` with its output."""
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
                 for command in commands]
    outputs = [process.communicate(timeout=timeout) for process in processes]
    for command, process, (out, err) in zip(commands, processes, outputs):
        if process.returncode:
            raise subprocess.CalledProcessError(process.returncode, command, out, err)
    return [out for out, _ in outputs]
