"""ExpertManager: hosts the experts one worker owns and trains their LoRA adapters.

A plain class with no Ray in it (Ray Train v2 style): `actors.cluster.spawn_expert_managers`
is the one place that turns it into a Ray actor (one per GPU, or per CPU bundle in tests);
`vela_ray.training.step.build_local` and the in-process job runtime
(`vela_ray.runtime.local`) build it in this process.

    spec = ExpertManagerSpec(worker=0, model_dir="/ckpt", keys=[(0, 3), (1, 5)])
    manager = ExpertManager(spec)          # reads only experts (0, 3) and (1, 5)
    out_RD = manager.forward(ForwardRequest(layer=0, expert_ids=ids_R, rows=rows_RD, key=k))
    grad_RD = manager.backward(k, grad_out_RD)
    manager.step(lr, clip_coef)

Zero redundancy: the manager reads its own experts from the checkpoint
(`vela_ray.model.loading.read_experts`, memory-mapped); the master never sends expert
weights. Tests may pass in-memory `weights` instead of a `model_dir`.

Data plane: `forward`, `backward` (Ray object refs), or `join_collective`: a serving
loop on a thread of this process, answering the master over torch.distributed
(`vela_ray.model.collective`). Control plane: `grad_sq_norm`,
`step`, `zero_grad`, `lora_state`, `load_lora_state` (and `lora_grads` for tests);
`zo_apply` for zeroth-order training (`vela_ray.training.zo`).
Topology and sizing: `node_id`, `pid`, `bytes_per_expert`, `capacity`, `ping`.
APTMoE's CPU/device tiers (`spec.tiers`, `vela_ray.training.tiered`): the data plane computes each expert
on the CPU or the device; `tier_stats`, `set_tier_speeds`, `set_predictor`.
Live migration (`vela_ray.runtime.migration`): `expert_states` (what a leaving expert
carries), `rehost` (host a new key set, reading arriving experts' weights from the checkpoint).
Checkpoints: `save_checkpoint_part`, or asynchronously `snapshot_checkpoint_part` (copies, then
writes on a thread) and `finish_checkpoint_part` (polled by the master).

Any failure in the data plane is re-raised as `ExpertWorkerError` naming this
worker and the (layer, expert) keys involved, with the worker's traceback (Ray adds it,
the collective plane sends it along).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Hashable, Literal

import psutil
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import PretrainedConfig

from vela_ray.errors import ExpertWorkerError
from vela_ray.quiet import silence_known_warnings
from vela_ray.training import checkpoint
from vela_ray.model.experts import ExpertKey, ExpertShard, ExpertWeights, LoraSpec
from vela_ray.model import wire
from vela_ray.model.loading import checkpoint_prototypes, read_experts
from vela_ray.model.modeling import experts_prototypes
from vela_ray.training.optim import OptimizerConfig, ShardTrainer, ZoTerm, apply_zo_terms, grad_sq_norm
from vela_ray.model.traffic import LOCAL_NODE
from vela_ray.model.transport import ForwardRequest
from vela_ray.training.popularity import PopularityPredictor
from vela_ray.training.tiered import TieredExperts, seconds_per_row
from vela_ray.training.tiers import ExpertTiersConfig, TierCounters, TierSpeeds, request_seconds_per_row

logger = logging.getLogger(__name__)

LoraState = dict[ExpertKey, dict[str, torch.Tensor]]
# LoRA factors and AdamW slots of each expert, named as in a checkpoint part ("lora_A_up", "lora_A_up.exp_avg")
ExpertStates = dict[ExpertKey, dict[str, torch.Tensor]]
NotCounted = dict[int, list[ExpertKey]]
"""{worker: its copies of replicated experts that another worker counts (in norms and checkpoints)}."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Per LoRA parameter the worker keeps the value, its gradient and AdamW's two moments.
_LORA_COPIES = 4


