"""Tensor parallelism of the master's backbone (issue 37): attention by heads, dense MLPs by columns, with LoRA.

`parallelize_backbone(model, mesh)` shards a (peft-wrapped) transformers causal LM over a TP group in place, in
the Megatron layout (thesis §3.1.1): in each attention block Q/K/V are column-parallel (a rank keeps whole
heads) and O is row-parallel; in each dense or shared-expert MLP gate/up are column-parallel and down is
row-parallel. Everything else (norms, routers, the routed experts, MoE blocks' own code) runs replicated:
identical inputs, identical computation, identical outputs on every rank.

LoRA follows the thesis's rule (§3.2): on a column-parallel W, `lora_A` is replicated and `lora_B` sharded on
its output dim; on a row-parallel W, `lora_A` is sharded on its input dim and `lora_B` replicated, and
`x_i A_i B` is added to the partial `x_i W_i` before the block's all-reduce. peft's own `LoraLayer`s are what
is sharded (their parameters become the local shards, their forward is peft's): the adapter stays peft's, and
`gather_lora_state_dict` gives back peft's full adapter whatever the TP size.

In the runtime (`cluster.master_tp`, `runtime.masters.MasterGroup`)
-------------------------------------------------------------
A master's ranks join one mesh (`join_mesh`: dims "dp" x "tp", the process's default group). The routed experts
are the ExpertManagers', reached through brokers: on a TP rank each broker sends only its share of the layer's
tokens (`TensorParallelShare`), so the group's rows leave once. Checkpoints hold full tensors (`merge_shards` on
rank 0, `shard_of` on load), so a run resumes at any TP size. With several data-parallel masters, `shard_frozen`
(FSDP2, `masters.shard_frozen_backbone`) also shards every decoder layer's frozen weights over "dp", LoRA left
whole.

A TP group is a 1-D DeviceMesh or a process group, registered with torch.distributed (`join_mesh`'s) or not
(one made directly, as `collective.make_group` makes them, so that a group's ranks may be threads of one
process): everything runs on the group's own `rank()`/`size()` and plain all-reduces and all-gathers, but the
vocab-parallel embedding and LM head, DTensors on a DeviceMesh, which stay replicated over an unregistered group.

The package, one concern a module (each module's docstring says why it is as it is)
-----------------------------------------------------------------------------------
  plan       what a split is: its options (`TensorParallelConfig`) and what it did (`TensorParallelPlan`)
  group      the TP group, registered with torch.distributed or not: where its collectives run
  backbone   sharding the backbone (`parallelize_backbone`), what is refused (`check_tensor_parallel`), MLA
  regions    the TP regions' operators (Megatron's `f` and `g`): why LoRA adds no collective
  dropout    LoRA dropout drawing peft's masks on every rank (`ShardedDropout`, `agree_on_rng`)
  vocab      the embedding and LM head, vocab-parallel with torch's plans (`vocab_shardable`)
  mesh       a master process joining its dp x tp mesh (`join_mesh`)
  norms      gradient norms and sums over the group (`grad_sq_norm`, `clip_grad_norm_`, `all_sum`)
  state      full tensors whatever the TP size: the adapter (`gather_lora_state_dict`, `load_lora_state_dict`)
             and checkpoints (`merge_shards`, `shard_of`)
  row_share  the broker's share of a MoE layer's rows (`TensorParallelShare`, `row_bounds`,
             `refuse_grouped_experts`)
  frozen     the frozen backbone over data-parallel masters (FSDP2: `shard_frozen`, `decoder_layers`)

What is public is re-exported here: `from vela_ray.model.tensor_parallel import parallelize_backbone`.
"""

from __future__ import annotations

from vela_ray.model.tensor_parallel.backbone import check_tensor_parallel, parallelize_backbone
from vela_ray.model.tensor_parallel.dropout import ShardedDropout, agree_on_rng
from vela_ray.model.tensor_parallel.frozen import decoder_layers, shard_frozen
from vela_ray.model.tensor_parallel.mesh import join_mesh
from vela_ray.model.tensor_parallel.norms import all_sum, clip_grad_norm_, grad_sq_norm
from vela_ray.model.tensor_parallel.plan import Style, TensorParallelConfig, TensorParallelPlan
from vela_ray.model.tensor_parallel.row_share import TensorParallelShare, refuse_grouped_experts, row_bounds
from vela_ray.model.tensor_parallel.state import gather_lora_state_dict, load_lora_state_dict, merge_shards, shard_of
from vela_ray.model.tensor_parallel.vocab import vocab_shardable

__all__ = [
    "ShardedDropout", "Style", "TensorParallelConfig", "TensorParallelPlan", "TensorParallelShare", "agree_on_rng",
    "all_sum", "check_tensor_parallel", "clip_grad_norm_", "decoder_layers", "gather_lora_state_dict", "grad_sq_norm",
    "join_mesh", "load_lora_state_dict", "merge_shards", "parallelize_backbone", "refuse_grouped_experts",
    "row_bounds", "shard_frozen", "shard_of", "vocab_shardable",
]
