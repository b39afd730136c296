"""A master process joining its mesh of masters (`cluster.master_tp`, `runtime.masters.MasterGroup`).

A master's ranks join one mesh (dims "dp" x "tp") whose group is the process's default group: torch's DTensor
plans (`vocab`) and FSDP2 (`frozen`) take a DeviceMesh, hence a group torch.distributed knows.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def join_mesh(store: dist.Store, rank: int, dp: int, tp: int, device: torch.device, timeout_s: float,
              address: str | None = None) -> Any:
    """Join a mesh of `dp` x `tp` master processes through `store` (rank = dp_rank * tp + tp_rank) and return its
    2-D DeviceMesh, dims ("dp", "tp"). Its group becomes the process's default group, which torch's DTensor plans
    (the vocab-parallel embedding and LM head) and FSDP2 need; a master's other groups (the collective data plane,
    the data-parallel masters' own) are groups of their own, so nothing else in the process uses the default one.
    On GPUs it is NCCL for device tensors and gloo for host ones. `address`: this process's address as the others
    reach it (gloo binds the interface that holds it; its default, the hostname's, is the loopback on many hosts)."""
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError("this process already has a default process group: one mesh per master process")
    if address and not address.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = _interface_of(address)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=dp * tp,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))


def _interface_of(address: str) -> str | None:
    import psutil

    return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == address for a in addrs)),
                None)
