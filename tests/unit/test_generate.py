"""`vela generate` and the report's Samples section: greedy generations of the base and the fine-tuned model."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.fixtures import init_adapter, job_dict, make_checkpoint, run_in_process
from tests.unit.test_report import CHROMIUM, _chromium, make_run_dir
from vela_ray.cli import main
from vela_ray.config import JobConfig
from vela_ray.data.config import DataConfig
from vela_ray.data.datasets import build_dataset
from vela_ray.data.examples import IGNORE_INDEX
from vela_ray.generate import (REPETITION_PENALTY, add_samples, continuation, eval_prompts, generate, load,
                                prompt_ids, run_samples, text_prompt)
from vela_ray.observability.report import summary_text, write_report
from vela_ray.observability.samples import Sample, SamplesRecord
from vela_ray.paths import data_dir
from vela_ray.training.tiny_model import CHAT_TEMPLATE, tiny_model_path

SHAKESPEARE = data_dir() / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


def test_vela_generate_is_greedy_and_bounded(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--prompt", "To be, or not", "--max-new-tokens", "8"]) == 0
    first = capsys.readouterr().out
    assert main(["generate", "--model", str(checkpoint), "--prompt", "To be, or not", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == first  # greedy: the same text every time
    model, tokenizer = load(checkpoint)
    assert first.rstrip("\n") == generate(model, tokenizer, "To be, or not", 8)
    ids = prompt_ids(tokenizer, "To be, or not")
    short, longer = continuation(model, tokenizer, ids, 8), continuation(model, tokenizer, ids, 16)
    assert len(short) == 8 and longer[:8] == short  # bounded, and greedy: the longer run extends the shorter


def test_a_chat_models_prompt_is_one_user_turn_under_its_template(tmp_path):
    chat = make_checkpoint(tmp_path / "chat", chat_template=CHAT_TEMPLATE)
    _, tokenizer = load(chat)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Who goes there?"}], tokenize=False,
                                             add_generation_prompt=True)
    assert tokenizer.decode(prompt_ids(tokenizer, "Who goes there?")) == rendered
    assert rendered != "Who goes there?"


def test_the_adapter_changes_the_generation_and_samples_show_both(checkpoint, tmp_path):
    adapter = init_adapter(checkpoint, tmp_path / "adapter")  # random non-zero B: a visible change
    record = run_samples(checkpoint, adapter, ["To be, or not", "My lord"], max_new_tokens=12)
    assert [s.prompt for s in record.samples] == ["To be, or not", "My lord"]
    model, tokenizer = load(checkpoint, adapter)
    assert record.samples[0].tuned == generate(model, tokenizer, "To be, or not", 12)
    assert any(s.base != s.tuned for s in record.samples)
    assert record.max_new_tokens == 12 and record.repetition_penalty == REPETITION_PENALTY and record.seconds > 0


def test_eval_prompts_stop_before_the_first_supervised_token(checkpoint):
    _, tokenizer = load(checkpoint)
    data = build_dataset(DataConfig(kind="instruct", path=data_dir() / "instruct" / "gsm8k_alpaca.json",
                                    seq_len=512, limit=8), tokenizer, warn=False)
    prompts = eval_prompts(data, tokenizer, 3)
    assert len(prompts) == 3
    for row, prompt in enumerate(prompts):
        labels = data.labels[row][data.attention_mask[row].bool()]
        assert (labels[:len(prompt)] == IGNORE_INDEX).all() and labels[len(prompt)] != IGNORE_INDEX
        assert "Response" in tokenizer.decode(prompt)  # the Alpaca prompt, up to its response header


def test_a_text_rows_prompt_is_whole_lines_from_a_line_start(checkpoint):
    _, tokenizer = load(checkpoint)
    data = build_dataset(DataConfig(kind="text", path=SHAKESPEARE, seq_len=128, limit=200), tokenizer, warn=False)
    _, held_out = data.split(0.05, 0)  # packed rows start anywhere: the demo's first one at "itizen:"
    source = SHAKESPEARE.read_text()
    prompts = [tokenizer.decode(prompt) for prompt in eval_prompts(held_out, tokenizer, 8)]
    for text in prompts:
        at = source.find("\n" + text)
        assert text.strip() and at >= 0, text  # from a line start of the data
        assert text.endswith("\n") or source[at + 1 + len(text)].isspace(), text  # to a line's (or a word's) end


def test_a_text_prompt_from_one_long_line_is_its_first_whole_words(checkpoint):
    _, tokenizer = load(checkpoint)
    row = "ord of the realm, and every man that hears me speak shall know my mind before the sun goes down"
    prompt = text_prompt(tokenizer, tokenizer(row, add_special_tokens=False)["input_ids"], max_tokens=12)
    text = tokenizer.decode(prompt)
    assert 0 < len(prompt) <= 12 and text.startswith("of ") and f"ord {text} " in row, text


@pytest.fixture(scope="module")
def tiny_model():
    """The demo's base model, pre-trained on WikiText-2: built on first use (minutes) and cached, as test_tiers'."""
    return load(tiny_model_path())


def test_the_tiny_model_continues_shakespeare_without_unk_or_a_loop(tiny_model):
    model, tokenizer = tiny_model
    for line in ("Let us kill him, and we'll have corn at our own price.\n", "First Citizen:\nSpeak, speak.\n"):
        ids = tokenizer(line, add_special_tokens=False)["input_ids"]
        tokens = continuation(model, tokenizer, ids, 32)
        text = tokenizer.decode(tokens)
        assert "<unk>" not in text, text  # WikiText-2's placeholder for rare words, once its likeliest word
        fourgrams = Counter(tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3))
        assert max(fourgrams.values()) <= 2, text  # pure greedy: "== Ray ==\n\n\n== Ray ==\n\n\n== Ray ..."


def test_a_missing_model_or_adapter_is_one_line(checkpoint, tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert main(["generate", "--model", str(checkpoint), "--adapter", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "no config.json" in err[0] and "no adapter_config.json" in err[1]


# --- the report ----------------------------------------------------------------------------------------

SAMPLES = SamplesRecord(samples=[Sample(prompt="To be, or <not>", base="the base's words", tuned="the tuned model's words"),
                                 Sample(prompt="My lord", base="base again", tuned="tuned again")],
                        max_new_tokens=32, seconds=1.25)


def test_the_report_shows_samples_side_by_side(tmp_path):
    run_dir = make_run_dir(tmp_path / "run")
    SAMPLES.model_copy(update={"repetition_penalty": 1.2}).write(run_dir)
    page = write_report(run_dir).read_text()
    assert "Greedy generations with repetition penalty 1.2, at most" in page
    assert '<section id="samples">' in page
    assert "<th>Prompt</th><th>Base model</th><th>Fine-tuned</th>" in page
    assert "To be, or &lt;not&gt;" in page and "the tuned model&#x27;s words" in page
    assert "at most 32 new tokens" in page and "in 1.2 s" in page
    assert "samples: 2 prompts, base and fine-tuned side by side in the report (1.2 s)" in summary_text(run_dir)


def test_skipped_samples_say_why_and_a_run_without_them_has_no_section(tmp_path):
    run_dir = make_run_dir(tmp_path / "run")
    assert '<section id="samples">' not in write_report(run_dir).read_text()
    SamplesRecord(skipped="the model has 46.7B parameters, over report.samples_max_params").write(run_dir)
    page = write_report(run_dir).read_text()
    assert re.search(r'<section id="samples">.*No samples: the model has 46.7B parameters', page)
    assert "samples: none (the model has 46.7B parameters" in summary_text(run_dir)


@pytest.mark.skipif(not CHROMIUM.is_file(),
                    reason="needs Debian's chromium (/usr/bin/chromium): run scripts/ci_system_deps.sh")
def test_the_samples_section_renders_in_headless_chromium(tmp_path):
    run_dir = make_run_dir(tmp_path / "run")
    SAMPLES.write(run_dir)
    page = write_report(run_dir)
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'id="js-error"' not in dom.stdout and "the tuned model's words" in dom.stdout
    shot = tmp_path / "report.png"
    result = _chromium(tmp_path, f"--screenshot={shot}", page.as_uri())
    assert result.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.job
def test_a_run_ends_with_samples_from_its_eval_data_in_the_report(checkpoint, tmp_path):
    torch.set_num_threads(1)
    config = JobConfig.from_dict(job_dict(checkpoint, tmp_path / "out", steps=2,
                                          report={"samples": 2, "max_new_tokens": 6}))
    run_in_process(config)
    record = add_samples(config)
    assert len(record.samples) == 2 and record.skipped is None
    assert json.loads((tmp_path / "out" / "samples.json").read_text())["max_new_tokens"] == 6
    assert '<section id="samples">' in (tmp_path / "out" / "report.html").read_text()


def test_a_model_over_the_size_limit_gets_no_samples_and_the_reason(checkpoint, tmp_path):
    out = tmp_path / "out"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_config.json").write_text("{}")
    config = JobConfig.from_dict(job_dict(checkpoint, out, report={"samples_max_params": 1000}))
    record = add_samples(config)
    assert record.samples == [] and re.match(r"the model has 0\.\dB parameters, over report\.samples_max_params",
                                             record.skipped)
