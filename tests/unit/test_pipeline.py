"""The master cut into pipeline stages (`masters.pipeline_stages`, `training.pipeline`): GPipe's ticks over the
stages' group move hidden states and their gradients, never change them. Stages as threads of one process
(`runtime.local.ThreadRanks`) train equal to one master and to single-process transformers + peft; the Ray form is
tests/ray/test_pipeline_job.py."""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
from vela_ray.config import JobConfig
from vela_ray.model.families import debug_model
from vela_ray.model.modeling import find_moe_blocks
from vela_ray.observability.report import summary_text
from vela_ray.training.pipeline import OutsideStage, keep_stage, stage_layers
from vela_ray.training.replicas import ThreadGroup

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


def test_stages_hold_contiguous_layers_as_even_as_they_divide():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert stage_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="masters.pipeline_stages \\(5\\) must be between 1 and the model's 4"):
        stage_layers(4, 5)


def _lora_model(family: str, layers: int = 4, **config):
    torch.manual_seed(0)
    model = debug_model(family, seed=0, vocab_size=300, num_hidden_layers=layers, **config)
    model.config.use_cache = False
    targets = ["o_proj", "q_b_proj"] if family == "deepseek_v3" else ["q_proj", "v_proj", "o_proj"]
    return get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))


def _run_stages(models, micro_batches, count: int) -> tuple[list[float], list]:
    group = ThreadGroup(count)
    stages = [keep_stage(models[s], s, count, group.member(s), find_moe_blocks(models[s])) for s in range(count)]
    with ThreadPoolExecutor(count) as pool:
        losses = list(pool.map(lambda s: stages[s].forward_backward(models[s], micro_batches,
                                                                    lambda m, b: m(**b).loss), range(count)))
    return losses, stages


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("count", [2, 4])
def test_stages_give_one_models_loss_and_every_lora_gradient(family, count):
    """The whole model's forward on every stage (its masks, positions, rotary embeddings), cut at the stage's
    boundaries: every stage returns the serial loss, and each LoRA gradient is on the one stage holding its layer,
    bitwise the serial one (the backward runs the micro-batches in the serial order)."""
    model = _lora_model(family)
    generator = torch.Generator().manual_seed(1)
    micro_batches = [{"input_ids": torch.randint(0, 300, (2, 8), generator=generator),
                      "labels": torch.randint(0, 300, (2, 8), generator=generator)} for _ in range(3)]
    serial = copy.deepcopy(model)
    total = 0.0
    for batch in micro_batches:
        loss = serial(**batch).loss / len(micro_batches)
        loss.backward()
        total += float(loss.detach())
    models = [copy.deepcopy(model) for _ in range(count)]
    losses, stages = _run_stages(models, micro_batches, count)
    assert losses == [total] * count
    expected = {n: p.grad for n, p in serial.named_parameters() if p.requires_grad}
    seen = set()
    for stage, staged in zip(stages, models):
        layers = staged.base_model.model.model.layers
        kept = [i for i, layer in enumerate(layers) if not isinstance(layer, OutsideStage)]
        assert kept == list(stage.layers)
        for name, param in staged.named_parameters():
            if param.requires_grad:
                assert torch.equal(param.grad, expected[name]), name
                seen.add(name)
    assert seen == set(expected)  # every LoRA tensor on exactly one stage (the names are unique across them)


def test_a_model_whose_loss_adds_the_router_aux_loss_is_refused_naming_the_setting():
    model = _lora_model("mixtral", output_router_logits=True)
    with pytest.raises(ValueError, match="router aux loss.*output_router_logits.*pipeline_stages: 1"):
        keep_stage(model, 0, 2, ThreadGroup(2).member(0), [])


def test_lora_outside_the_decoder_layers_is_refused_naming_the_module():
    torch.manual_seed(0)
    model = get_peft_model(debug_model("mixtral", seed=0, vocab_size=300, num_hidden_layers=4),
                           LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="lm_head.*trained outside the decoder layers"):
        keep_stage(model, 0, 2, ThreadGroup(2).member(0), [])


# --- whole jobs, stages as threads ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    made = {}
    for name, family, layers in [*((f, f, 4) for f in FAMILIES), ("mixtral_6", "mixtral", 6)]:
        made[name] = make_checkpoint(root / name / "model", family, num_hidden_layers=layers)
        init_adapter(made[name], root / name / "adapter")
    return made


def _config(model: Path, out: Path, stages: int, steps: int = 3, **sections) -> JobConfig:
    training = {"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}, "batch_size": 4,
                "micro_batch_size": 2, "eval_every": 2, **sections.pop("training", {})}
    return JobConfig.from_dict(job_dict(model, out, steps=steps, training=training,
                                        masters={"pipeline_stages": stages, **sections.pop("masters", {})},
                                        data_plane={"transport": "object_ref"},
                                        lora={"r": 4, "alpha": 8, "init_adapter": str(model.parent / "adapter")},
                                        **sections))


