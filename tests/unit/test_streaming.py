"""The master's frozen backbone streamed from host memory through a device buffer of a few decoder layers
(`masters.streaming`, `vela_ray.model.streaming`): exact, bounded, overlapped, and refused where it cannot run.

On the CPU the device is the stand-in the module describes (slots filled by a background thread), so all of it
runs here; the tiny models get 4 decoder layers so that a buffer of 2 slots must evict and re-upload.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.equivalence import micro_batches, scattered_placement
from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray.config import JobConfig
from vela_ray.model import wire
from vela_ray.model.experts import LoraSpec
from vela_ray.model.families import debug_model
from vela_ray.model.streaming import StreamedLayer, stream_backbone
from vela_ray.model.tensor_parallel import decoder_layers
from vela_ray.observability.report import summary_text
from vela_ray.training.master import build_local
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.step import forward_backward
from vela_ray.training.zo import ZoTrainer, forward_loss, perturb

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LAYERS, BLOCKS = 4, 2


def _zo_job(model_dir, out, **masters) -> dict:
    return job_dict(model_dir, out, steps=2, masters=masters,
                    training={"method": "zo", "zo": {"eps": 1e-2}, "optimizer": {"lr": 1e-2}})


def _zo_full_job(model_dir, out, **masters) -> dict:
    """Full-parameter ZO: the streamed layers' host copies are written between passes, so the slots (the next pass's
    first layers, prefetched) are refilled from what was written."""
    return job_dict(model_dir, out, steps=2, masters=masters,
                    training={"method": "zo", "zo": {"eps": 1e-2, "parameters": "full"}, "optimizer": {"lr": 1e-4}})


def _first_order_job(model_dir, out, **masters) -> dict:
    return job_dict(model_dir, out, steps=2, masters=masters, training={"optimizer": {"lr": 1e-2}})


@pytest.mark.job
@pytest.mark.parametrize("family, job, masters", [
    ("mixtral", _zo_job, {}), ("qwen3_moe", _zo_job, {}), ("mixtral", _zo_full_job, {}),
    ("mixtral", _first_order_job, {}), ("qwen3_moe", _first_order_job, {}), ("deepseek_v3", _first_order_job, {}),
    ("mixtral", _first_order_job, {"count": 2}),  # two data-parallel masters, each streaming its own backbone
], ids=["zo-mixtral", "zo-qwen3_moe", "zo-full-mixtral", "sft-mixtral", "sft-qwen3_moe", "sft-deepseek_v3",
        "sft-2-masters"])
def test_a_streamed_job_equals_the_resident_one_bitwise(family, job, masters, tmp_path, caplog):
    model_dir = make_checkpoint(tmp_path / "model", family=family, num_hidden_layers=LAYERS)
    resident = run_in_process(JobConfig.from_dict(job(model_dir, tmp_path / "resident", **masters)))
    with caplog.at_level(logging.INFO, logger="vela_ray.model.streaming"):
        streamed = run_in_process(JobConfig.from_dict(job(model_dir, tmp_path / "streamed", **masters,
                                                          streaming={"buffer_blocks": BLOCKS})))
    assert f"backbone streamed: {LAYERS} decoder layers" in caplog.text  # the job did stream
    record = streamed.streaming  # the summary says so, and what the slots held
    assert resident.streaming is None and record.layers == LAYERS and record.buffer_blocks == BLOCKS
    assert 0 < record.peak_bytes <= BLOCKS * record.slot_bytes < record.frozen_bytes and record.uploads > LAYERS
    assert f"backbone streamed (masters.streaming): {LAYERS} layers'" in summary_text(streamed)
    ours, theirs = (load_file(tmp_path / run / "adapter" / "adapter_model.safetensors")
                    for run in ("streamed", "resident"))
    assert ours.keys() == theirs.keys()
    if masters.get("count", 1) == 1:
        assert streamed.losses == resident.losses and streamed.eval_loss == resident.eval_loss
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        return
    # two masters' expert gradients reach the workers in either order: two resident runs differ as much
    torch.testing.assert_close(streamed.losses + [streamed.eval_loss], resident.losses + [resident.eval_loss],
                               rtol=1e-5, atol=0)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.job
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_streamed_job_with_micro_batches_in_flight_equals_the_serial_resident_one(family, tmp_path):
    """Four micro-batches in flight through 2 slots, their activations beyond 16 KiB offloaded: the serial resident
    run's numbers (to the order of the gradients' sum), each block uploaded once per wave."""
    model_dir = make_checkpoint(tmp_path / "model", family=family, num_hidden_layers=LAYERS)
    training = {"optimizer": {"lr": 1e-2}, "batch_size": 4, "micro_batch_size": 1}
    serial = run_in_process(JobConfig.from_dict(job_dict(model_dir, tmp_path / "serial", steps=2,
                                                         training=training)))
    streamed = {"streaming": {"buffer_blocks": BLOCKS}}
    one_by_one = run_in_process(JobConfig.from_dict(job_dict(model_dir, tmp_path / "one_by_one", steps=2,
                                                             masters=streamed, training=training)))
    budget = 16 * 1024  # bytes: most of the wave's activations go to host memory
    waves = run_in_process(JobConfig.from_dict(job_dict(
        model_dir, tmp_path / "waves", steps=2,
        masters={"streaming": {"buffer_blocks": BLOCKS, "activation_budget_bytes": budget}},
        training={**training, "overlap": {"micro_batches_in_flight": 4}})))
    # the steps' 4 micro-batches pass each block together (the profile's and eval's forwards upload as before)
    assert waves.streaming.uploads + 2 * 12 == one_by_one.streaming.uploads, (waves.streaming, one_by_one.streaming)
    assert 0 < waves.streaming.peak_activation_bytes <= budget < waves.streaming.offloaded_bytes
    assert "MiB offloaded to host memory" in summary_text(waves)
    torch.testing.assert_close(waves.losses + [waves.eval_loss], serial.losses + [serial.eval_loss], rtol=1e-5, atol=0)
    ours, theirs = (load_file(tmp_path / run / "adapter" / "adapter_model.safetensors") for run in ("waves", "serial"))
    for key, value in theirs.items():  # AdamW's first steps divide by the gradients' size: rel ~1e-7 shows as ~1e-6
        torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=1e-5)


def test_a_quantized_backbone_streams_too(tmp_path):
    model_dir = make_checkpoint(tmp_path / "model", num_hidden_layers=LAYERS)
    quantized = {"path": str(model_dir), "quantization": {"format": "int8", "experts": False}}
    runs = [run_in_process(JobConfig.from_dict({**_zo_job(model_dir, tmp_path / name, **masters), "model": quantized}))
            for name, masters in (("resident", {}), ("streamed", {"streaming": {"buffer_blocks": BLOCKS}}))]
    assert runs[0].losses == runs[1].losses


def _frozen_bytes(layer) -> tuple[int, int]:
    """(bytes, tensors) of `layer`'s frozen parameters and persistent buffers, counted here, not by the stream."""
    tensors = [p for p in layer.parameters() if not p.requires_grad]
    tensors += [b for name, b in layer.named_buffers() if "inv_freq" not in name]
    return sum(t.numel() * t.element_size() for t in tensors), len(tensors)


