"""Data accounting: what became of a file's examples (read, kept, truncated, dropped by reason, supervised
tokens lost), `data.truncation: keep_answer`, packing what truncation leaves, and the counts in
summary.json, the closing lines and the report; the warning once per job, not once per process."""

from __future__ import annotations

import json
import logging

import pytest

from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray.config import JobConfig
from vela_ray.data.config import DataConfig
from vela_ray.data.datasets import build_dataset
from vela_ray.data.examples import IGNORE_INDEX as X
from vela_ray.data.examples import Example, best_fit_decreasing, packed_rows, padded_rows
from vela_ray.data.tokenized import CUT_AWAY, EMPTY
from vela_ray.observability.report import load_run, render_html, summary_text
from vela_ray.training.summary import DataRecord, PlacementRecord, RunSummary
from vela_ray.training.tiny_model import train_tokenizer

PAD = 0


def _example(prompt: int, answer: int, start: int = 100) -> Example:
    """`prompt` unlabelled tokens, then `answer` labelled ones; ids start, start + 1, ..."""
    ids = list(range(start, start + prompt + answer))
    return Example(ids, [X] * prompt + ids[prompt:])


def _examples() -> list[Example]:
    return [_example(2, 4),            # fine: 6 tokens
            _example(10, 4, 200),      # its answer starts after seq_len 8
            _example(3, 9, 300),       # its answer runs past seq_len 8
            _example(5, 0, 400),       # no answer
            Example([], [])]           # nothing at all


def test_counts_of_fine_too_long_and_empty_examples_cut_on_the_right():
    rows = padded_rows(_examples(), seq_len=8, pad_id=PAD, source="t")
    stats = rows.stats
    assert (stats.examples, stats.kept, stats.truncated) == (5, 2, 1)
    assert stats.dropped == {CUT_AWAY: 1, EMPTY: 2}
    # labels 4 + 4 + 9 = 17; lost: all 4 of the second, and 4 of the third's 9 (it keeps positions 3..7)
    assert (stats.supervised_tokens, stats.supervised_tokens_lost) == (17, 8)
    # lengths 0, 5, 6, 12, 14: 90% (5 of 5, rounded up) fit in 14
    assert (stats.longest, stats.seq_len_p90, stats.rows) == (14, 14, 2)
    assert stats.padding_fraction == pytest.approx(1 - (6 + 8) / 16)
    assert stats.lost_share == pytest.approx(4 / 5)


def test_keep_answer_keeps_every_answer_that_fits():
    stats = padded_rows(_examples(), seq_len=8, pad_id=PAD, source="t", truncation="keep_answer").stats
    assert (stats.kept, stats.truncated, stats.dropped) == (3, 2, {EMPTY: 2})
    assert stats.supervised_tokens_lost == 4  # only the answer longer than the row loses labels


def test_keep_answer_cuts_the_middle_of_the_prompt_token_by_token():
    # prompt 10, answer 4, seq_len 8: B = 4 prompt tokens, the first 2 and the last 2
    cut = _example(10, 4).truncated(8, "keep_answer")
    assert cut.input_ids == [100, 101, 108, 109, 110, 111, 112, 113]
    assert cut.labels == [X, X, X, X, 110, 111, 112, 113]
    # an odd budget gives the head the extra token: prompt 10, answer 3, seq_len 8: B = 5, 3 + 2
    cut = _example(10, 3).truncated(8, "keep_answer")
    assert cut.input_ids == [100, 101, 102, 108, 109, 110, 111, 112]
    assert cut.labels == [X, X, X, X, X, 110, 111, 112]
    # the right cut of the same example keeps no label at all
    assert _example(10, 3).truncated(8, "right").labels == [X] * 8


def test_keep_answer_keeps_the_last_turn_of_a_conversation_and_cuts_an_overlong_answer_on_the_right():
    # prompt 3, answer 3, user turn 4, answer 3 (13 tokens), seq_len 9: the last answer starts at 10;
    # B = 9 - 3 = 6: tokens 0-2 and 7-9; the first answer (3-5) falls in the cut middle
    ids = list(range(13))
    labels = [X, X, X, 3, 4, 5, X, X, X, X, 10, 11, 12]
    cut = Example(ids, labels).truncated(9, "keep_answer")
    assert cut.input_ids == [0, 1, 2, 7, 8, 9, 10, 11, 12]
    assert cut.labels == [X, X, X, X, X, X, 10, 11, 12]
    # prompt 4, answer 12, seq_len 8: the prompt keeps min(4, 8 // 2) = 4 tokens, the answer its first 4
    cut = _example(4, 12).truncated(8, "keep_answer")
    assert cut.input_ids == list(range(100, 108))
    assert cut.labels == [X] * 4 + list(range(104, 108))
    # an example that fits is left as it is
    fine = _example(2, 4)
    assert fine.truncated(6, "keep_answer") is fine and fine.truncated(6, "right") is fine


