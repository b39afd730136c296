"""Several Ray nodes on one machine: workers on other nodes count as cross-node, bytes match both ends."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.fixtures import job_dict, make_checkpoint

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


def test_workers_on_other_nodes_are_cross_node_and_both_ends_count_the_same_bytes(tmp_path):
    model_dir = make_checkpoint(tmp_path / "model")
    job = job_dict(model_dir, tmp_path / "out", steps=2, cluster={"workers_per_node": 1},
                   placement={"solver": "sequential"})
    result = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(job)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("SUMMARY "))
    summary = json.loads(line.removeprefix("SUMMARY "))

    assert len(set(summary["worker_nodes"])) == 3 and len(summary["nodes"]) == 3
    assert summary["worker_nodes"][0] == summary["master_node"]  # nodes fill from the master's
    assert summary["worker_tiers"] == ["same_node", "cross_node", "cross_node"]
    # what the broker says it sent to each worker == what each worker says it received
    assert summary["sent_bytes_by_worker"] == summary["worker_received_bytes"]
    assert all(b > 0 for b in summary["worker_received_bytes"])
    by_worker = summary["traffic_bytes_by_worker"]
    assert summary["traffic_bytes_by_tier"]["cross_node"] == sum(by_worker[1:])
    assert summary["traffic_bytes_by_tier"]["same_node"] == by_worker[0]
    # the NICs master traffic crosses were probed and the placement problem carries them
    master, nodes = summary["master_node"], summary["worker_nodes"]
    shared = summary["placement"]["problem"]["shared_links"]
    assert [(s["name"], s["workers"]) for s in shared] == [
        (f"nic:{master}", [1, 2]), (f"nic:{nodes[1]}", [1]), (f"nic:{nodes[2]}", [2])]
    assert all(s["bandwidth_bytes_per_s"] > 0 for s in shared)