@pytest.mark.parametrize("upload_format, ratio, rtol", [("bfloat16", 0.5, 1e-2), ("float8", 0.3, 5e-2)])
def test_a_low_bit_upload_moves_fewer_bytes_and_computes_with_the_rounded_weights(upload_format, ratio, rtol):
    """`masters.streaming.upload_format` (LOSSY): an upload copies the block's low-bit form (half the bytes in bf16,
    about a quarter plus a scale per row in float8) and the slot decodes it; the loss moves by the rounding only, and
    every layer computes with exactly `wire.decode(wire.encode(w))`."""
    model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
    master, _ = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts), LoraSpec(r=4, alpha=8),
                            OptimizerConfig())
    batches = micro_batches(0)
    exact = forward_loss(master, batches)
    q_proj = decoder_layers(master.peft_model)[1].self_attn.q_proj.base_layer
    original = q_proj.weight.detach().clone()
    rounded = wire.decode(wire.encode(original, upload_format), torch.float32)
    stream = stream_backbone(master.peft_model, BLOCKS, torch.device("cpu"), upload_format)
    seen = []
    q_proj.register_forward_pre_hook(lambda module, _: seen.append(module.weight.detach().clone()))
    lossy = forward_loss(master, batches)
    assert lossy != exact and lossy == pytest.approx(exact, rel=rtol)
    assert seen and all(torch.equal(weight, rounded) for weight in seen)
    assert torch.equal(q_proj.weight.detach(), original)  # at rest: the exact host copy
    assert stream.upload_bytes <= ratio * stream.uploads * max(block.nbytes for block in stream.blocks)
    stream.close()


