"""The GPU battery's NCCL part: rows over the collective plane's NCCL data group between two GPUs.

The master (rank 0, this thread, cuda:0) sends rows to one worker's serving loop (rank 1, a thread of this
process, cuda:1) over `vela_ray.model.collective`'s planes, forward and backward, as the collective
transport does between a master and an ExpertManager; the answers must be exactly what the worker computes
(rows x (worker + 1) + expert id forward, 2 x grad backward) and stay on the master's GPU. No Ray.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so with fewer than two CUDA devices the part
is skipped, saying why; without CUDA the same exchange runs over gloo on the CPU (the code path, not NCCL),
and the part is still recorded as skipped. Prints one JSON line: {"status", "reason", ...}.

    python scripts/gpu_nccl.py            # on a machine with two or more GPUs
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

JOIN_S = 60.0


@dataclass
class ScalingServer:
    """A `collective.RowServer` whose answers the master can check: forward rows x (worker + 1) + expert id,
    backward 2 x grad."""

    worker: int
    device: torch.device

    def forward_rows(self, layer: int, expert_ids: torch.Tensor, rows: torch.Tensor,
                     key: Hashable | None = None) -> torch.Tensor:
        return rows * (self.worker + 1) + expert_ids[:, None].to(rows.dtype)

    def backward_rows(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        return 2 * grad


def exchange(master_device: torch.device, worker_device: torch.device, backend: str) -> dict:
    """Forward and backward of 64 rows between the master and one serving thread over `backend`; what came
    back against what the worker computes."""
    from vela_ray.model import collective
    from vela_ray.model.transport import ForwardRequest

    store = collective.make_store("127.0.0.1", 0, 2, is_master=True, timeout_s=JOIN_S)

    def serve() -> None:
        if worker_device.type == "cuda":
            torch.cuda.set_device(worker_device)
        worker_store = collective.make_store("127.0.0.1", store.port, 2, is_master=False, timeout_s=JOIN_S)
        collective.serve(collective.make_group(worker_store, 1, 2, JOIN_S), ScalingServer(0, worker_device))

    thread = threading.Thread(target=serve, daemon=True, name="nccl-probe-worker")
    thread.start()
    group = collective.make_group(store, 0, 2, JOIN_S)
    data = collective.form_data_plane(group, store, 1, master_device, backend, JOIN_S, JOIN_S)
    transport = collective.CollectiveTransport(group, data, ["same_node"], JOIN_S)
    try:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 4, (64,), generator=generator)
        rows = torch.randn(64, 32, generator=generator)
        grad = torch.randn(64, 32, generator=generator)
        out = transport.forward({0: ForwardRequest(1, ids, rows.to(master_device), key="probe")})[0]
        row_grad = transport.backward("probe", {0: grad.to(master_device)})[0]
        exact = bool(torch.equal(out.cpu(), rows + ids[:, None].float()) and torch.equal(row_grad.cpu(), 2 * grad))
        return {"backend": data.backend, "exact": exact, "on_master_device": out.device == master_device}
    finally:
        transport.close()
        thread.join(JOIN_S)


def probe() -> dict:
    """The part's outcome: ok / failed over NCCL with two GPUs, else skipped with the reason."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        result = exchange(torch.device("cuda", 0), torch.device("cuda", 1), "nccl")
        ok = result["exact"] and result["on_master_device"] and result["backend"] == "nccl"
        return {"status": "ok" if ok else "failed", "reason": f"rows over NCCL cuda:0 <-> cuda:1: {result}", **result}
    if count == 1:
        return {"status": "skipped", "reason": "NCCL refuses two ranks on one GPU, and this node has one CUDA device"}
    smoke = exchange(torch.device("cpu"), torch.device("cpu"), "gloo")
    return {"status": "skipped", "reason": f"no CUDA device; the same exchange over gloo on the CPU: {smoke}",
            "gloo_smoke": smoke}


def main() -> int:
    try:
        outcome = probe()
    except Exception as exc:  # noqa: BLE001  the part's JSON says what broke
        outcome = {"status": "failed", "reason": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"}
    print(json.dumps(outcome, default=str))
    return 1 if outcome["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
