"""The MasterActor is pinned to the driver's node: a GPU elsewhere in the cluster is no use to it, and a
master Ray cannot place must fail in one line, not leave the run pending forever.

Each scenario runs in its own process with a Ray of its own (fake GPUs declared as resources), not the
session fixture's CPU-only one.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.fixtures import job_dict, make_checkpoint, side_by_side
from vela_ray.config import JobConfig
from vela_ray.preflight import master_gpus

_RUN = """
import json, sys, time
import ray
from vela_ray import api
from vela_ray.config import JobConfig

job = JobConfig.from_dict(json.loads(sys.argv[1]))
{setup}
started = time.monotonic()
try:
    api.VelaJob(job).run()
    print("NO ERROR")
except Exception as err:
    print("ERROR " + json.dumps({{"type": type(err).__name__, "message": str(err),
                                  "seconds": time.monotonic() - started}}))
finally:
    ray.shutdown()
    {teardown}
"""

# The driver's (head) node has no GPU; another node has one.
_GPU_ON_ANOTHER_NODE = """
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
cluster.add_node(num_cpus=1, num_gpus=1)
ray.init(address=cluster.address)
"""

# The driver's node has a GPU (declared: this machine may have none), held by another actor for the whole run.
_GPU_BUSY = """
ray.init(num_cpus=2, num_gpus=1, include_dashboard=False)
@ray.remote(num_gpus=1, num_cpus=0)
class Holder:
    def ready(self):
        return True
held = Holder.remote()
ray.get(held.ready.remote())
api.MASTER_SCHEDULE_TIMEOUT_S = 3.0
"""


def _errors(scenarios: list[tuple[dict, str, str]]) -> list[dict]:
    """The error `VelaJob(job).run()` raises in a fresh process after `setup` started its Ray, for each
    (job, setup, teardown); the scenarios run side by side, each process with a Ray of its own."""
    outputs = side_by_side([[sys.executable, "-c", _RUN.format(setup=setup, teardown=teardown), json.dumps(job)]
                            for job, setup, teardown in scenarios], timeout=240)
    errors = []
    for out in outputs:
        lines = [line for line in out.splitlines() if line.startswith(("ERROR ", "NO ERROR"))]
        assert lines and lines[0].startswith("ERROR "), out[-2000:]
        errors.append(json.loads(lines[0].removeprefix("ERROR ")))
    return errors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("model"))


def test_a_gpu_on_another_node_is_not_counted_for_the_master(tmp_path):
    section = JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", cluster={"num_workers": 2})).cluster
    cluster = {"CPU": 3.0, "GPU": 1.0}
    assert master_gpus(section, cluster) == 1  # the cluster alone would give it one
    assert master_gpus(section, cluster, {"CPU": 2.0}, "head") == 0
    assert master_gpus(section, cluster, {"CPU": 2.0, "GPU": 1.0}, "head") == 1
    explicit = section.model_copy(update={"master_gpus": 1})
    with pytest.raises(ValueError, match=r"^cluster\.master_gpus 1: the MasterActor is pinned to the driver's "
                                         r"node head, which has 0 GPUs and 2 CPUs, and asks for 1 GPU and 0 CPUs; "
                                         r"run the driver on a node with a free GPU, or set cluster\.master_gpus: 0$"):
        master_gpus(explicit, cluster, {"CPU": 2.0}, "head")


def test_a_master_asking_for_a_gpu_its_node_lacks_is_refused_before_it_starts_and_one_never_scheduled_at_the_deadline(
        model_dir, tmp_path):
    """Two clusters, side by side: the driver's node has no GPU (another has one), or has one another actor holds."""
    job = job_dict(model_dir, tmp_path / "out", steps=1, cluster={"num_workers": 2, "master_gpus": 1})
    busy = {**job, "output": {**job["output"], "dir": str(tmp_path / "out-busy")}}
    refused, late = _errors([(job, _GPU_ON_ANOTHER_NODE, "cluster.shutdown()"), (busy, _GPU_BUSY, "pass")])

    assert refused["type"] == "ValueError"
    assert "\n" not in refused["message"]
    assert "pinned to the driver's node" in refused["message"] and "which has 0 GPUs and 2 CPUs" in refused["message"]
    assert "set cluster.master_gpus: 0" in refused["message"]

    assert late["type"] == "ClusterError"
    assert "\n" not in late["message"]
    assert late["message"].startswith("the MasterActor was not scheduled within 3 s: it is pinned to the "
                                      "driver's node ")
    assert "which has 1 GPUs and 2 CPUs, and asks for 1 GPU and 0 CPUs" in late["message"]
    assert "run the driver on a node with a free GPU, or set cluster.master_gpus: 0" in late["message"]
    assert 3.0 <= late["seconds"] < 30.0  # the deadline, not Ray's forever