def test_a_full_parameter_zo_write_is_uploaded_in_its_low_bit_form_encoded_again():
    """Full-parameter ZO writes a streamed layer's exact host copy; with a low-bit `upload_format` the host's wire form
    is encoded again from it, so the next pass computes with the rounded written weights, not the old ones."""
    model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
    master, workers = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts),
                                  LoraSpec(r=4, alpha=8), OptimizerConfig())
    master.stream = stream = stream_backbone(master.peft_model, BLOCKS, torch.device("cpu"), "bfloat16")
    forward_loss(master, micro_batches(0))  # the slots hold layers, the next pass's first ones prefetched
    q_proj = decoder_layers(master.peft_model)[0].self_attn.q_proj.base_layer
    seen = []
    q_proj.register_forward_pre_hook(lambda module, _: seen.append(module.weight.detach().clone()))
    perturb(master, workers, [(5, 0.5)], "full")
    written = q_proj.weight.detach().clone()
    forward_loss(master, micro_batches(0))
    assert seen and torch.equal(seen[0], wire.decode(wire.encode(written, "bfloat16"), torch.float32))
    stream.close()


@pytest.fixture
def streamed_master():
    """A master over the tiny Mixtral with 4 decoder layers, its losses on 2 micro-batches before streaming, then
    streamed through 2 slots."""
    model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
    experts = model.config.num_local_experts
    master, workers = build_local(model, scattered_placement(LAYERS, experts), LoraSpec(r=4, alpha=8),
                                  OptimizerConfig())
    batches = micro_batches(0)
    before = forward_loss(master, batches)
    names = list(master.peft_model.state_dict())
    layer_bytes = [_frozen_bytes(layer) for layer in decoder_layers(master.peft_model)]
    stream = stream_backbone(master.peft_model, BLOCKS, torch.device("cpu"))
    yield master, workers, stream, batches, before, names, layer_bytes
    stream.close()


def test_the_streamed_forward_reads_the_buffer_and_equals_the_resident_one(streamed_master):
    master, _, stream, batches, before, names, _ = streamed_master
    assert all(isinstance(layer, StreamedLayer) for layer in decoder_layers(master.peft_model))
    assert list(master.peft_model.state_dict()) == names  # every tensor keeps its name (peft's, ZO's, checkpoints')
    slots = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in stream.slots]
    read = []
    q_proj = decoder_layers(master.peft_model)[LAYERS - 1].self_attn.q_proj.base_layer
    q_proj.register_forward_pre_hook(lambda module, _: read.append(module.weight.data_ptr()))
    assert forward_loss(master, batches) == before  # bitwise, with every layer evicted and uploaded again
    assert read and all(any(lo <= ptr < hi for lo, hi in slots) for ptr in read)  # computed from a slot
    assert not any(lo <= q_proj.weight.data_ptr() < hi for lo, hi in slots)  # at rest: the host copy


