"""Rows of examples, padded or packed (vela_ray.data.examples): layout, no leakage, the model probe."""

from __future__ import annotations

import logging

import pytest
import torch

from vela_ray.data.config import DataConfig
from vela_ray.data.datasets import build_dataset
from vela_ray.data.examples import IGNORE_INDEX, Example, check_packing, packed_rows, padded_rows, packing_leak
from vela_ray.model.families import debug_config, debug_model
from vela_ray.paths import data_dir
from vela_ray.training.tiny_model import train_tokenizer

GSM8K = data_dir() / "instruct" / "gsm8k_alpaca.json"
PAD = 0


def _example(start: int, length: int, prompt: int) -> Example:
    ids = list(range(start, start + length))
    return Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:])


def test_packed_rows_restart_positions_and_never_label_an_example_s_first_token():
    a, b, c = _example(10, 5, 2), _example(20, 4, 0), _example(30, 7, 3)
    rows = packed_rows([a, b, c], seq_len=10, pad_id=PAD, source="t")
    assert rows.input_ids.tolist() == [a.input_ids + b.input_ids + [PAD], c.input_ids + [PAD] * 3]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]]
    # b's own first token is a label in the example, but not in the row: the previous example precedes it
    assert rows.labels.tolist() == [[-100, -100, 12, 13, 14, -100, 21, 22, 23, -100],
                                    [-100, -100, -100, 33, 34, 35, 36, -100, -100, -100]]
    assert rows.attention_mask.tolist() == [[1] * 9 + [0], [1] * 7 + [0] * 3]
    batch = rows.rows([0, 1])
    assert "attention_mask" not in batch and "position_ids" in batch  # transformers masks per example
    assert "attention_mask" in rows.rows([0], token_mask=True)  # for counting tokens, not for the model


def test_packing_truncates_long_examples_and_drops_examples_with_nothing_to_learn(caplog):
    long, short, unlabelled = _example(10, 12, 1), _example(40, 3, 1), _example(50, 9, 9)
    with caplog.at_level(logging.WARNING):
        rows = packed_rows([long, _example(30, 8, 1), short, unlabelled], seq_len=10, pad_id=PAD, source="t")
    assert "50% of 4 examples dropped or truncated at data.seq_len=10: 1 truncated" in caplog.text
    assert "1 dropped (empty: no supervised token at all)" in caplog.text
    assert rows.input_ids[0].tolist() == long.input_ids[:10]  # cut on the right at seq_len
    assert rows.input_ids[1].tolist() == list(range(30, 38)) + [PAD, PAD]
    assert rows.input_ids.shape == (3, 10) and rows.input_ids[2, :3].tolist() == short.input_ids
    padded = padded_rows([long, short, unlabelled], seq_len=10, pad_id=PAD, source="t")
    assert padded.input_ids.shape == (2, 10) and padded.position_ids is None
    with pytest.raises(ValueError, match="no example has a supervised token within seq_len=10"):
        padded_rows([unlabelled], seq_len=10, pad_id=PAD, source="t")


def test_a_packed_row_computes_what_each_example_computes_alone():
    """No attention leakage (logits) and no label leakage (the loss): packed == one by one."""
    model = debug_model("mixtral").train()
    model.config.use_cache = False  # what build_master sets: no cache, so the positions define the mask
    g = torch.Generator().manual_seed(0)
    examples = []
    for length in (6, 9, 5):
        ids = torch.randint(3, 100, (length,), generator=g).tolist()
        examples.append(Example(ids, [IGNORE_INDEX] + ids[1:]))
    row = packed_rows(examples, seq_len=24, pad_id=PAD, source="t").rows([0])
    with torch.no_grad():
        packed = model(**row)
        start, summed_loss, labels = 0, 0.0, 0
        for example in examples:
            ids = torch.tensor([example.input_ids])
            alone = model(input_ids=ids, labels=torch.tensor([example.labels]))
            end = start + len(example.input_ids)
            torch.testing.assert_close(packed.logits[0, start:end], alone.logits[0], rtol=1e-5, atol=1e-5)
            count = sum(label != IGNORE_INDEX for label in example.labels[1:])
            summed_loss, labels, start = summed_loss + float(alone.loss) * count, labels + count, end
    torch.testing.assert_close(float(packed.loss), summed_loss / labels, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family, leaks", [("mixtral", False), ("qwen3_moe", False), ("gpt_oss", True),
                                           ("qwen3_next", True), ("jamba", True)])
def test_packing_is_refused_where_the_architecture_mixes_packed_examples(family, leaks):
    """gpt-oss's attention and the recurrent / linear-attention layers of Qwen3-Next and Jamba see across
    examples whatever the position ids say; the probe measures it on a debug-size copy."""
    config = debug_config(family)
    assert (packing_leak(config) > 1e-5) == leaks
    if leaks:
        with pytest.raises(ValueError, match=r"data\.packing would leak between examples .* set data\.packing: "
                                             r"false"):
            check_packing(config, "model.path m")
    else:
        check_packing(config, "model.path m")


def test_packing_cuts_the_padding_of_gsm8k():
    tokenizer = train_tokenizer(GSM8K.read_text()[:200_000], vocab_size=600)
    padded = build_dataset(DataConfig(kind="instruct", path=GSM8K, seq_len=512, limit=200), tokenizer)
    packed = build_dataset(DataConfig(kind="instruct", path=GSM8K, seq_len=512, limit=200, packing=True), tokenizer)
    assert packed.num_tokens == padded.num_tokens  # the same tokens, in fewer rows
    assert padded.padding_fraction > 0.3 and packed.padding_fraction < padded.padding_fraction / 2
    assert len(packed) < 0.75 * len(padded)


def test_packing_and_columns_do_not_apply_to_text():
    with pytest.raises(ValueError, match="data.packing applies to instruct and chat data"):
        DataConfig(kind="text", path=GSM8K, packing=True)
    with pytest.raises(ValueError, match=r"data.columns: \['prompt'\] are not instruct fields"):
        DataConfig(kind="instruct", path=GSM8K, columns={"prompt": "q"})
    with pytest.raises(ValueError, match="data.chat_template applies to kind chat"):
        DataConfig(kind="instruct", path=GSM8K, chat_template="{{ x }}")
