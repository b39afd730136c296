"""`vela_ray.model.tensor_parallel` on gloo process groups against single-process transformers + peft (fp32).

For Mixtral, Qwen3-MoE (with a dense first layer), DeepSeek-V3 (MLA attention, dense first layer, shared
experts) and Qwen2-MoE (q/k/v biases, LoRA on the shared expert) debug models with 8 heads and T in {1, 2, 4}: one training step's losses, gradients and adapter equal
peft's at rel 1e-5, replicated LoRA factors stay bitwise equal on every rank, and LoRA adds no collective to the
base TP's per layer. One fork of T processes runs every family (tests/tp_harness.py); its results are cached for
the module, so the first test of each T pays for it (a few seconds at T=4 on 2 cores). The same step also runs
with the ranks as threads of this process, over a gloo group torch.distributed does not know.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests import tp_harness
from tests.tp_harness import FAMILIES, OVERRIDES
from vela_ray.model.families import debug_model
from vela_ray.model.tensor_parallel import TensorParallelConfig, check_tensor_parallel

RTOL = 1e-5
SIZES = [1, 2, 4]

_runs: dict[tuple[int, str], dict] = {}
_references: dict[str, dict] = {}


def _run(size: int, job: str = "step") -> dict:
    if (size, job) not in _runs:
        _runs[size, job] = tp_harness.spawn(size, job)
    return _runs[size, job]


def _reference(family: str) -> dict:
    if family not in _references:
        _references[family] = tp_harness.reference(family)
    return _references[family]


def _assert_close_to_scale(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Each tensor within RTOL of the reference tensor's scale (its largest |element|): sums over ranks add in
    another order, so an element that is ~0 by cancellation cannot be held to its own magnitude."""
    assert got.keys() == want.keys(), (sorted(set(got) ^ set(want)))[:4]
    for key, ref in want.items():
        assert got[key].shape == ref.shape, (what, key, got[key].shape, ref.shape)
        torch.testing.assert_close(got[key], ref, rtol=RTOL, atol=RTOL * float(ref.abs().max()), msg=f"{what} {key}")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_step_matches_peft(family, size):
    """Loss, gradients, one AdamW step (default optimizer, TP-aware clipping) and the next loss."""
    _assert_step_matches(_run(size)[family], _reference(family))