def test_the_buffer_holds_at_most_its_blocks_and_less_than_the_backbone(streamed_master):
    master, workers, stream, batches, _, _, layer_bytes = streamed_master
    ZoTrainer(eps=1e-2, seed=3).step(master, workers, batches, lr=1e-2, step=0)
    largest = max(nbytes + 64 * count for nbytes, count in layer_bytes)  # + each tensor's alignment to 64 bytes
    whole = sum(nbytes for nbytes, _ in layer_bytes)
    # 4 layers of the same shape, 2 in the buffer at once: half the backbone's frozen layer bytes
    assert 0 < stream.peak_bytes <= BLOCKS * largest
    assert stream.peak_bytes < whole and stream.frozen_bytes >= whole
    uploads = [e.layer for e in stream.trace if e.kind == "upload"]
    assert len(uploads) > LAYERS  # layers were evicted and uploaded again in the step's passes


def test_uploads_run_while_layers_compute(streamed_master):
    master, _, stream, batches, _, _, _ = streamed_master
    for layer in decoder_layers(master.peft_model):  # each compute lasts long enough for the copies queued before it
        layer.inner.self_attn.register_forward_pre_hook(lambda *_: time.sleep(0.01))
    forward_loss(master, batches)
    uploads = [e for e in stream.trace if e.kind == "upload"]
    computes = [e for e in stream.trace if e.kind == "compute"]
    assert [c.layer for c in computes] == list(range(LAYERS)) * len(batches)
    # each compute starts after its own layer's latest upload ended ...
    for c in computes:
        own = [u for u in uploads if u.layer == c.layer and u.start < c.start]
        assert own and own[-1].end <= c.start
    # ... and the next layers' uploads run during it
    assert any(u.start < c.end and c.start < u.end and u.layer != c.layer for u in uploads for c in computes)


def test_without_prefetch_each_layer_waits_for_its_own_upload_and_none_overlaps_a_compute():
    """`masters.streaming.prefetch: false`, APTMoE's "GPipe with naive offload" baseline: a layer is uploaded when it
    runs, so no copy overlaps any compute, and the losses are the prefetching stream's."""
    model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
    master, _ = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts), LoraSpec(r=4, alpha=8),
                            OptimizerConfig())
    before = forward_loss(master, micro_batches(0))
    stream = stream_backbone(master.peft_model, BLOCKS, torch.device("cpu"), prefetch=False)
    assert forward_loss(master, micro_batches(0)) == before
    uploads = [e for e in stream.trace if e.kind == "upload"]
    computes = [e for e in stream.trace if e.kind == "compute"]
    assert [c.layer for c in computes] == list(range(LAYERS)) * 2 and len(uploads) > LAYERS
    assert not any(u.start < c.end and c.start < u.end for u in uploads for c in computes)
    stream.close()


def test_a_buffer_as_large_as_the_backbone_uploads_each_layer_once():
    model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
    master, _ = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts), LoraSpec(r=4, alpha=8),
                            OptimizerConfig())
    before = forward_loss(master, micro_batches(0))
    stream = stream_backbone(master.peft_model, LAYERS + 2, torch.device("cpu"))
    assert stream.buffer_blocks == LAYERS  # no slot more than there are layers
    assert forward_loss(master, micro_batches(0)) == forward_loss(master, micro_batches(0)) == before
    assert sorted(e.layer for e in stream.trace if e.kind == "upload") == list(range(LAYERS))
    stream.close()


def _grads_and_uploads(in_flight: int, count: int = 4, fail: int | None = None):
    """LoRA gradients, summed loss and the uploads of one forward/backward of `count` micro-batches through 2 slots of
    4 layers (`forward_backward`), `in_flight` at once; micro-batch `fail` raises in its forward."""
    model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
    master, _ = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts), LoraSpec(r=4, alpha=8),
                            OptimizerConfig())
    master.stream = stream = stream_backbone(master.peft_model, BLOCKS, torch.device("cpu"))
    batches = micro_batches(0, count=count)

    def loss_fn(model, batch):
        if fail is not None and batch is batches[fail]:
            raise RuntimeError("micro-batch failed")
        if batch is batches[0]:
            time.sleep(0.2)  # the first micro-batch starts last: the others must wait for it at layer 1
        return model(**batch).loss

    try:
        loss = forward_backward(master.peft_model, batches, loss_fn, in_flight, stream=stream)
        grads = {name: p.grad.clone() for name, p in master.peft_model.named_parameters() if p.requires_grad}
        return grads, loss, stream.uploads
    finally:
        stream.close()


