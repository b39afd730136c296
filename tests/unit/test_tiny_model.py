"""Tests of vela_ray.training.tiny_model (a very small build into a temporary cache) and the `vela profile` CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vela_ray import cli
from vela_ray.training import tiny_model
from vela_ray.data.locality import AccessProfile
from vela_ray.paths import data_dir
from vela_ray.data.config import DataConfig
from vela_ray.data.datasets import build_dataset
from vela_ray.training.tiny_model import BUILD_INFO, TinyModelConfig, tiny_model_path

SHAKESPEARE = data_dir() / "tinyshakespeare" / "input.txt"
VERY_SMALL = dict(max_corpus_chars=40_000, vocab_size=300, num_layers=2, hidden_size=32, intermediate_size=32,
                  num_experts=4, top_k=2, seq_len=32, batch_size=4, steps=20, warmup_steps=2,
                  learning_rate=1e-2)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vela-cache")


@pytest.fixture(scope="module")
def built(cache) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VELA_CACHE_DIR", str(cache))
        return tiny_model_path(TinyModelConfig(**VERY_SMALL), num_threads=1)


def test_build_saves_a_model_and_tokenizer_the_auto_classes_load(built):
    model = AutoModelForCausalLM.from_pretrained(built)
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert model.config.num_local_experts == 4 and model.config.output_router_logits
    assert model.config.vocab_size == len(tokenizer) == 300
    assert None not in (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    ids = tokenizer("To be, or not to be", return_tensors="pt").input_ids
    assert ids[0, 0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[0], skip_special_tokens=True) == "To be, or not to be"
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 300)


def test_build_lowers_the_loss_and_reports_router_skew(built):
    info = json.loads((built / BUILD_INFO).read_text())
    assert len(info["losses"]) == 20
    assert info["loss_last"] < info["loss_first"]
    assert len(info["router_skew"]["skew_per_layer"]) == 2


def test_cached_build_is_reused_and_keyed_by_its_settings(built, cache, monkeypatch):
    monkeypatch.setenv("VELA_CACHE_DIR", str(cache))
    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda *a, **k: pytest.fail("rebuilt a cached model"))
    config = TinyModelConfig(**VERY_SMALL)
    assert tiny_model_path(config) == built == cache / f"tiny-mixtral-{config.digest()}"
    other = TinyModelConfig(**{**VERY_SMALL, "seed": 1})
    assert other.digest() != config.digest()
    with pytest.raises(ValueError, match=r"tiny-mixtral-\w+ is not built; run `vela build-tiny-model`"):
        tiny_model_path(other, build=False)


def test_a_failed_build_leaves_no_model_and_stale_staging_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("VELA_CACHE_DIR", str(tmp_path))
    config = TinyModelConfig(**{**VERY_SMALL, "seed": 7})
    stale = tmp_path / f".tiny-mixtral-{config.digest()}.building-999999999-abc"
    stale.mkdir()

    def half_build(config, out_dir, **kwargs):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed")

    monkeypatch.setattr(tiny_model, "build_tiny_model", half_build)
    with pytest.raises(RuntimeError, match="killed"):
        tiny_model_path(config)
    assert list(tmp_path.iterdir()) == []


def test_a_build_under_way_in_another_process_is_awaited_not_repeated(tmp_path, monkeypatch):
    """A second caller waits for the live builder's model (a second run, or the tests' background build); if that
    builder dies unfinished, the caller builds it itself."""
    monkeypatch.setenv("VELA_CACHE_DIR", str(tmp_path))
    config = TinyModelConfig(**{**VERY_SMALL, "seed": 9})
    target = tmp_path / f"tiny-mixtral-{config.digest()}"

    def built_here(config, out_dir, **kwargs):
        raise RuntimeError("built here")

    monkeypatch.setattr(tiny_model, "build_tiny_model", built_here)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f".{target.name}.building-{builder.pid}-abc").mkdir()

        def finish():  # what the other builder does last: its model renamed into place
            time.sleep(0.3)
            target.mkdir()
            (target / BUILD_INFO).write_text("{}")
        threading.Thread(target=finish).start()
        assert tiny_model_path(config) == target  # waited for it: `built_here` never ran
    finally:
        builder.kill()
        builder.wait()
    shutil.rmtree(target)
    with pytest.raises(RuntimeError, match="built here"):  # its builder gone unfinished: built by the caller
        tiny_model_path(config)
    assert not list(tmp_path.glob(".*building*"))  # the dead builder's staging removed too


def test_tiny_model_config_checks_its_shapes():
    with pytest.raises(ValueError, match=r"top_k \(3\) exceeds num_experts \(2\)"):
        TinyModelConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must divide by num_heads \(4\)"):
        TinyModelConfig(hidden_size=30)


@pytest.mark.job
def test_vela_profile_writes_profile_npy_and_pngs(built, tmp_path):
    vela = Path(sys.executable).parent / "vela"
    out = tmp_path / "out"
    result = subprocess.run(
        [str(vela), "profile", "--model", str(built), "--data", str(SHAKESPEARE), "--seq-len", "32",
         "--batch-size", "4", "--batches", "2", "--out", str(out / "p.json"), "--npy", str(out / "P.npy"),
         "--plot", str(out / "plots")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    profile = AccessProfile.load(out / "p.json")
    assert profile.tokens == 2 * 4 * 32
    assert np.allclose(np.load(out / "P.npy").sum(axis=1), 2.0)
    for png in ("access_heatmap.png", "confidence_cdf.png"):
        assert (out / "plots" / png).stat().st_size > 1000


def test_vela_profile_reads_instruction_data(built, tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"instruction": "Greet.", "output": "Hello."}\n{"instruction": "Count.", "output": "1 2 3"}\n')
    code = cli.main(["profile", "--model", str(built), "--data", str(data), "--seq-len", "256",
                     "--batch-size", "2", "--out", str(tmp_path / "p.json")])
    assert code == 0
    profile = AccessProfile.load(tmp_path / "p.json")
    assert 0 < profile.tokens < 2 * 256  # padding is not counted


@pytest.mark.parametrize("packing", [False, True])
def test_vela_profile_reads_chat_data_with_the_built_chat_template(built, tmp_path, packing):
    data = tmp_path / "chat.jsonl"
    turns = [{"from": "human", "value": "Greet."}, {"from": "gpt", "value": "Hello."}]
    data.write_text("\n".join(json.dumps({"conversations": turns}) for _ in range(3)) + "\n")
    code = cli.main(["profile", "--model", str(built), "--data", str(data), "--kind", "chat", "--seq-len", "64",
                     "--batch-size", "2", "--out", str(tmp_path / "p.json")] + (["--packing"] if packing else []))
    assert code == 0
    rows = build_dataset(DataConfig(kind="chat", path=data, seq_len=64), AutoTokenizer.from_pretrained(built))
    assert AccessProfile.load(tmp_path / "p.json").tokens == rows.num_tokens == 3 * rows.attention_mask[0].sum()


@pytest.mark.parametrize("where", ["dir", "file"])
def test_vela_profile_reads_an_entry_of_a_llama_factory_dataset_info(built, tmp_path, where):
    data = tmp_path / "data"
    data.mkdir()
    (data / "greet.json").write_text(json.dumps([{"q": "Greet.", "a": "Hello."}, {"q": "Count.", "a": "1 2 3"}]))
    (data / "dataset_info.json").write_text(json.dumps(
        {"greet": {"file_name": "greet.json", "columns": {"prompt": "q", "response": "a"}}}))
    named = data if where == "dir" else data / "dataset_info.json"
    code = cli.main(["profile", "--model", str(built), "--data", str(named), "--name", "greet", "--seq-len", "256",
                     "--batch-size", "2", "--out", str(tmp_path / "p.json")])
    assert code == 0
    rows = build_dataset(DataConfig(kind="instruct", path=data / "greet.json", seq_len=256,
                                    columns={"instruction": "q", "output": "a"}), AutoTokenizer.from_pretrained(built))
    assert AccessProfile.load(tmp_path / "p.json").tokens == rows.num_tokens


def test_vela_profile_reports_a_missing_model_as_a_user_error(tmp_path, capsys):
    code = cli.main(["profile", "--model", str(tmp_path), "--data", str(SHAKESPEARE), "--out", str(tmp_path / "p")])
    assert code == 2
    assert "is not a model directory" in capsys.readouterr().err


def test_wikitexts_tokenisation_is_undone_and_ordinary_text_is_all_but_unchanged():
    wikitext = (' = = Description = = \n Homarus gammarus , known as the " European lobster " , is 0 @.@ 7 m '
                "( 24 in ) long ; it is well @-@ known and does n't live in Linnaeus ' genus . \n")
    assert tiny_model.detokenise_wikitext(wikitext) == (
        '== Description ==\nHomarus gammarus, known as the "European lobster", is 0.7 m '
        "(24 in) long; it is well-known and doesn't live in Linnaeus' genus.\n")
    shakespeare = SHAKESPEARE.read_text()
    assert len(shakespeare) - len(tiny_model.detokenise_wikitext(shakespeare)) < 20  # of 1.1M characters


def test_wikitexts_unk_placeholder_is_left_out_of_the_pretraining_text():
    wikitext = ' a species of <unk> lobster , <unk> @-@ based , well @-@ <unk> , called " <unk> " or ( <unk> ) . \n'
    assert tiny_model.detokenise_wikitext(wikitext) == "a species of lobster, based, well, called or.\n"
    assert "<unk>" not in tiny_model.corpus_text(TinyModelConfig())  # the default build's: the demo's model


def test_the_build_uses_at_least_one_and_at_most_all_cores():
    assert 1 <= tiny_model.cpu_threads() <= (os.cpu_count() or 1)