class ExpertManagerSpec(BaseModel):
    """What one ExpertManager hosts and how it trains; plain data, sent to the actor once."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    worker: int = Field(ge=0, description="index of this worker in the placement table")
    keys: list[tuple[int, int]] = Field(description="the (MoE layer, expert) pairs this worker hosts")
    model_dir: str | None = Field(None, description="checkpoint to read the experts from (safetensors)")
    trust_remote_code: bool = Field(False, description="`model.trust_remote_code`: run the model's own code")
    weights: dict[tuple[int, int], dict[str, torch.Tensor]] | None = Field(
        None, description="in-memory {(layer, expert): {parameter: slice}} instead of model_dir (tests)"
    )
    # Any, checked below: transformers' configs are dataclasses whose annotations pydantic cannot resolve
    hf_config: Any = Field(
        None, description="the model's PretrainedConfig, whose experts classes compute; required with `weights`"
    )
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA rank and alpha of the expert adapters")
    optim: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW of the expert adapters")
    seed: int = Field(0, description="LoRA init seed, combined with each (layer, expert)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="the frozen experts' dtype, None keeps the stored one; LoRA factors and their AdamW "
                          "state are fp32 under bf16/fp16, as peft keeps them (`experts.adapter_dtype`)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the experts run")
    tiers: ExpertTiersConfig = Field(default_factory=ExpertTiersConfig, description="APTMoE's CPU/device tiers: "
                                     "experts in host memory, `device` only the tier of a bounded cache")

    @model_validator(mode="after")
    def _one_source(self) -> "ExpertManagerSpec":
        if (self.model_dir is None) == (self.weights is None):
            raise ValueError(f"worker {self.worker}: give exactly one of `model_dir` and `weights`")
        if self.weights is not None:
            missing = [k for k in self.keys if k not in self.weights]
            if missing:
                raise ValueError(f"worker {self.worker}: `weights` lacks experts {missing[:8]} listed in `keys`")
            if not isinstance(self.hf_config, PretrainedConfig):
                raise ValueError(f"worker {self.worker}: in-memory `weights` need the `hf_config` of their model "
                                 f"(a transformers PretrainedConfig, got {type(self.hf_config).__name__})")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"worker {self.worker}: `keys` lists an expert twice")
        return self


class MigrationStats(BaseModel):
    """What one worker's `rehost` took in: experts that arrived, their state over the wire, weights read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    worker: int
    arrived: int = Field(description="experts this worker now hosts that it did not before")
    state_bytes: int = Field(description="LoRA + AdamW bytes received from the experts' old workers")
    frozen_bytes: int = Field(description="frozen expert weights read from the model's checkpoint")


def load_expert_weights(spec: ExpertManagerSpec) -> tuple[ExpertWeights, dict]:
    """The spec's experts as {(layer, expert): {parameter: slice}} and each layer's experts prototype."""
    dtype = _DTYPES[spec.dtype] if spec.dtype else None
    if spec.weights is not None:
        weights = {k: {n: t.to(dtype) if dtype else t for n, t in spec.weights[k].items()} for k in spec.keys}
        return weights, experts_prototypes(spec.hf_config)
    trust = spec.trust_remote_code
    return (read_experts(spec.model_dir, list(spec.keys), dtype=dtype, trust_remote_code=trust),
            checkpoint_prototypes(spec.model_dir, trust))