def test_micro_batches_in_flight_pass_the_layers_in_step_and_upload_each_block_once_per_wave():
    """GPipe's schedule through the buffer (`training.overlap.micro_batches_in_flight` with `masters.streaming`): 4
    micro-batches on 4 threads enter a layer only once all have entered the one before, and one backward runs over
    their losses, so the step uploads each block about once per pass instead of once per micro-batch; the gradients
    are the serial step's (summed in another order)."""
    serial_grads, serial_loss, serial_uploads = _grads_and_uploads(1)
    grads, loss, uploads = _grads_and_uploads(4)
    assert loss == pytest.approx(serial_loss, rel=1e-6)
    for name, value in serial_grads.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-5, atol=1e-7)
    # in step: the 4 layers forward + 2 again for the backward, as one micro-batch alone; serial: 6 for the first, 4
    # for each later one (its forward finds the last backward's 2 layers in the slots)
    assert uploads == LAYERS + 2 and serial_uploads == LAYERS + 2 + 3 * 4, (uploads, serial_uploads)
    two_waves = _grads_and_uploads(2)[2]  # 2 in flight: two waves of 2
    assert uploads < two_waves < serial_uploads


def _zo_steps(in_flight: int):
    model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
    master, workers = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts),
                                  LoraSpec(r=4, alpha=8), OptimizerConfig())
    master.stream = stream = stream_backbone(master.peft_model, BLOCKS, torch.device("cpu"))
    zo = ZoTrainer(1e-2, 0, "lora", in_flight)
    results = [zo.step(master, workers, micro_batches(step, count=4), 1e-2, step) for step in range(2)]
    stream.close()
    return results, stream.uploads


def test_zo_micro_batches_in_flight_pass_the_buffer_in_step_with_the_same_bits():
    """A ZO step's two passes over 4 micro-batches, all 4 in flight: each no-grad pass uploads each block once
    instead of once per micro-batch, and the losses (summed in micro-batch order) are the serial ones to the bit."""
    serial, serial_uploads = _zo_steps(1)
    waves, uploads = _zo_steps(4)
    assert waves == serial
    assert 3 * uploads <= serial_uploads, (uploads, serial_uploads)


def test_a_failing_micro_batch_in_flight_stops_the_step_without_leaving_the_others_waiting():
    with pytest.raises(RuntimeError, match="micro-batch failed"):
        _grads_and_uploads(4, fail=2)


def _streamed_gradients(activation_budget: int | None):
    """LoRA gradients of one micro-batch's forward/backward through 2 slots of 4 layers, and the stream."""
    model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
    master, _ = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts), LoraSpec(r=4, alpha=8),
                            OptimizerConfig())
    stream = stream_backbone(master.peft_model, BLOCKS, torch.device("cpu"), activation_budget=activation_budget)
    master.peft_model(**micro_batches(0)[0]).loss.backward()
    stream.close()
    return {name: p.grad for name, p in master.peft_model.named_parameters() if p.requires_grad}, stream