def _stage_bytes(model_dir: Path, stages: int) -> list[int]:
    """Each stage's share of the checkpoint's backbone bytes (fp32, experts left out): its own layers' tensors and
    those outside the layers (embedding, final norm, head), which every stage holds."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        sizes = {n: 4 * int(torch.tensor(f.get_slice(n).get_shape()).prod()) for n in f.keys() if ".experts." not in n}
    layer = {n: int(n.split("layers.")[1].split(".")[0]) if "layers." in n else None for n in sizes}
    num_layers = 1 + max(i for i in layer.values() if i is not None)
    return [sum(b for n, b in sizes.items() if layer[n] is None or layer[n] in own)
            for own in stage_layers(num_layers, stages)]


def _adapter(summary) -> dict[str, torch.Tensor]:
    return load_file(Path(summary.adapter_dir) / "adapter_model.safetensors")


@pytest.mark.job
@pytest.mark.parametrize("family,stages,sections", [
    ("mixtral", 4, {"training": {"activation_checkpointing": True}}),
    ("qwen3_moe", 2, {"expert_tiers": {"enabled": True, "cache_experts": 3}}),
    ("deepseek_v3", 4, {}),
    ("mixtral_6", 2, {"masters": {"streaming": {"buffer_blocks": 2}}}),
], ids=["mixtral-4-checkpointing", "qwen3_moe-2-tiers", "deepseek_v3-4", "mixtral_6-2-streamed"])
def test_a_pipelined_job_trains_equal_to_one_master_and_to_peft(models, tmp_path, family, stages, sections):
    """Losses, evaluations, the routing profile the placement was solved for, the bytes every worker saw and the
    exported adapter, with activation checkpointing, tiers or each stage's layers streamed from host memory: the
    stages' job is one master's (the adapter to the rounding of gradients summed in reverse
    micro-batch order), and its losses peft's."""
    one = run_in_process(_config(models[family], tmp_path / "one", 1, **copy.deepcopy(sections)))
    config = _config(models[family], tmp_path / "pp", stages, **copy.deepcopy(sections))
    piped = run_in_process(config)
    ref_losses, ref_state = reference_losses(config)
    torch.testing.assert_close(torch.tensor(piped.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(piped.losses), torch.tensor(one.losses), rtol=1e-6, atol=0)
    evals = [[h.eval_loss for h in s.history if h.eval_loss is not None] for s in (one, piped)]
    torch.testing.assert_close(torch.tensor(evals[1]), torch.tensor(evals[0]), rtol=1e-6, atol=0)
    profiles = [json.loads((Path(s.adapter_dir).parent / "profile.json").read_text())["counts"] for s in (one, piped)]
    assert profiles[1] == profiles[0]
    assert piped.traffic_bytes_by_worker == one.traffic_bytes_by_worker
    # the stages sent their own layers' rows (DeepSeek-V3's first layer is dense), together what one master sent
    assert len(piped.traffic_bytes_by_master) == stages and sorted(piped.traffic_bytes_by_master)[-2] > 0
    assert sum(piped.traffic_bytes_by_master) == sum(one.traffic_bytes_by_master)
    # each stage holds its own layers' frozen tensors and the embedding, norm and head (and a few rotary buffers)
    for run, count in ((one, 1), (piped, stages)):
        for held, expected in zip(run.stage_bytes, _stage_bytes(models[family], count), strict=True):
            assert 0 <= held - expected <= 1024, (held, expected)
    assert "pipeline stages on its node (frozen backbone by stage" in summary_text(Path(piped.adapter_dir).parent)
    if piped.streaming is not None:  # each stage streams its own 3 layers through 2 slots, evicting
        assert piped.streaming.layers == 3 and piped.streaming.uploads > 3 * piped.steps
    exported, alone = _adapter(piped), _adapter(one)
    assert exported.keys() == alone.keys() == ref_state.keys()
    for key, value in alone.items():
        torch.testing.assert_close(exported[key], value, rtol=1e-4, atol=1e-6)


@pytest.mark.job
@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 4)])
def test_a_run_saved_with_some_stages_resumes_with_others(models, tmp_path, saved, resumed):
    """A checkpoint holds every stage's tensors by name (stage 0 gathers them): a run saved at step 2 by `saved`
    stages resumes on `resumed` and steps on as the saved run did."""
    run = run_in_process(_config(models["mixtral"], tmp_path / "saved", saved, checkpoint={"every": 2}))
    job = _config(models["mixtral"], tmp_path / "resumed", resumed).model_dump(mode="json")
    job["checkpoint"]["resume"] = str(tmp_path / "saved" / "checkpoints" / "step-000002")
    again = run_in_process(JobConfig.from_dict(job))
    assert [r.step for r in again.resumes] == [2]
    torch.testing.assert_close(torch.tensor(again.losses), torch.tensor(run.losses), rtol=1e-5, atol=0)


@pytest.mark.parametrize("setting,match", [
    ({"masters": {"pipeline_stages": 2, "count": 2}}, "masters.count above 1"),
    ({"masters": {"pipeline_stages": 2}, "cluster": {"master_tp": 2}}, "cluster.master_tp above 1"),
    ({"masters": {"pipeline_stages": 2}, "lora": {"lora_dropout": 0.1, "expert_stacks": []}}, "lora.lora_dropout"),
])
def test_what_a_pipeline_cannot_run_with_is_refused_in_one_line(tmp_path, setting, match):
    with pytest.raises(ValueError, match=f"masters.pipeline_stages \\(2\\) and {match}.*turn one off"):
        JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", **setting))