def _assert_step_matches(got: dict, want: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["loss0"]), torch.tensor(want["loss0"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(got["loss1"]), torch.tensor(want["loss1"]), rtol=RTOL, atol=0)
    assert want["loss1"] != want["loss0"]  # the step changed the adapter
    torch.testing.assert_close(torch.tensor(got["norm"]), torch.tensor(want["norm"]), rtol=RTOL, atol=0)
    assert want["norm"] > tp_harness.OPTIM.max_grad_norm  # so the clip coefficient mattered
    _assert_close_to_scale(got["grads"], want["grads"], "grad")
    # replicated factors (colwise lora_A, rowwise lora_B, MLA's a-projections, experts): the same bits everywhere
    assert got["spread"] == 0.0


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_gathered_adapter_is_peft_adapter_after_the_step(family, size):
    got, want = _run(size)[family], _reference(family)
    _assert_close_to_scale(got["adapter"], want["adapter"], "adapter")
    # the default optimizer's adapter, gathered and loaded into plain peft, computes what peft's computes
    reloaded = tp_harness.reloaded_held_out_loss(family, got["default_adapter"])
    torch.testing.assert_close(torch.tensor(reloaded), torch.tensor(want["held_out"]), rtol=RTOL, atol=0)
    # loading a full adapter into a sharded model and gathering it back is lossless (resharding-agnostic)
    for key, value in got["adapter"].items():
        assert torch.equal(got["roundtrip"][key], value), key


def test_sharding_follows_the_thesis_rule():
    """Q/K/V (MLA: q_b/kv_b) colwise, O rowwise, dense/shared MLPs gate/up colwise and down rowwise; MLA's
    a-projections, routers and experts are not sharded."""
    styles = {family: _run(2)[family]["styles"] for family in FAMILIES}
    short = {family: {k.split("layers.")[1]: v for k, v in s.items()} for family, s in styles.items()}
    assert short["mixtral"] == {f"{i}.self_attn.{p}": ("rowwise" if p == "o_proj" else "colwise")
                                for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    qwen = short["qwen3_moe"]
    assert qwen["0.mlp.gate_proj"] == qwen["0.mlp.up_proj"] == "colwise" and qwen["0.mlp.down_proj"] == "rowwise"
    assert not any(k.startswith("1.mlp") for k in qwen)  # layer 1 is MoE: replicated
    deepseek = short["deepseek_v3"]
    for i in range(3):
        assert deepseek[f"{i}.self_attn.q_b_proj"] == deepseek[f"{i}.self_attn.kv_b_proj"] == "colwise"
        assert deepseek[f"{i}.self_attn.o_proj"] == "rowwise"
        assert f"{i}.self_attn.q_a_proj" not in deepseek and f"{i}.self_attn.kv_a_proj_with_mqa" not in deepseek
    assert deepseek["1.mlp.shared_experts.down_proj"] == "rowwise" and deepseek["0.mlp.up_proj"] == "colwise"


@pytest.mark.parametrize("size", [2, 4])
def test_lora_adds_no_collective_per_layer(size):
    """Per decoder layer, forward and backward: one all-reduce per TP region (attention; dense or shared-expert
    MLP), the same with and without LoRA. Outside the layers: the LM head's logits all-gather and its input-grad
    all-reduce (the embedding's all-reduce is not run: the counted forward starts from input embeddings)."""
    counts = _run(size, "comm")
    regions_per_layer = {"mixtral": [1, 1], "qwen3_moe": [2, 1], "deepseek_v3": [2, 2, 2], "qwen2_moe": [2, 2]}
    for family in FAMILIES:
        lora, plain = counts[family]["lora"], counts[family]["plain"]
        assert lora["forward"] == plain["forward"] and lora["backward"] == plain["backward"], (family, lora, plain)
        # the payload: forward unchanged (x_i A_i B joins the partial output), backward grown by exactly the
        # replicated factors whose partial gradients join the regions' all-reduces
        assert lora["forward_elements"] == plain["forward_elements"]
        assert plain["replicated_elements"] == 0 and lora["replicated_elements"] > 0
        assert lora["backward_elements"] - plain["backward_elements"] == lora["replicated_elements"], family
        for phase in ("forward", "backward"):
            per_layer = {k: n for k, n in lora[phase].items() if k[0] != "outside"}
            assert per_layer == {(f"layers.{i}", "allreduce"): n
                                 for i, n in enumerate(regions_per_layer[family])}, (family, phase, per_layer)
        assert {k: n for k, n in lora["forward"].items() if k[0] == "outside"} == {
            ("outside", "all_gather_into_tensor"): 1}
        assert {k: n for k, n in lora["backward"].items() if k[0] == "outside"} == {("outside", "all_reduce"): 1}


def test_refuses_attention_norms_over_all_heads():
    """OLMoE's q_norm/k_norm normalize over every head's features at once: not computable on a head shard."""
    with pytest.raises(ValueError, match=r"q_norm normalizes over 32 features \(all heads at once"):
        check_tensor_parallel(debug_model("olmoe"), 2)


def test_refuses_heads_not_divisible_by_the_tp_size():
    model = debug_model("mixtral", **OVERRIDES["mixtral"])  # 8 heads, 4 KV heads
    check_tensor_parallel(model, 4)
    with pytest.raises(ValueError, match="8 attention heads and 4 KV heads must both be divisible by the TP size 8"):
        check_tensor_parallel(model, 8)


@pytest.mark.parametrize("size", [2, 4])
def test_a_sharded_dropout_applies_its_columns_of_peft_s_mask(size):
    """Each rank of a row-parallel lora_A draws the whole input's mask, as peft's nn.Dropout does from the same
    RNG state, and keeps its columns: the ranks' outputs side by side are peft's output, and every rank's RNG
    ends where peft's does (the streams stay in step for the next draw)."""
    from vela_ray.model.tensor_parallel import ShardedDropout

    x = torch.randn(3, 5, 16)
    torch.manual_seed(11)
    want = torch.nn.Dropout(0.3).train()(x)
    after = torch.get_rng_state()
    parts = []
    for rank in range(size):
        torch.manual_seed(11)
        width = 16 // size
        parts.append(ShardedDropout(0.3, rank * width, (rank + 1) * width, 16).train()(x[..., rank * width:][..., :width]))
        assert torch.equal(torch.get_rng_state(), after)
    assert torch.equal(torch.cat(parts, -1), want)
    assert bool((want == 0).any()) and not torch.equal(want, x)  # it dropped something


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_lora_dropout_draws_peft_s_masks_on_every_rank(family, size):
    """LoRA dropout on every backbone adapter (colwise q/k/v and gate/up: replicated inputs; rowwise o and
    down: sharded inputs). Each rank starts from an RNG state of its own; `agree_on_rng` gives them rank 0's,
    so they draw one mask per input: the loss and gradients are peft's from rank 0's seed, and the ranks' RNG
    streams end in step with peft's."""
    got, want = _run(size, "dropout")[family], tp_harness.dropout_reference(family)
    assert got["draws_dropout"]
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), rtol=RTOL, atol=0)
    _assert_close_to_scale(got["grads"], want["grads"], "grad")
    assert all(torch.equal(state, want["rng"]) for state in got["rng_of_ranks"])
    torch.manual_seed(tp_harness.DROPOUT_SEED)
    plain = tp_harness.dropout_step(tp_harness.build_peft(family))
    assert plain["loss"] != want["loss"]  # dropout was on