def test_saved_activations_beyond_the_budget_go_to_host_memory_and_the_gradients_are_the_same_bits():
    """`masters.streaming.activation_budget_bytes`: the streamed layers' saved activations stay on the device up to the
    budget, the rest is copied to host memory and back for the backward; the gradients do not change by a bit, and
    the count drops back to 0 once the backward freed the graph."""
    reference, unbounded = _streamed_gradients(10**12)
    everything = unbounded.peak_activation_bytes
    assert everything > 0 and unbounded.offloaded_bytes == 0
    for budget in (everything // 4, 0):
        grads, stream = _streamed_gradients(budget)
        assert all(torch.equal(grads[name], value) for name, value in reference.items())
        assert stream.peak_activation_bytes <= budget and stream.activation_bytes == 0
        assert stream.offloaded_bytes >= everything - budget and stream.offloads > 0


def test_only_what_is_not_streamed_goes_to_the_device():
    """Built in host memory, the master's layers' frozen weights never go to the device whole: streaming moves every
    other tensor there (the meta device stands in for a GPU: the move is visible, the bytes are not spent)."""
    model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
    master, _ = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts), LoraSpec(r=4, alpha=8),
                            OptimizerConfig())
    optimized = {id(p) for group in master.optimizer.param_groups for p in group["params"]}
    stream = stream_backbone(master.peft_model, BLOCKS, torch.device("meta"))
    streamed = {id(t) for layer in decoder_layers(master.peft_model)
                for t in [p for p in layer.parameters() if not p.requires_grad] + list(layer.buffers())
                if t.device.type == "cpu"}
    assert streamed and all(s.is_meta for s in stream.slots)
    for name, tensor in [*master.peft_model.named_parameters(), *master.peft_model.named_buffers()]:
        in_layer = ".layers." in name and not tensor.requires_grad and "inv_freq" not in name
        assert (id(tensor) in streamed) == in_layer and tensor.is_meta != in_layer, name
    assert {id(p) for p in master.trainable_parameters()} == optimized  # moved in place: the optimizer's own
    stream.close()


def test_a_backward_uploads_each_block_again_from_the_last_layer_and_its_gradients_are_the_resident_ones():
    """Forward and backward through 2 slots of 4 layers: the graph keeps no slot (the buffer never holds more than
    its 2 blocks), the backward uploads the evicted layers again, last first, and every LoRA gradient is the
    resident model's to the bit."""
    model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
    master, _ = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts), LoraSpec(r=4, alpha=8),
                            OptimizerConfig())
    batch = micro_batches(0)[0]

    def gradients() -> dict[str, torch.Tensor]:
        master.peft_model.zero_grad(set_to_none=True)
        master.peft_model(**batch).loss.backward()
        return {name: p.grad.clone() for name, p in master.peft_model.named_parameters() if p.requires_grad}

    resident = gradients()
    layer_bytes = [_frozen_bytes(layer) for layer in decoder_layers(master.peft_model)]
    stream = stream_backbone(master.peft_model, BLOCKS, torch.device("cpu"))
    streamed = gradients()
    assert streamed.keys() == resident.keys() and all(torch.equal(streamed[k], resident[k]) for k in resident)
    assert stream.peak_bytes <= BLOCKS * max(nbytes + 64 * count for nbytes, count in layer_bytes)
    uploads = [e.layer for e in stream.trace if e.kind == "upload"]
    # the forward 0..3 (no wrap: layers 2 and 3 stay for the backward), then the backward's 1 and 0 again
    assert uploads == [0, 1, 2, 3, 1, 0]
    stream.close()


