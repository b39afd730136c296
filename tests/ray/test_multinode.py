"""Several Ray nodes on one machine: a master per node (`masters.count`), each with copies of some
experts beside it (replicas), its sequences migrating among the masters (`masters.sequence_migration`,
combined where they go), trains like peft; workers on other nodes count as cross-node, bytes match both
ends, every node's NIC is in the placement problem."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from placement import Placement, sequential_table
from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses
from vela_ray.config import JobConfig

# Runs in its own process: ray.cluster_utils.Cluster needs a Ray of its own, not the session fixture's.
_SCRIPT = """
import json, sys
import ray
from ray.cluster_utils import Cluster
from vela_ray.api import VelaJob
from vela_ray.config import JobConfig

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
for _ in range(2):
    cluster.add_node(num_cpus=2)
ray.init(address=cluster.address)
try:
    summary = VelaJob(JobConfig.from_dict(json.loads(sys.argv[1]))).run().model_dump(mode="json")
    summary["nodes"] = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    print("SUMMARY " + json.dumps(summary))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_a_master_per_node_with_replicas_trains_like_peft_and_both_ends_count_the_same_bytes(tmp_path):
    model_dir = make_checkpoint(tmp_path / "model")
    adapter = init_adapter(model_dir, tmp_path / "adapter")
    # The tiny Mixtral's 2 x 6 experts on the 3 workers (one per node), and worker 0's experts (0 and 3 of
    # each layer) copied to every worker: master m (on worker m's node) uses the copy beside it.
    table = sequential_table(2, 6, 3)
    routes = np.stack([table] * 3)
    for master in range(3):
        routes[master][table == 0] = master
    Placement(expert_to_worker=table.tolist(), num_workers=3, capacities=[8] * 3, solver="file",
              expected_step_time=0.0, routes=routes.tolist()).to_json(tmp_path / "placement.json")
    job = job_dict(model_dir, tmp_path / "out", steps=2,
                   cluster={"workers_per_node": 1},
                   # object refs: the workers answer moving sequences' rows to their new master (LUFFY's combine)
                   data_plane={"transport": "object_ref"},
                   masters={"count": 3, "sequence_migration": True, "sequence_migration_candidates": 2},
                   placement={"solver": "file", "file": str(tmp_path / "placement.json")},
                   lora={"r": 4, "alpha": 8, "init_adapter": str(adapter)},
                   training={"batch_size": 6, "micro_batch_size": 6, "optimizer": {"lr": 5e-3, "warmup_steps": 1}})
    result = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(job)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("SUMMARY "))
    summary = json.loads(line.removeprefix("SUMMARY "))

    # a master on every node: master 0 on the driver's, the others on the workers' other nodes
    nodes = summary["worker_nodes"]
    assert len(set(nodes)) == 3 and len(summary["nodes"]) == 3
    assert summary["master_nodes"] == nodes and nodes[0] == summary["master_node"]
    assert summary["worker_tiers"] == ["same_node", "cross_node", "cross_node"]  # as master 0 sees them
    # the masters split every micro-batch, sequences move among them and back, copies sum their gradients:
    # the losses are plain peft's
    ref_losses, _ = reference_losses(JobConfig.from_dict(job))
    assert summary["losses"] == pytest.approx(ref_losses, rel=1e-5)
    moves = summary["sequence_moves"]  # over the masters' gloo group, forward and backward
    assert moves["micro_batches"] == 2 * 3 and moves["moves"] > 0 and moves["cross_node_bytes"] > 0
    # LUFFY's combine on the new master over Ray: the ExpertManager actors answered moving sequences' rows to
    # the masters they moved to (collected and, backward, deposited there: counted at both ends below)
    assert moves["relayed_rows"] > 0
    assert summary["placement"]["routes"] == routes.tolist()
    # what the masters' brokers say they sent to each worker == what each worker says it received
    assert summary["sent_bytes_by_worker"] == summary["worker_received_bytes"]
    assert all(b > 0 for b in summary["worker_received_bytes"])
    by_tier = summary["traffic_bytes_by_tier"]
    assert by_tier["same_process"] == 0 and by_tier["same_node"] > 0 and by_tier["cross_node"] > by_tier["same_node"]
    assert sum(by_tier.values()) == sum(summary["traffic_bytes_by_worker"])
    # every node's NIC was probed, and carries the rows of the (master, worker) pairs it separates
    shared = summary["placement"]["problem"]["shared_links"]
    assert [(s["name"], s["workers"], s["masters"]) for s in shared] == [
        (f"nic:{nodes[0]}", [0, 1, 2], [[1, 2], [0], [0]]),
        (f"nic:{nodes[1]}", [0, 1, 2], [[1], [0, 2], [1]]),
        (f"nic:{nodes[2]}", [0, 1, 2], [[2], [2], [0, 1]])]
    assert all(s["bandwidth_bytes_per_s"] > 0 for s in shared)