def test_config_is_strict():
    assert TensorParallelConfig().shard_vocab is True
    with pytest.raises(ValueError):
        TensorParallelConfig(shard_vocb=False)


# --- the runtime's pieces (`cluster.master_tp`): rows split among ranks, checkpoints in full tensors ---------------

@pytest.mark.parametrize("rows,size", [(10, 4), (3, 4), (8, 2), (7, 1)])
def test_row_shares_tile_the_rows_in_rank_order(rows, size):
    from vela_ray.model.tensor_parallel import row_bounds

    bounds = [row_bounds(rows, rank, size) for rank in range(size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(hi == lo for (_, hi), (lo, _) in zip(bounds, bounds[1:]))  # contiguous, disjoint
    assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1


def test_a_state_merged_from_shards_reshards_to_any_size():
    """`merge_shards` / `shard_of` on `master.master_state`'s layout: a sharded parameter and its AdamW moments are
    split along the parameter's dim, its scalar `step` and replicated tensors are not."""
    from vela_ray.model.tensor_parallel import TensorParallelPlan, merge_shards, shard_of

    g = torch.Generator().manual_seed(0)
    full = {"a.lora_B.default.weight": torch.randn(8, 2, generator=g), "a.lora_B.default.weight.exp_avg":
            torch.randn(8, 2, generator=g), "a.lora_B.default.weight.step": torch.tensor(3.0),
            "o.lora_A.default.weight": torch.randn(2, 8, generator=g), "q.lora_A.default.weight": torch.randn(2, 4)}
    sharded = {"a.lora_B.default.weight": 0, "o.lora_A.default.weight": 1}
    for size in (1, 2, 4):
        plans = [TensorParallelPlan(group=None, rank=r, size=size, sharded=sharded) for r in range(size)]
        shards = [shard_of(full, plan) for plan in plans]
        assert shards[-1]["a.lora_B.default.weight.exp_avg"].shape == (8 // size, 2)
        assert shards[-1]["o.lora_A.default.weight"].shape == (2, 8 // size)
        assert shards[-1]["q.lora_A.default.weight"] is full["q.lora_A.default.weight"]
        merged = merge_shards(shards, plans[0])
        assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)


@pytest.mark.parametrize("family,size,refusal", [
    ("mixtral", 2, None),
    ("olmoe", 2, "q_norm normalizes over 32 features"),
    ("qwen3_moe", 4, "4 attention heads and 2 KV heads must both be divisible by the TP size 4"),
    ("llama4_text", 2, "is called on rows grouped by expert"),
])
def test_preflight_refuses_a_model_that_cannot_split_over_master_tp(tmp_path, family, size, refusal):
    from tests.fixtures import job_dict, make_checkpoint
    from vela_ray.config import JobConfig
    from vela_ray.preflight import check_master_tp

    config = JobConfig.from_dict(job_dict(make_checkpoint(tmp_path / "model", family), tmp_path / "out",
                                          cluster={"master_tp": size}))
    if refusal is None:
        check_master_tp(config)
        return
    with pytest.raises(ValueError, match=f"^cluster.master_tp: {size} .*{refusal}"):
        check_master_tp(config)


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_reading_only_its_shards_holds_what_a_whole_load_then_sharded_holds(tmp_path, size):
    """`master.build_master_rank` (the runtime's TP ranks), each alone on its node: every tensor equals the
    whole-load-then-shard rank's, LoRA draws included, and a rank reads its shards, not the whole backbone."""
    from tests.fixtures import make_checkpoint

    # a vocabulary of 264 splits over 4 ranks: embedding and LM head vocab-parallel, as a real model's are
    dirs = [str(make_checkpoint(tmp_path / family, family, vocab=264, **OVERRIDES[family]))
            for family in ("mixtral", "deepseek_v3")]
    ranks = tp_harness.spawn(size, f"load:1x{size}", dirs)
    for model_dir in dirs:
        figures = [ranks[r][model_dir][r] for r in range(size)]
        assert all(f["mismatched"] == [] for f in figures), (model_dir, [f["mismatched"][:3] for f in figures])
        backbone = figures[0]["backbone"]
        # each rank reads its 1/size of the sharded tensors and the small replicated ones (norms, routers, MLA's
        # low-rank projections) whole: nowhere near the backbone
        assert max(f["read"] for f in figures) < (1 / size + 0.25) * backbone, (figures, backbone)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_two_data_parallel_masters_of_two_tp_ranks_with_the_frozen_backbone_sharded_match_peft(family):
    """The 2-D mesh (data-parallel 2 x TP 2) with FSDP2 over the data-parallel masters: the step's loss and every
    LoRA gradient equal peft's, and each rank holds half of its TP shard of a decoder layer's frozen weights (the
    routed experts, which the runtime's masters do not hold, are replicated by TP and halved too)."""
    out = _run(4, "mesh")[family]
    ref = _reference(family)
    assert out["loss0"] == pytest.approx(ref["loss0"], rel=RTOL)
    _assert_close_to_scale(out["grads"], ref["grads"], f"{family} mesh grads")
    assert out["frozen_fraction"] == pytest.approx(0.5, abs=0.01)


# --- the ranks as threads of one process, over a gloo group torch.distributed does not know (issue 51) -------------

def _unregistered_groups_only() -> None:
    # no default group in this process: torch's helpers that look a group up (dist.get_rank, dist.get_backend,
    # dist.broadcast, DeviceMesh.from_group) fail on the ranks' groups, as they do in the in-process pool
    assert not dist.is_initialized()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_ranks_as_threads_over_an_unregistered_group_match_peft(family, size):
    """Each rank a thread of this process on a gloo group made directly (`collective.make_group`, one in-memory
    store): the step's losses, gradients and clipped norm, and the gathered adapter, equal peft's as the processes'
    do, and replicated factors are bitwise equal on every rank. The embedding and LM head stay replicated: torch's
    vocab-parallel plans need a registered group."""
    _unregistered_groups_only()
    ranks = tp_harness.in_threads(size, lambda group: tp_harness.tp_run(family, group))
    got, want = ranks[0], _reference(family)
    _assert_step_matches(got, want)
    _assert_close_to_scale(got["adapter"], want["adapter"], "adapter")
    assert all(torch.equal(got["roundtrip"][key], value) for key, value in got["adapter"].items())
    assert [rank["vocab_parallel"] for rank in ranks] == [[]] * size
    assert got["styles"] == _run(2)[family]["styles"]  # the same layers sharded, the same way, as over processes


def test_lora_dropout_refuses_ranks_that_are_threads_of_one_process():
    """Threads share the process's host RNG, so they cannot each draw peft's mask from rank 0's state (their masks
    would differ from each other's and peft's): `agree_on_rng`, which runs over the unregistered group (an
    all-gather; torch's broadcast needs a registered one), refuses them in one line."""
    from vela_ray.model.tensor_parallel import agree_on_rng, parallelize_backbone

    _unregistered_groups_only()

    def run(group):
        plan = parallelize_backbone(tp_harness.build_peft("mixtral", dropout=tp_harness.DROPOUT), group)
        assert plan.draws_dropout
        with pytest.raises(RuntimeError, match=r"^LoRA dropout under tensor parallelism: 2 ranks on the host in 1 "
                                               r"process\(es\); threads of one process share its host RNG"):
            agree_on_rng(plan)

    tp_harness.in_threads(2, run)
