"""The TP group as torch.distributed sees it: registered with it or not.

A TP group is a 1-D DeviceMesh or a ProcessGroup that torch.distributed knows (the mesh `join_mesh` forms, or any
`dist.new_group`), or a group made directly, which it does not (`collective.make_group`'s `ProcessGroupGloo`):
then several ranks may be threads of one process. Plain collectives (`dist.all_reduce`, `dist.all_gather`) run
on either; torch's helpers that look a group up (`dist.get_rank`, `dist.get_backend`, `dist.get_global_rank`,
`dist.broadcast`, `DeviceMesh.from_group`) fail on the second. So the package asks the group itself (its
`rank()`, `size()`, and below where its collectives run), and only the vocab-parallel embedding and LM head,
which are DTensors on a DeviceMesh, need a registered group (`is_registered`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def group_of(mesh_or_group: Any) -> tuple[dist.ProcessGroup, Any]:
    """(process group, device mesh or None) from a 1-D DeviceMesh or a process group (registered or not)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"tensor parallelism takes a 1-D device mesh, got {mesh_or_group.ndim}-D")
        return mesh_or_group.get_group(), mesh_or_group
    return mesh_or_group, None


def is_registered(group: Any) -> bool:
    """Whether torch.distributed knows `group` (the default group, `new_group`'s, a DeviceMesh's): what a
    DeviceMesh built on it needs. False for a backend made directly (`collective.make_group`)."""
    from torch.distributed.distributed_c10d import _world

    return isinstance(group, dist.ProcessGroup) and group in _world.pg_map


def collective_device(group: Any) -> torch.device:
    """Where `group`'s collectives run: NCCL's on this thread's GPU, gloo's on the host (and so does `join_mesh`'s
    "cpu:gloo,cuda:nccl", whose host half takes host tensors). A registered group's backend is the one it was
    registered with (`dist.get_backend`); another's is its own name (`collective.make_group`'s "gloo",
    `make_nccl_group`'s "nccl")."""
    backend = dist.get_backend(group) if is_registered(group) else group.name()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