def test_zo_refuses_a_pipeline_as_it_refuses_any_second_master_process(tmp_path):
    with pytest.raises(ValueError, match="training.method: zo and several master processes .*pipeline_stages"):
        JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", masters={"pipeline_stages": 2},
                                     training={"method": "zo"}))


def test_a_pipeline_runs_its_micro_batches_without_the_overlap_threads_saying_why(tmp_path):
    config = JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", masters={"pipeline_stages": 2},
                                          training={"overlap": {"micro_batches_in_flight": 2}}))
    assert config.training.overlap.in_flight(config) == 1
    assert config.master_processes == 2


def test_the_preflight_refuses_more_stages_than_layers_and_an_aux_loss_before_anything_starts(models, tmp_path):
    from vela_ray.preflight import preflight

    with pytest.raises(ValueError, match="masters.pipeline_stages \\(5\\) must be between 1 and the model's 4"):
        preflight(_config(models["mixtral"], tmp_path / "five", 5))
    aux = make_checkpoint(tmp_path / "aux", "mixtral", num_hidden_layers=4, output_router_logits=True)
    with pytest.raises(ValueError, match="router aux loss"):
        preflight(JobConfig.from_dict(job_dict(aux, tmp_path / "aux-out", masters={"pipeline_stages": 2})))
    assert preflight(_config(models["mixtral"], tmp_path / "four", 4)).config.masters.pipeline_stages == 4


def test_a_stage_reads_only_its_own_layers_and_what_every_stage_runs(models):
    """A stage built on the unread skeleton (every stage but master 0) keeps its layers before reading, so it reads
    its own layers' backbone tensors and the embedding, final norm and head, nothing of the other stages' layers;
    the stages together read the backbone once plus those shared tensors once per stage past the first."""
    from safetensors import safe_open

    from vela_ray.model.experts import LoraSpec
    from vela_ray.model.transport import InProcessTransport
    from vela_ray.training.master import MasterSpec, build_master_rank
    from vela_ray.training.schedule import OptimizerConfig

    model_dir = models["mixtral_6"]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    dtype_bytes = 4
    backbone = {n: dtype_bytes * int(torch.tensor(shape).prod()) for n, shape in sizes.items()
                if ".experts." not in n}
    layer_of = {n: int(n.split("layers.")[1].split(".")[0]) if "layers." in n else None for n in backbone}
    spec = MasterSpec(model_dir=model_dir, dtype=torch.float32, lora=LoraSpec(r=4, alpha=8), optim=OptimizerConfig(),
                      num_masters=3, pipeline_stages=3)
    group = ThreadGroup(3)
    read = []
    for index in range(3):
        master, stats = build_master_rank(spec, [[0] * 6] * 6, InProcessTransport([None]),  # no row travels here
                                          stage=(index, group.member(index)))
        own = master.stage.layers
        assert own == range(2 * index, 2 * index + 2)
        expected = sum(b for n, b in backbone.items() if layer_of[n] is None or layer_of[n] in own)
        assert stats.bytes_read == expected
        read.append(stats.bytes_read)
    shared = sum(b for n, b in backbone.items() if layer_of[n] is None)
    assert sum(read) == sum(backbone.values()) + 2 * shared


@pytest.mark.job
def test_without_a_start_adapter_every_stage_draws_one_masters_lora(models, tmp_path):
    """No `lora.init_adapter`: every rank draws its LoRA from the seeded RNG, and a stage hosted as a thread that
    builds first leaves the RNG as it found it (`build_master_rank`), so master 0 draws one master's; the adapter
    after a step is one master's bit for bit (it was not: the hosted stage's draws moved master 0's)."""
    def job(stages: int) -> JobConfig:
        raw = _config(models["mixtral"], tmp_path / f"pp{stages}", stages, steps=1).model_dump(mode="json")
        raw["lora"]["init_adapter"] = None
        return JobConfig.from_dict(raw)

    one, piped = (_adapter(run_in_process(job(stages))) for stages in (1, 2))
    assert one.keys() == piped.keys()
    for key, value in one.items():
        assert torch.equal(piped[key], value), key


@pytest.mark.job
def test_the_benchmark_s_stages_hold_their_share_of_the_layers_and_train_as_one_master(tmp_path):
    """`benchmarks/pipeline_stages.py` at toy size."""
    from benchmarks import pipeline_stages

    payload = pipeline_stages.main(["--out", str(tmp_path / "stages.json"), "--layers", "4", "--hidden", "64",
                                    "--stages", "1", "2", "--steps", "2", "--seq", "16", "--micro-batches", "2"])
    two = payload["setups"]["stages_2"]
    assert two["losses_equal_first"] and two["largest_stage_layers_vs_first"] == pytest.approx(0.5, abs=1e-3)