def test_best_fit_decreasing_packs_tighter_than_first_fit_in_data_order():
    # first fit in data order: [6, 3], [5, 4], [2] (3 rows); best fit of the longest first: 6, 5, then 4
    # into the 6's row (room 4: exact), 3 and 2 into the 5's row
    assert best_fit_decreasing([6, 3, 5, 4, 2], 10) == [[0, 3], [1, 2, 4]]
    assert best_fit_decreasing([10, 10], 10) == [[0], [1]]
    assert best_fit_decreasing([], 10) == []


def test_packing_packs_what_truncation_leaves_and_examples_never_share_positions():
    long, a, b = _example(10, 4), _example(1, 3, 300), _example(2, 2, 400)  # 14 -> 8 tokens; 4 and 4
    rows = packed_rows([a, long, b], seq_len=8, pad_id=PAD, source="t", truncation="keep_answer")
    assert rows.input_ids.tolist() == [a.input_ids + b.input_ids, [100, 101, 108, 109, 110, 111, 112, 113]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], list(range(8))]
    # every example's first label is masked in the row: no example is predicted from the one before it
    assert rows.labels.tolist() == [[X, 301, 302, 303, X, X, 402, 403], [X, X, X, X, 110, 111, 112, 113]]
    assert rows.stats.rows == 2 and rows.stats.truncated == 1 and rows.stats.padding_fraction == 0.0


def test_split_and_subset_keep_the_whole_build_s_counts():
    rows = padded_rows([_example(2, 4, 10 * n) for n in range(10)] + [_example(10, 4)], seq_len=8, pad_id=PAD,
                       source="t")
    train, held_out = rows.split(0.2, seed=0)
    assert train.stats == held_out.stats == rows.stats and rows.subset([0], "one").stats == rows.stats
    assert rows.stats.examples == 11 and len(train) + len(held_out) == rows.stats.rows == 10  # 1 dropped


def test_the_warning_names_the_fix_and_a_second_build_logs_it_at_debug(caplog):
    """Once per run on the console: the master's second build (its INFO reaches the driver's console too) says
    nothing above DEBUG."""
    with caplog.at_level(logging.DEBUG, logger="vela_ray.data.examples"):
        padded_rows(_examples(), seq_len=8, pad_id=PAD, source="t")
        padded_rows(_examples(), seq_len=8, pad_id=PAD, source="t", warn=False)
    warnings = [r for r in caplog.records if "dropped or truncated" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING, logging.DEBUG]
    counts = [r for r in caplog.records if "examples read" in r.getMessage()]
    assert [r.levelno for r in counts] == [logging.INFO, logging.DEBUG]
    assert ("80% of 5 examples dropped or truncated at data.seq_len=8: 1 truncated (data.truncation: right); "
            f"1 dropped ({CUT_AWAY}); 2 dropped ({EMPTY}); 47.1% of the supervised tokens cut; raise data.seq_len "
            "(14 holds 90% of the examples whole, the longest has 14 tokens) or set data.truncation: keep_answer"
            ) in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # 1 of 11 truncated: under 10%, no warning
        padded_rows([_example(2, 4)] * 10 + [_example(10, 4)], seq_len=8, pad_id=PAD, source="t")
    assert not caplog.records


def _summary(data: DataRecord) -> RunSummary:
    return RunSummary(steps=1, losses=[2.0], eval_loss=None, median_step_time_s=0.1, history=[],
                      traffic_bytes_by_tier={}, traffic_bytes_by_worker=[0], worker_tiers=["same_node"],
                      worker_nodes=["a"], master_node="a", data=data,
                      placement=PlacementRecord(solver="sequential", expert_to_worker=[[0, 0]]))


