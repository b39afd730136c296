"""What a split is: the options of one (`TensorParallelConfig`) and the record `parallelize_backbone` returns
(`TensorParallelPlan`), which every other part of the package reads: the group, this rank, and which parameters
are sharded on which dim. A module of its own, so that reading a plan never imports the sharding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

Style = Literal["colwise", "rowwise"]


class TensorParallelConfig(BaseModel):
    """How the backbone is split over one TP group (`cluster.master_tp`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_vocab: bool = Field(True, description="vocab-parallel embedding and LM head (torch's plans, over a "
                                                "group registered with torch.distributed: replicated over "
                                                "another); False keeps both replicated")


@dataclass
class TensorParallelPlan:
    """What `parallelize_backbone` did, for gathering, clipping and tests."""

    group: dist.ProcessGroup
    rank: int
    size: int
    # model parameter name -> the dim it is sharded on (only trainable parameters: what gathering needs)
    sharded: dict[str, int] = field(default_factory=dict)
    # module path -> style, every linear sharded (peft LoraLayers and plain linears)
    styles: dict[str, Style] = field(default_factory=dict)
    regions: list[str] = field(default_factory=list)  # module paths of the TP regions, in model order
    # region path -> its replicated trainable parameters (relative names), whose partial gradients ride on the
    # region's backward all-reduce
    replicated: dict[str, list[str]] = field(default_factory=dict)
    vocab_parallel: list[str] = field(default_factory=list)  # embedding / LM head paths sharded by torch's plans
    draws_dropout: bool = False  # some LoRA input has dropout: the ranks must draw from one RNG state
