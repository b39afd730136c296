"""benchmarks/vela_vs_ep.py --paper and benchmarks/paper_scale.py's real-routing helpers (issue 38).

Fast: no training, no Ray. One test brings up a 2-node emulated network (no Ray) to check that
`intra_mbit` puts a tbf on each node's loopback; it is skipped without root and netns.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import paper_scale, vela_vs_ep  # noqa: E402
from benchmarks._harness import alpaca_mix  # noqa: E402
from benchmarks import vela_vs_ep_report as report  # noqa: E402
from deploy.emulated_cluster import ClusterSpec, EmulatedCluster, ShapingUnavailable, check_can_shape  # noqa: E402
from placement import TrainingStep, predict_step  # noqa: E402
from vela_ray.training.summary import RunSummary, StepRecord  # noqa: E402

STORED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "vela_vs_ep_tp2"  # the smallest stored set


def test_paper_flag_sets_the_papers_conditions_and_keeps_explicit_choices():
    args = vela_vs_ep.parse_args(["--paper"])
    assert args.steps == 500
    assert args.datasets == ["wikitext", "alpaca"]
    assert args.methods == ["ep", "sequential", "random", "vela", "improved"]
    assert args.intra_mbit == vela_vs_ep.PAPER_INTRA_MBIT
    assert args.unshaped_steps == 0
    assert args.out == vela_vs_ep.PAPER_RESULTS
    args = vela_vs_ep.parse_args(["--paper", "--steps", "40", "--datasets", "wikitext"])
    assert (args.steps, args.datasets) == (40, ["wikitext"])


def test_without_paper_the_defaults_are_unchanged():
    args = vela_vs_ep.parse_args([])
    assert args.steps == 16
    assert args.datasets == ["wikitext", "gsm8k_alpaca"]
    assert args.methods == list(vela_vs_ep.METHODS)
    assert args.intra_mbit is None and not args.paper
    assert args.out == vela_vs_ep.RESULTS


def test_paper_placements_name_the_papers_method_and_vela_rays_defaults():
    args = Namespace(limit=1500, batch_size=8, capacity=8)
    vela = vela_vs_ep.paper_placement("vela", args)
    assert vela["solver"] == "vela" and vela["shared_links"] == "none"
    assert vela["cost_model"] == "communication" and vela["profile_batches"] == 187  # the whole training set
    improved = vela_vs_ep.paper_placement("improved", args)
    assert improved == {"solver": "improved", "profile": "measure", "capacity": 8}  # the rest: defaults


def test_job_dict_with_paper_uses_the_paper_placement(tmp_path, monkeypatch):
    monkeypatch.setattr(vela_vs_ep, "ALPACA_MIX", tmp_path / "mix.json")
    monkeypatch.setitem(vela_vs_ep.DATASETS, "alpaca", {"kind": "instruct", "path": tmp_path / "mix.json"})
    monkeypatch.setattr(vela_vs_ep, "alpaca_mix", lambda limit: tmp_path / "mix.json")
    import vela_ray.training.tiny_model as tiny

    monkeypatch.setattr(tiny, "tiny_model_path", lambda build=False: tmp_path)
    args = vela_vs_ep.parse_args(["--paper"])
    job = vela_vs_ep.job_dict(args, "alpaca", "vela", 3, tmp_path)
    assert job["placement"]["solver"] == "vela" and job["placement"]["shared_links"] == "none"
    assert job["data"]["path"] == str(tmp_path / "mix.json")


def test_alpaca_mix_holds_every_seed_task_then_gsm8k(tmp_path):
    path = alpaca_mix(tmp_path / "mix.json", limit=300)
    records = json.loads(path.read_text())
    assert len(records) == 300
    assert all({"instruction", "input", "output"} <= set(r) for r in records)
    seeds = sum(1 for r in records if "####" not in r["output"])  # GSM8K answers end in "#### <n>"
    assert seeds >= 170
    assert alpaca_mix(tmp_path / "mix.json", limit=300).read_text() == path.read_text()  # idempotent


def _fake_results() -> dict:
    def row(mb, step):
        return {"cross_bytes_per_node_per_step": mb * 1e6, "median_step_time_s": step, "step_times_s": [step] * 5,
                "final_loss": 1.0}
    rows = {"ep": row(4.0, 1.0), "sequential": row(3.0, 1.2), "vela": row(1.0, 0.6), "improved": row(1.0, 0.5)}
    for r in rows.values():
        r["bytes_vs_ep"] = r["cross_bytes_per_node_per_step"] / 4e6 - 1
        r["step_time_vs_ep"] = r["median_step_time_s"] / 1.0
    return {"datasets": {"wikitext": rows, "alpaca": rows},
            "links": {"tcp": {"intra_bytes_per_s": 2e8, "cross_bytes_per_s": 1.25e7, "ratio": 16.0},
                      "cross_mbit": 102.0},
            "settings": {"intra_mbit": 1600.0, "ratio": 15.6, "batch_size": 8, "seq_len": 128, "lr": 3e-5,
                         "warmup_steps": 2, "limit": 1500}}


def test_paper_rows_put_the_papers_ranges_beside_vela_only():
    rows = {(r["dataset"], r["method"]): r for r in report.paper_rows(_fake_results())}
    assert rows[("wikitext", "vela")]["paper_bytes_vs_ep"] == report.PAPER_TRAFFIC_VS_EP["wikitext"]
    assert rows[("alpaca", "improved")]["paper_bytes_vs_ep"] == report.PAPER_TRAFFIC_VS_EP["alpaca"]
    assert rows[("alpaca", "sequential")]["paper_bytes_vs_ep"] is None
    assert rows[("wikitext", "vela")]["bytes_vs_ep"] == pytest.approx(-0.75)
    assert rows[("wikitext", "vela")]["step_vs_ep"] == pytest.approx(-0.4)


def test_write_paper_writes_table_json_and_both_figures(tmp_path):
    report.write_paper(_fake_results(), tmp_path)
    text = (tmp_path / "paper.md").read_text()
    assert "-25.3% … -18.1%" in text and "-28.2% … -20.6%" in text and "ratio 16.0" in text
    assert {"paper.md", "paper.json", "fig5_traffic.png", "fig6_step_time.png"} <= {p.name for p in tmp_path.iterdir()}


def test_render_predicts_every_vela_run_of_a_stored_set_from_its_summaries(tmp_path, monkeypatch):
    """--render runs nothing: each vela-ray run's step is predicted from what its summary stored (latencies and
    the workers' compute as measured at start-up, the master's compute from the run, as these runs predate its
    measurement), against the round trips the run measured, not the shaped - unshaped difference."""
    saved = json.loads((STORED / "results.json").read_text())
    shutil.copy(STORED / "results.json", tmp_path / "results.json")
    monkeypatch.setattr(report.paper_scale, "simulate", lambda: saved["paper_scale"])  # not what is tested
    vela_vs_ep.render(tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())["datasets"]["wikitext"]
    ep = rows["ep"]["step_prediction"]  # from the improved run's routing, the TCP probes and the serial compute
    assert ep["predicted"]["step"] == pytest.approx(sum(ep["predicted"][k] for k in ("compute", "all_to_all",
                                                                                      "allreduce")))
    assert abs(ep["step_error"]) < 0.25
    for method in ("improved", "tp2"):
        p = rows[method]["step_prediction"]
        assert p["inputs"] == {"latency": "start-up", "worker compute": "start-up", "master compute": "run"}
        assert p["predicted"]["master"] == p["measured"]["master"]
        assert p["step_error"] == pytest.approx(p["predicted"]["step"] / p["measured"]["step"] - 1)
        assert "measured_comm_s" not in rows[method]
    text = (tmp_path / "results.md").read_text()
    assert "| data set | method | step s | predicted | error | round trips s |" in text
    assert "measured comm" not in text and "Predicted step against the measured one: " in text
    assert "| data set | step s | predicted | error | compute | all-to-all | all-reduce |" in text


def _stored_run(method: str) -> RunSummary:
    raw = json.loads((STORED / "results.json").read_text())["raw"]["runs"]["wikitext"][method]["summary"]
    return RunSummary.model_validate(raw)


def test_a_run_that_measured_its_step_at_start_up_is_predicted_from_its_own_problem():
    summary = _stored_run("improved")
    problem = summary.placement.problem.model_copy(update={
        "latencies_s": [1e-3] * 6, "training_step": TrainingStep(master_compute_s=0.05, micro_batches=2)})
    summary = summary.model_copy(update={"placement": summary.placement.model_copy(update={"problem": problem})})
    p = report.step_prediction(summary, micro_batches=1, warmup=2)  # the problem's micro-batches, not these
    assert set(p["inputs"].values()) == {"start-up"}
    assert p["predicted"]["master"] == 0.05
    assert p["predicted"]["step"] == pytest.approx(predict_step(problem, summary.placement.tables()).step_s)


def test_the_masters_compute_is_the_step_less_its_idle_wait_or_its_whole_wait_in_runs_before_that():
    summary = _stored_run("improved")
    history = [StepRecord(step=i, loss=1.0, step_time_s=1.0, expert_round_trip_s=0.8, master_idle_s=0.5)
               for i in range(3)]
    assert report.measured_parts(summary.model_copy(update={"history": history}), 0) == {
        "step": 1.0, "round_trips": 0.8, "master": 0.5}  # several in flight: the waits overlap the master
    before = [h.model_copy(update={"master_idle_s": 0.0}) for h in history]
    assert report.measured_parts(summary.model_copy(update={"history": before}), 0)["master"] == pytest.approx(0.2)


def test_mixtral_probs_keeps_real_32_layer_profiles_and_can_skip_the_permutation():
    rng = np.random.default_rng(0)
    real = rng.dirichlet(np.ones(8), size=32) * 2
    assert np.array_equal(paper_scale.mixtral_probs(real), real)
    tiny = rng.dirichlet(np.ones(8), size=4) * 2
    untiled = paper_scale.mixtral_probs(tiny, permute=False)
    assert untiled.shape == (32, 8)
    assert all(np.array_equal(untiled[l], tiny[l // 8]) for l in range(32))
    tiled = paper_scale.mixtral_probs(tiny, seed=0)
    assert not np.array_equal(tiled, untiled)
    assert np.allclose(np.sort(tiled, axis=1), np.sort(untiled, axis=1))  # the same rows, ids permuted


def _brute_force_nic_bytes(probs, table, rank_nodes, rank_tokens, bytes_per_row) -> float:
    """Each of the four transfers on its own: the rows every rank sends to each other, per direction of each NIC
    (rows out and gradients out go one way, outputs and input gradients the other), the busiest one per transfer."""
    per_transfer = bytes_per_row / 4
    total = 0.0
    for layer in range(probs.shape[0]):
        for backwards in (False, True, False, True):  # rows out, outputs back, grads out, grads back
            sent = {n: 0.0 for n in set(rank_nodes)}
            got = dict(sent)
            for src, tokens in enumerate(rank_tokens):
                for expert, owner in enumerate(table[layer]):
                    a, b = rank_nodes[src], rank_nodes[owner]
                    if a != b:
                        a, b = (b, a) if backwards else (a, b)
                        sent[a] += tokens * probs[layer, expert] * per_transfer
                        got[b] += tokens * probs[layer, expert] * per_transfer
            total += max(max(sent[n], got[n]) for n in sent)
    return total


def test_ep_exchange_lasts_the_busiest_nic_direction_of_every_all_to_all():
    """A hot expert's node receives more than it sends: each all-to-all lasts that direction, not half of
    all the bytes through the NIC."""
    probs = np.array([[1.4, 0.2, 0.2, 0.2], [0.5, 0.5, 0.5, 0.5]])  # layer 0: expert 0 hot
    table = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    nodes, tokens, row = ["a", "a", "b", "b"], [10.0, 20.0, 30.0, 40.0], 16.0
    exchange = paper_scale.ep_exchange(probs, table, nodes, tokens, row)
    assert exchange["nic_bytes"] == pytest.approx(_brute_force_nic_bytes(probs, table, nodes, tokens, row))
    # layer 0: node a's ranks send 30 tokens x 0.4 rows out and get 70 x 1.6 rows in (expert 0 is hot)
    assert exchange["nic_bytes"] > 0.5 * exchange["cross_bytes"] / 2 * 1.5
    cross = sum(tokens[s] * probs[l, e] * row for l in range(2) for s in range(4) for e in range(4)
                if nodes[s] != nodes[table[l, e]])
    assert exchange["cross_bytes"] == pytest.approx(cross)
    loop_a = sum(tokens[s] * probs[l, e] * row for l in range(2) for s in (0, 1) for e in (0, 1) if s != e)
    loop_b = sum(tokens[s] * probs[l, e] * row for l in range(2) for s in (2, 3) for e in (2, 3) if s != e)
    assert exchange["loopback_bytes"] >= max(loop_a, loop_b) - 1e-9


def test_ep_step_prediction_spreads_compute_over_the_cores_and_adds_the_exchanges():
    summary = _stored_run("ep")
    profile = _stored_run("improved").placement.problem
    tcp = {"cross_bytes_per_s": 1e7, "intra_bytes_per_s": 2e8}
    two = report.ep_step_prediction(summary, profile, tcp, serial_compute_s=0.6, cores=2, batch_size=8, warmup=2)
    many = report.ep_step_prediction(summary, profile, tcp, serial_compute_s=0.6, cores=64, batch_size=8, warmup=2)
    assert two["predicted"]["compute"] == pytest.approx(0.3)  # 6 ranks on 2 cores
    assert many["predicted"]["compute"] == pytest.approx(0.6 * 2 / 8)  # ranks 0 and 1 hold 2 of the 8 rows
    assert two["predicted"]["all_to_all"] == many["predicted"]["all_to_all"] > 0
    faster = report.ep_step_prediction(summary, profile, {k: 2 * v for k, v in tcp.items()}, 0.6, 2, 8, 2)
    assert faster["predicted"]["all_to_all"] == pytest.approx(two["predicted"]["all_to_all"] / 2)


def test_cpu_sampler_counts_the_machines_busy_seconds_and_the_masters(tmp_path):
    """A process titled as master 0's actor spins a core while sampled: the machine and the master both count it."""
    title = tmp_path / "vela-test-master"  # its cmdline[0], as Ray titles an actor's process "ray::MasterActor"
    title.symlink_to(sys.executable)
    spin = subprocess.Popen([str(title), "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)  # started
        with vela_vs_ep.CpuSampler(interval_s=0.05, master_title=str(title)) as cpu:
            time.sleep(1.0)
    finally:
        spin.kill()
        spin.wait()
    record = cpu.record()
    assert record["cores"] == os.cpu_count() and len(record["samples"]) >= 5
    busy = vela_vs_ep.busy_fraction(record, 0.0, 2.0)
    assert 0.3 / record["cores"] < busy["machine"] <= 1.1  # /proc/stat counts in 10 ms ticks
    assert 0.3 < busy["master"] <= 1.1  # one core at most (less when the machine is loaded)
    assert vela_vs_ep.busy_fraction(record, 5.0, 6.0) is None  # no samples there


def test_cluster_spec_leaves_intra_node_links_unshaped_by_default():
    assert ClusterSpec().intra_mbit is None
    assert ClusterSpec(intra_mbit=1600).intra_mbit == 1600


def _can_shape() -> bool:
    try:
        check_can_shape("velatsp")
        return True
    except ShapingUnavailable:
        return False


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not _can_shape(), reason="needs root and netns + tbf")
def test_intra_mbit_puts_a_tbf_on_every_nodes_loopback():
    spec = ClusterSpec(num_nodes=2, prefix="velatsp", subnet="10.201.9", cross_mbit=100, intra_mbit=1600)
    cluster = EmulatedCluster(spec)
    try:
        cluster.up(start_ray=False)
        for node in range(2):
            qdisc = subprocess.run(["ip", "netns", "exec", spec.netns(node), "tc", "qdisc", "show", "dev", "lo"],
                                   capture_output=True, text=True, check=True).stdout
            assert "tbf" in qdisc
    finally:
        cluster.down()