def test_summary_json_the_closing_lines_and_the_report_carry_the_counts(tmp_path):
    path = tmp_path / "records.json"
    path.write_text("[]")
    config = DataConfig(kind="instruct", path=path, seq_len=8, packing=True)
    train, _ = packed_rows(_examples(), seq_len=8, pad_id=PAD, source=str(path)).split(0.5, seed=0)
    record = DataRecord.of(config, train)
    assert (record.examples, record.examples_kept, record.examples_truncated) == (5, 2, 1)
    assert record.examples_dropped == {CUT_AWAY: 1, EMPTY: 2} and record.supervised_tokens_lost == 8
    assert record.built_rows == 2 and record.rows == 1 and record.warning.startswith(f"{path}: 80% of 5 examples")

    _summary(record).write(tmp_path)
    saved = json.loads((tmp_path / "summary.json").read_text())["data"]
    assert saved["examples_dropped"] == {CUT_AWAY: 1, EMPTY: 2} and saved["examples_truncated"] == 1
    assert RunSummary.load(tmp_path).data == record

    lines = summary_text(tmp_path).splitlines()
    assert (f"data: 5 examples read, 2 kept (1 truncated, right), 3 dropped (1 {CUT_AWAY}; 2 {EMPTY}); 47.1% of "
            "the supervised tokens cut; 1 training rows of 8 tokens") in "\n".join(lines)
    assert f"WARNING: {record.warning}" in lines

    page = render_html(load_run(tmp_path))
    assert '<section id="data"><h2>Data</h2>' in page and "80% of 5 examples dropped or truncated" in page
    assert f"<th>dropped: {CUT_AWAY}</th><td>1 (20.0%)</td>" in page
    assert "<th>lost to truncation</th><td>8 (47.1%)</td>" in page


def test_text_data_and_old_summaries_have_no_example_counts(tmp_path):
    text = DataRecord(kind="text", packing=False, seq_len=32, rows=10, tokens=320, padding_fraction=0.0)
    assert text.examples is None and text.warning is None
    _summary(text).write(tmp_path)
    assert "data: text, 10 training rows of 32 tokens (0.0% padding)" in summary_text(tmp_path).splitlines()
    assert '<section id="data">' in render_html(load_run(tmp_path))


def test_keep_answer_is_refused_for_text(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match="data.truncation applies to instruct and chat data"):
        DataConfig(kind="text", path=path, truncation="keep_answer")


def _records(path):
    """40 instruction records; every fourth one's answer is far longer (tiny tokenizers: 150-220 tokens of prompt,
    10-40 of a short answer, 120-420 of a long one)."""
    records = [{"instruction": f"Say something about the king, number {n}.", "input": "",
                "output": ("The king is dead, long live the king. " * (12 if n % 4 == 0 else 1)).strip()}
               for n in range(40)]
    path.write_text(json.dumps(records))
    return path


def test_build_dataset_counts_a_real_tokenizer_s_examples(tmp_path):
    path = _records(tmp_path / "records.json")
    tokenizer = train_tokenizer(path.read_text(), vocab_size=300)
    right = build_dataset(DataConfig(kind="instruct", path=path, seq_len=192), tokenizer).stats
    kept = build_dataset(DataConfig(kind="instruct", path=path, seq_len=192, truncation="keep_answer"), tokenizer)
    assert right.examples == kept.stats.examples == 40
    assert right.truncated + right.num_dropped == kept.stats.truncated == 10  # the long ones
    assert kept.stats.supervised_tokens_lost < right.supervised_tokens_lost


@pytest.mark.job
def test_a_job_warns_once_and_records_the_counts(tmp_path, caplog):
    """The driver's preflight and the master both build the data; only the first says so (issue 49: four times)."""
    model_dir = make_checkpoint(tmp_path / "model", max_position_embeddings=256)
    path = _records(tmp_path / "records.json")
    job = job_dict(model_dir, tmp_path / "out", steps=1, data={"kind": "instruct", "path": str(path), "seq_len": 256,
                                                              "limit": None})
    with caplog.at_level(logging.INFO):  # what a console shows: each line once
        checked = JobConfig.from_dict(job).preflight()
        summary = run_in_process(checked.config)
    warnings = [r for r in caplog.records if "dropped or truncated" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    counts = [r for r in caplog.records if "examples read" in r.getMessage()]
    assert [r.levelno for r in counts] == [logging.INFO]
    data = RunSummary.load(tmp_path / "out").data
    assert data == summary.data and data.examples == 40 and data.examples_truncated + sum(
        data.examples_dropped.values()) == 10
    assert "dropped or truncated" in data.warning
    assert f"WARNING: {data.warning}" in summary_text(tmp_path / "out").splitlines()