@pytest.mark.parametrize("masters, extra, message", [
    ({"streaming": {"buffer_blocks": 1}}, {},
     r"^.*masters.streaming.buffer_blocks: must be greater than or equal to 2 \(got 1\)$"),
    ({"streaming": {"buffer_blocks": 2}}, {"training": {"activation_checkpointing": True}},
     r"^config: masters.streaming.buffer_blocks \(2\) and training.activation_checkpointing do not combine: its "
     r"recompute runs a layer again inside the backward, .*; turn one off$"),
    ({"streaming": {"buffer_blocks": 3}}, {"cluster": {"master_tp": 2}},
     r"^config: masters.streaming.buffer_blocks \(3\) and cluster.master_tp above 1 do not combine: .*DTensor"),
    ({"streaming": {"buffer_blocks": 2}}, {"mode": "expert_parallel"},
     r"^config: masters.streaming.buffer_blocks \(2\) and mode: expert_parallel do not combine"),
    ({"streaming": {"buffer_blocks": 2, "upload_format": "bfloat16"}}, {"model": {"dtype": "bfloat16"}},
     r"^config: masters.streaming.upload_format: bfloat16 with model.dtype: bfloat16 saves nothing"),
])
def test_bad_streaming_settings_are_refused_in_one_line(tmp_path, masters, extra, message):
    job = job_dict(tmp_path, tmp_path / "out", masters=masters, **{k: v for k, v in extra.items() if k != "mode"})
    with pytest.raises(ValueError, match=message) as err:
        JobConfig.from_dict({**job, **{k: v for k, v in extra.items() if k == "mode"}})
    assert "\n" not in str(err.value)


@pytest.mark.gpu
def test_on_cuda_the_layers_stay_pinned_on_the_host_and_a_step_equals_the_resident_one():
    """A master built in host memory and streamed onto the GPU: the layers' frozen weights are pinned host views, the
    GPU holds the rest and 2 slots, and a forward and backward give the resident GPU model's loss and gradients."""
    cuda = torch.device("cuda")

    def master_on(streamed: bool):
        model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
        master, _ = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts),
                                LoraSpec(r=4, alpha=8), OptimizerConfig())
        stream = stream_backbone(master.peft_model, BLOCKS, cuda) if streamed else master.peft_model.to(cuda)
        return master, stream

    def step(master) -> tuple[float, dict[str, torch.Tensor]]:
        batch = {k: v.to(cuda) for k, v in micro_batches(0)[0].items()}
        loss = master.peft_model(**batch).loss
        loss.backward()
        return float(loss), {n: p.grad.cpu() for n, p in master.peft_model.named_parameters() if p.requires_grad}

    resident, _ = master_on(False)
    want = step(resident)
    streamed, stream = master_on(True)
    layer = decoder_layers(streamed.peft_model)[0].self_attn.q_proj.base_layer.weight
    assert layer.device.type == "cpu" and layer.is_pinned() and all(s.is_cuda for s in stream.slots)
    assert next(streamed.peft_model.parameters()).is_cuda  # the embedding
    got = step(streamed)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-5, atol=1e-7)
    stream.close()


@pytest.mark.gpu
def test_on_cuda_micro_batches_in_flight_with_offloaded_activations_give_the_serial_resident_gradients():
    """The CUDA paths of waves and offload: 4 micro-batches on 4 threads passing 2 slots in step (on the one compute
    stream, which orders a slot's reuse after its readers), their activations beyond 16 KiB in pinned host memory; the
    gradients are the resident GPU model's serial ones, each block uploaded once per pass."""
    cuda = torch.device("cuda")

    def master_on(streamed: bool):
        model = debug_model("mixtral", seed=0, num_hidden_layers=LAYERS)
        master, _ = build_local(model, scattered_placement(LAYERS, model.config.num_local_experts),
                                LoraSpec(r=4, alpha=8), OptimizerConfig())
        if streamed:
            master.stream = stream_backbone(master.peft_model, BLOCKS, cuda, activation_budget=16 * 1024)
        else:
            master.peft_model.to(cuda)
        return master

    def grads(master, in_flight: int) -> dict[str, torch.Tensor]:
        batches = [{k: v.to(cuda) for k, v in b.items()} for b in micro_batches(0, count=4)]
        forward_backward(master.peft_model, batches, in_flight=in_flight, stream=master.stream)
        torch.cuda.synchronize()
        return {n: p.grad.cpu() for n, p in master.peft_model.named_parameters() if p.requires_grad}

    want = grads(master_on(False), 1)
    streamed = master_on(True)
    got = grads(streamed, 4)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6)
    assert streamed.stream.uploads == LAYERS + 2 and streamed.stream.offloaded_bytes > 0
    streamed.stream.close()