class ExpertManager:
    """One worker's experts: an `ExpertShard` with its own AdamW (`ShardTrainer`)."""

    def __init__(self, spec: ExpertManagerSpec):
        silence_known_warnings()  # an actor process: Ray is imported by now, so the filters stay in front
        self.worker = spec.worker
        self.spec = spec
        self.device = torch.device("cpu" if spec.tiers.enabled else spec.device)  # tiered: the shard is in host memory
        weights, self.prototypes = load_expert_weights(spec)
        self._host(weights)
        self.received_bytes = 0  # rows and gradients that arrived here, as counted on this side of the link
        self.compute_s = 0.0  # wall seconds spent in expert forward/backward (the data plane's arithmetic)
        self._part_write: checkpoint.Background[str] | None = None  # the checkpoint part being written, if any
        logger.info("expert worker %d: hosting %d experts on %s", self.worker, len(self.keys), self.device)

    def _host(self, weights: ExpertWeights) -> None:
        """Build the shard and its AdamW over exactly `weights`' experts (fresh LoRA and optimizer state)."""
        self.keys: list[ExpertKey] = sorted(weights)
        self.shard = ExpertShard.from_weights(weights, self.spec.lora, self.prototypes,
                                              seed=self.spec.seed).to(self.device)
        # A placement may leave a worker without experts; torch's AdamW refuses an empty parameter list.
        self.trainer = ShardTrainer(self.shard, self.spec.optim) if self.keys else None
        self.dtype = next(iter(next(iter(weights.values())).values())).dtype if weights else torch.float32
        tiers = self.spec.tiers  # APTMoE's tiers (`vela_ray.training.tiered`): the data plane goes through them
        self.tiered = TieredExperts(self.shard, self.prototypes, self.spec.lora, tiers, torch.device(self.spec.device),
                                    self.worker, previous=getattr(self, "tiered", None)) if tiers.enabled else None

    # -- data plane -------------------------------------------------------------------------

    def forward(self, request: ForwardRequest) -> torch.Tensor:
        """Unweighted expert outputs [R, D] for the request's rows, on the CPU."""
        return self._forward(request).cpu()

    def backward(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        """d(rows) [R, D] for the forward saved under `key`, on the CPU."""
        return self._backward(key, grad).cpu()

    def forward_rows(self, layer: int, expert_ids: torch.Tensor, rows: torch.Tensor, key: Hashable | None = None):
        """`ExpertShard.forward_rows`'s call, so an `InProcessTransport` can serve rows from managers."""
        return self._forward(ForwardRequest(layer, expert_ids, rows, key))

    def backward_rows(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        return self._backward(key, grad)

    def _forward(self, request: ForwardRequest) -> torch.Tensor:
        self.received_bytes += request.rows.numel() * request.rows.element_size()
        start = time.perf_counter()
        try:
            rows_RD = wire.decode(request.rows.to(self.device), self.dtype)
            out_RD = (self.tiered or self.shard).forward_rows(request.layer, request.expert_ids, rows_RD, request.key)
            return wire.encode(out_RD, wire.reply_format(request.rows, self.dtype))
        except Exception as exc:
            experts = sorted({(request.layer, int(e)) for e in request.expert_ids.tolist()})
            raise self._error(f"forward of experts {experts} (key {request.key!r})", exc) from exc
        finally:
            self.compute_s += time.perf_counter() - start

    def _backward(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        self.received_bytes += grad.numel() * grad.element_size()
        start = time.perf_counter()
        try:
            grad_RD = (self.tiered or self.shard).backward_rows(key, wire.decode(grad.to(self.device), self.dtype))
            return wire.encode(grad_RD, wire.reply_format(grad, self.dtype))
        except Exception as exc:
            raise self._error(f"backward of key {key!r}", exc) from exc
        finally:
            self.compute_s += time.perf_counter() - start

    def _error(self, what: str, exc: Exception) -> ExpertWorkerError:
        hosted = self.keys if len(self.keys) <= 16 else f"{self.keys[:16]} ... ({len(self.keys)} in all)"
        return ExpertWorkerError(
            self.worker,
            f"{what} failed with {type(exc).__name__}: {exc}. This worker hosts {hosted}; if the experts "
            "differ, the placement table and the spawned workers' keys disagree: build both from one Placement",
        )

    def join_collective(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        """Join the master's data-plane group as rank `worker + 1` and serve rows on a thread of this
        process until the master stops it (`vela_ray.model.collective`). Returns once joined: the
        master's own join completes the group."""
        from vela_ray.model import collective

        self.leave_collective()
        store = collective.make_store(host, port, world_size, is_master=False, timeout_s=timeout_s)
        group = collective.make_group(store, self.worker + 1, world_size, timeout_s, collective.node_address())
        self._serving = threading.Thread(target=collective.serve, args=(group, self), daemon=True,
                                         name=f"vela-serve-{self.worker}")
        self._serving.start()

    def leave_collective(self, timeout_s: float = 30.0) -> bool:
        """Wait for the serving loop to end (after the master's stop); True if none is running."""
        thread = getattr(self, "_serving", None)
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                return False
            self._serving = None
        return True

    # -- control plane ----------------------------------------------------------------------

    def grad_sq_norm(self, not_counted: NotCounted | None = None) -> float:
        """Squared norm of this worker's LoRA gradients, without the experts `not_counted[self.worker]`
        (copies of replicated experts that another worker counts)."""
        skip = {tuple(k) for k in (not_counted or {}).get(self.worker, [])}
        if not self.trainer:
            return 0.0
        if not skip:
            return self.trainer.grad_sq_norm()
        return grad_sq_norm([p for key in self.keys if key not in skip for p in self.shard.expert(*key).parameters()])

    def step(self, lr: float, clip_coef: float) -> None:
        if self.trainer:
            self.trainer.step(lr, clip_coef)

    def zero_grad(self) -> None:
        if self.trainer:
            self.trainer.zero_grad()

    def zo_apply(self, terms: list[ZoTerm]) -> None:
        """Zeroth-order training (`vela_ray.training.zo`): add each (step seed, coefficient) term's noise to
        every hosted expert's LoRA. Each tensor's noise comes from its logical checkpoint name, so any
        placement adds the same numbers (and copies of a replicated expert stay identical)."""
        by_name = {key: dict(self.shard.expert(*key).named_parameters()) for key in self.keys}
        apply_zo_terms(checkpoint.expert_part_tensors(by_name), terms)

    def lora_state(self) -> LoraState:
        """This worker's adapters, keyed by logical (layer, expert), on the CPU."""
        return {key: {n: t.cpu() for n, t in params.items()} for key, params in self.shard.lora_state().items()}

    def lora_grads(self, keys: dict[int, list[ExpertKey]] | list[ExpertKey] | None = None) -> LoraState:
        """The accumulated LoRA gradients of `keys` (all hosted experts by default; a dict: this worker's
        entry), keyed like `lora_state`, on the CPU."""
        if isinstance(keys, dict):
            keys = keys.get(self.worker, [])
        return {
            key: {name: p.grad.detach().cpu().clone() for name, p in self.shard.expert(*key).named_parameters()}
            for key in (self.keys if keys is None else [tuple(k) for k in keys])
        }

    def set_lora_grads(self, grads: LoraState) -> None:
        """Overwrite the gradients of the hosted experts in `grads` (the summed gradients of replicated
        experts, so that every copy takes the same optimizer step)."""
        for key, named in grads.items():
            if tuple(key) in self.keys:
                for name, p in self.shard.expert(*key).named_parameters():
                    p.grad.copy_(named[name].to(p.grad.device))

    def load_lora_state(self, state: LoraState) -> None:
        """Load this worker's experts from `state` (a full or partial dict keyed by (layer, expert))."""
        missing = [key for key in self.keys if key not in state]
        if missing:
            raise ExpertWorkerError(self.worker, f"adapter state lacks hosted experts {missing[:8]} "
                                                 f"(of {len(missing)}); load an adapter of the same model")
        self.shard.load_lora_state({key: state[key] for key in self.keys})

    # -- checkpoints (vela_ray.training.checkpoint): written here, in parallel with the other workers -----

    def save_checkpoint_part(self, staging_dir: str, not_counted: NotCounted | None = None) -> str:
        """Write this worker's experts' LoRA and AdamW state, named by logical expert; returns the file.
        Copies of replicated experts in `not_counted[self.worker]` are left to the worker that counts them."""
        self.snapshot_checkpoint_part(staging_dir, not_counted)
        return self.finish_checkpoint_part()

    def snapshot_checkpoint_part(self, staging_dir: str, not_counted: NotCounted | None = None) -> None:
        """`save_checkpoint_part` in two halves: copy the state to host memory now (so the next step cannot
        change what is saved) and write it on a thread of this process; `finish_checkpoint_part` waits."""
        previous = self._part_write
        if previous is not None:
            previous.join()  # an abandoned checkpoint's part: at most one write in flight
        skip = {tuple(k) for k in (not_counted or {}).get(self.worker, [])}
        path = Path(staging_dir) / "experts" / f"part-{self.worker}.safetensors"
        tensors = checkpoint.expert_part_tensors(self.expert_states([k for k in self.keys if k not in skip]))

        def write() -> str:
            checkpoint.write_tensors(path, tensors)
            return str(path)

        self._part_write = checkpoint.Background(write, name=f"vela-checkpoint-part-{self.worker}")

    def finish_checkpoint_part(self, timeout_s: float | None = None) -> str | None:
        """The file `snapshot_checkpoint_part` writes, once written; None if still writing after `timeout_s`
        (None: wait). The master polls with 0 while training goes on: a blocked actor would hold up the
        rows of the step in flight. Answers alike until the next snapshot; a failed write raises."""
        write = self._part_write
        if write is None:
            raise ExpertWorkerError(self.worker, "no checkpoint part is being written; call "
                                                 "snapshot_checkpoint_part first")
        if not write.join(timeout_s):
            return None
        try:
            return write.result()
        except Exception as exc:
            raise ExpertWorkerError(self.worker, f"writing its checkpoint part failed with "
                                                 f"{type(exc).__name__}: {exc}") from exc

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Load LoRA and AdamW state of the experts this worker hosts, whichever worker wrote them."""
        path = Path(checkpoint_dir)
        self._load_states(checkpoint.read_expert_states(path, checkpoint.verify(path, checksums=False), self.keys))

    def _load_states(self, states: ExpertStates) -> None:
        """LoRA factors (names without a dot) and AdamW slots ("<factor>.<slot>") of every hosted expert."""
        self.shard.load_lora_state({k: {n: v for n, v in s.items() if "." not in n} for k, s in states.items()})
        if self.trainer:
            self.trainer.load_optimizer_state({k: {n: v for n, v in s.items() if "." in n}
                                               for k, s in states.items()})

    # -- live migration (vela_ray.runtime.migration): between steps, with no graph in flight -----

    def expert_states(self, keys: list[ExpertKey]) -> ExpertStates:
        """LoRA factors and AdamW state of `keys`, on the CPU, named as in a checkpoint part:
        everything an expert carries when it moves to another worker (its frozen weights do not)."""
        keys = [tuple(k) for k in keys]
        missing = [k for k in keys if k not in self.keys]
        if missing:
            raise ExpertWorkerError(self.worker, f"cannot send experts {missing[:8]}: not hosted here")
        lora, optim = self.lora_state(), self.trainer.optimizer_state() if self.trainer else {}
        return {k: {**lora[k], **{n: v.cpu() for n, v in optim.get(k, {}).items()}} for k in keys}

    def rehost(self, keys: list[ExpertKey], *incoming: ExpertStates) -> MigrationStats:
        """Host exactly `keys` from now on: experts staying keep their weights and state, arriving ones
        read their frozen weights from the model's checkpoint (as at spawn) and take LoRA and AdamW
        state from `incoming` (their old workers' `expert_states`), leaving ones are dropped."""
        keys = sorted(tuple(k) for k in keys)
        arriving = [k for k in keys if k not in self.keys]
        states: ExpertStates = {}
        for part in incoming:
            states.update(part)
        missing = [k for k in arriving if k not in states]
        if missing:
            raise ExpertWorkerError(self.worker, f"rehost: no LoRA/AdamW state sent for arriving experts "
                                                 f"{missing[:8]}; send each old worker's expert_states")
        staying = [k for k in keys if k in self.keys]
        leaving = len(self.keys) - len(staying)
        states.update(self.expert_states(staying))
        kept = self.shard.weights()
        weights = {k: kept[k] for k in staying}
        if arriving:
            if self.spec.weights is not None and any(k not in self.spec.weights for k in arriving):
                raise ExpertWorkerError(self.worker, "rehost: this worker was built from in-memory `weights` "
                                                     "that lack arriving experts; give it a `model_dir`")
            weights.update(load_expert_weights(self.spec.model_copy(update={"keys": arriving}))[0])
        self.shard.release()
        self._host(weights)
        self._load_states({k: states[k] for k in keys})
        received = sum(t.numel() * t.element_size() for k in arriving for t in states[k].values())
        frozen = sum(t.numel() * t.element_size() for k in arriving for t in weights[k].values())
        logger.info("expert worker %d: now hosting %d experts (%d arrived, %d left)", self.worker, len(keys),
                    len(arriving), leaving)
        return MigrationStats(worker=self.worker, arrived=len(arriving), state_bytes=received, frozen_bytes=frozen)

    # -- topology and sizing ----------------------------------------------------------------

    def node_id(self) -> str:
        """The Ray node this worker runs on, or "local" outside Ray."""
        import ray  # actors are built in-process by unit tests, where Ray is not needed

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else LOCAL_NODE

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> int:
        """Cheap liveness check; returns the worker index."""
        return self.worker

    def received(self) -> int:
        """Bytes of rows and gradients received so far (the broker's dispatch + grad_dispatch counts)."""
        return self.received_bytes

    def compute_seconds(self) -> float:
        """Wall seconds spent so far in expert forward/backward (CUDA work is timed as launched)."""
        return self.compute_s

    # -- APTMoE's tiers (`cluster.expert_tiers`, vela_ray.training.tiered) ----------------------

    def tier_stats(self) -> TierCounters | None:
        """Experts and rows per tier, uploads, predictor accuracy and speeds so far; None when untiered."""
        return self.tiered.stats() if self.tiered else None

    def set_tier_speeds(self, speeds: TierSpeeds) -> None:
        """Decide tiers by `speeds` instead of this worker's own measurement (taken at its first request)."""
        if self.tiered:
            self.tiered.speeds = speeds

    def set_predictor(self, state: dict[str, torch.Tensor], top_k: int) -> None:
        """Forecast each next layer's demand with this popularity predictor (a `PopularityPredictor`'s
        state_dict, fitted on the master: `vela_ray.training.popularity`)."""
        if self.tiered:
            self.tiered.predictor = PopularityPredictor.from_state(state, top_k)

    def echo(self, payload: torch.Tensor) -> int:
        """Receive a probe payload (the PlacementService times these); returns its size in bytes."""
        return payload.numel() * payload.element_size()

    def seconds_per_row(self, num_rows: int, repeats: int = 3) -> float | None:
        """Wall seconds of one row's forward + backward through a hosted expert, best of `repeats`.

        The placement cost model's compute term (`PlacementProblem.compute_seconds_per_row`). Random rows;
        gradients are returned, not accumulated, so training state is untouched. None when this worker hosts
        no expert. A tiered worker answers for its tiers: `num_rows` spread over its first layer's experts,
        a share of them cached, each computed where Eq. 1 puts it, from its measured `TierSpeeds`
        (`tiers.request_seconds_per_row`).
        """
        if not self.keys:
            return None
        layer, expert = self.keys[0]
        if self.tiered is None:
            return seconds_per_row(self.shard.layers[str(layer)], expert, num_rows, repeats)
        experts = len(self.shard.layers[str(layer)].expert_ids)
        cache = self.tiered.cache.capacity
        resident = min(experts, experts * cache // len(self.keys))  # the layer's share of the cache
        return request_seconds_per_row(self.tiered.measured_speeds(), num_rows, experts, resident, cache)

    def bytes_per_expert(self) -> int:
        """Mean bytes one hosted expert needs: frozen weights + LoRA with its gradient and AdamW moments."""
        if not self.keys:
            raise ExpertWorkerError(self.worker, "hosts no experts, so it cannot estimate bytes per expert")
        frozen = sum(t.numel() * t.element_size() for params in self.shard.weights().values() for t in params.values())
        lora = sum(p.numel() * p.element_size() for p in self.shard.lora_parameters())
        return (frozen + _LORA_COPIES * lora) // len(self.keys)

    def free_bytes(self) -> int:
        """Free memory where this worker keeps its experts: its GPU's, or host memory on a CPU worker and on
        a tiered one (APTMoE: frozen weights, LoRA and AdamW in host memory, only the bounded cache on the
        device). Workers that share that memory each see all of it: `memory_pool` says which do."""
        if self.device.type == "cuda" and self.tiered is None:
            return int(torch.cuda.mem_get_info(self.device)[0])
        return int(psutil.virtual_memory().available)

    def memory_pool(self) -> str:
        """Names the memory `free_bytes` measured: workers with the same name split it (`capacity_from_memory`)."""
        if self.device.type == "cuda" and self.tiered is None:
            return f"{self.node_id()}/cuda:{torch.cuda.get_device_properties(self.device).uuid}"
        return f"{self.node_id()}/host"

    def num_experts(self) -> int:
        return len(self.keys)
