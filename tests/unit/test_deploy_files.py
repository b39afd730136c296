"""deploy/ stays runnable: each job passes the checks `vela train` runs before Ray, the clusters hold what
the jobs ask for, the pods see the jobs' files, documented commands parse, token auth stays on, and the
Grafana dashboard queries only metrics vela_ray/observability/metrics.py exports."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml
from transformers import MixtralConfig

from tests.fixtures import make_stand_in
from vela_ray.cli import build_parser
from vela_ray.config import JobConfig
from vela_ray.observability.metrics import METRICS, PROMETHEUS_PREFIX
from vela_ray.paths import data_dir
from vela_ray.preflight import check_cluster_resources, master_gpus
from vela_ray.training.tiny_model import CHAT_TEMPLATE, tiny_model_path

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
JOBS = sorted((DEPLOY / "jobs").glob("*.yaml"))
MIXTRAL_JOB = DEPLOY / "jobs" / "mixtral-8x7b-3x2.yaml"
MIXTRAL_TP_JOB = DEPLOY / "jobs" / "mixtral-8x7b-tp2.yaml"  # the master over both GPUs of the head node
# The models the deploy jobs name on the cluster's volume, by architecture: each config class's defaults are
# that model's (MixtralConfig() is Mixtral-8x7B's), which `make_stand_in` keeps the counts of.
CLUSTER_MODELS = {Path("/mnt/vela/models/Mixtral-8x7B-v0.1"): MixtralConfig,
                  Path("/mnt/vela/models/Mixtral-8x7B-Instruct-v0.1"): MixtralConfig}
INSTRUCT_MODELS = {Path("/mnt/vela/models/Mixtral-8x7B-Instruct-v0.1")}  # their stand-ins get a chat template
STAND_IN_DATA = data_dir() / "instruct" / "gsm8k_alpaca.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
Node = dict[str, float]  # Ray resources of one node: {"CPU": 24, "GPU": 2}


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _vela_commands(text: str) -> list[list[str]]:
    """Every `vela ...` command line in `text`, as argv after `vela` (continuation lines joined)."""
    text = text.replace("\\\n", " ")
    commands = []
    for match in re.finditer(r"(?:^|--\s+|entrypoint:\s+|#\s+)vela\s+([a-z][^\n#`]*)", text, re.M):
        commands.append(shlex.split(match.group(1)))
    return commands


def _job_path(config_arg: str) -> Path:
    """The repository file a `--config` argument names (the image keeps the checkout at /opt/vela-ray)."""
    return REPO / config_arg.removeprefix("/opt/vela-ray/")


def _stand_in_missing_paths(raw: dict, tmp_path: Path) -> dict:
    """Cluster-only data (an absolute path that does not exist here) replaced by a tmp file of the same kind:
    the first Alpaca records of the bundled GSM8K set (the deploy jobs train on Alpaca-style records), 64 per
    512 tokens of the job's rows (a long-context job packs many into each); a preference job's, its first
    questions each with its answer chosen over another's, in LLaMA-Factory's dpo_en_demo layout."""
    data = dict(raw["data"])
    if Path(data["path"]).is_absolute() and not Path(data["path"]).exists():
        data["path"] = str(tmp_path / Path(data["path"]).name)
        records = json.loads(STAND_IN_DATA.read_text())[:64 * max(1, data.get("seq_len", 512) // 512)]
        if data["kind"] == "preference":
            records = [{"conversations": [{"from": "human", "value": r["instruction"]}],
                        "chosen": {"from": "gpt", "value": r["output"]},
                        "rejected": {"from": "gpt", "value": records[i - 1]["output"]}} for i, r in enumerate(records)]
        Path(data["path"]).write_text(json.dumps(records))
    return {**raw, "data": data}


def _local_model(path: Path, tmp_path: Path) -> Path:
    """The job's model on this machine: its own path; for `.cache/tiny-mixtral` the tiny model that the
    demo job's comment links there (built if missing); for a cluster's model, a stand-in of its architecture."""
    if path.exists():
        return path
    if path == Path(".cache/tiny-mixtral"):
        return tiny_model_path()
    if path not in CLUSTER_MODELS:
        pytest.fail(f"{path} is not on this machine: add its transformers config class to CLUSTER_MODELS")
    return make_stand_in(CLUSTER_MODELS[path](), tmp_path / path.name,
                         chat_template=CHAT_TEMPLATE if path in INSTRUCT_MODELS else None)


# --- the jobs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_job_yamls_validate_as_job_configs(job, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # relative paths resolve from the repository root, as documented
    JobConfig.from_dict(_stand_in_missing_paths(_load(job), tmp_path), source=str(job))  # ValueError names the field


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_job_passes_preflight(job, tmp_path, monkeypatch):
    """The checks `vela train` runs before Ray: weights, seq_len vs positions, data fills a batch, capacity;
    a cluster's model and data stand in at debug size (`_local_model`, `_stand_in_missing_paths`)."""
    monkeypatch.chdir(REPO)
    raw = _stand_in_missing_paths(_load(job), tmp_path)
    model_dir = _local_model(Path(raw["model"]["path"]), tmp_path)
    raw = {**raw, "model": {**raw["model"], "path": str(model_dir)},
           "output": {**raw.get("output", {}), "dir": str(tmp_path / "out")}}  # write nothing into the repo
    JobConfig.from_dict(raw, source=str(job)).preflight()


# --- the clusters hold what the jobs ask for ------------------------------------------------------------


def _launcher_nodes(cluster: dict) -> list[Node]:
    """Resources of the nodes `ray up` keeps running: the head and each type's min_workers."""
    types = cluster["available_node_types"]
    nodes = [types[cluster["head_node_type"]]["resources"]]
    for name, node_type in types.items():
        if name != cluster["head_node_type"]:
            nodes += [node_type["resources"]] * node_type.get("min_workers", 0)
    return nodes


def _pod_node(pod: dict) -> Node:
    limits = pod["containers"][0]["resources"]["limits"]
    return {"CPU": float(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}


def _rayjob_pods(rayjob: dict) -> list[dict]:
    """Pod specs of the Ray cluster the RayJob starts: the head and every worker replica."""
    spec = rayjob["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]["template"]["spec"]
    return [head] + [g["template"]["spec"] for g in spec["workerGroupSpecs"] for _ in range(g["replicas"])]


def _assert_nodes_hold(job: JobConfig, nodes: list[Node]) -> None:
    """The whole cluster holds the master's GPU (on the head, nodes[0]) and every worker, each worker's
    bundle on one node (first fit, at most `workers_per_node` per node), as Ray places them."""
    totals = {r: sum(n.get(r, 0.0) for n in nodes) for r in ("CPU", "GPU")}
    cluster = job.cluster
    check_cluster_resources(cluster, totals)
    free = [dict(n) for n in nodes]
    stages = job.masters.pipeline_stages  # a GPU per rank of each stage
    free[0]["GPU"] = free[0].get("GPU", 0.0) - master_gpus(cluster, totals, stages=stages) * cluster.master_tp * stages
    per_node = cluster.workers_per_node or cluster.num_workers
    placed = [0] * len(nodes)
    for worker in range(cluster.num_worker_actors):  # the others live in the master's process
        node = next((i for i, n in enumerate(free) if placed[i] < per_node
                     and n.get("GPU", 0.0) >= cluster.num_gpus_per_worker
                     and n["CPU"] >= cluster.num_cpus_per_worker), None)
        assert node is not None, f"worker {worker} fits no node: {free}"
        free[node]["GPU"] = free[node].get("GPU", 0.0) - cluster.num_gpus_per_worker
        free[node]["CPU"] -= cluster.num_cpus_per_worker
        placed[node] += 1
    assert free[0]["GPU"] >= 0, free


def _mixtral_job(tmp_path: Path) -> JobConfig:
    return JobConfig.from_dict(_stand_in_missing_paths(_load(MIXTRAL_JOB), tmp_path), source=str(MIXTRAL_JOB))


def test_cluster_launcher_config_passes_rays_schema_and_holds_the_gpu_job(tmp_path):
    cluster = _load(DEPLOY / "cluster-gpu.yaml")
    schema_path = Path(importlib.util.find_spec("ray").origin).parent / "autoscaler" / "ray-schema.json"
    jsonschema.validate(cluster, json.loads(schema_path.read_text()))
    _assert_nodes_hold(_mixtral_job(tmp_path), _launcher_nodes(cluster))
    tp_job = JobConfig.from_dict(_stand_in_missing_paths(_load(MIXTRAL_TP_JOB), tmp_path), source=str(MIXTRAL_TP_JOB))
    _assert_nodes_hold(tp_job, _launcher_nodes(cluster))


def test_rayjob_trains_a_job_its_pods_hold_and_can_read(tmp_path):
    rayjob = _load(DEPLOY / "kuberay-rayjob.yaml")
    args = build_parser().parse_args(shlex.split(rayjob["spec"]["entrypoint"])[1:])
    assert args.command == "train"
    job_file = _job_path(args.config)
    raw = _load(job_file)  # the paths as the pods see them
    job = JobConfig.from_dict(_stand_in_missing_paths(raw, tmp_path), source=str(job_file))
    pods = _rayjob_pods(rayjob)
    _assert_nodes_hold(job, [_pod_node(pod) for pod in pods])
    for pod in pods:
        for path in (raw["model"]["path"], raw["data"]["path"], raw["output"]["dir"]):
            assert _claim_holding(pod, path), f"{path} is on no persistent volume of pod {pod['containers'][0]['name']}"


def _claim_holding(pod: dict, path: str) -> str | None:
    """The PersistentVolumeClaim mounted over `path` in `pod`'s first container, if any."""
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
    mounts = pod["containers"][0]["volumeMounts"]
    return next((claims[m["name"]] for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")), None)


# --- documentation and token auth ----------------------------------------------------------------------


def test_documented_vela_commands_parse_and_name_existing_job_files():
    text = (DEPLOY / "README.md").read_text() + "".join(p.read_text() for p in DEPLOY.rglob("*.yaml"))
    commands = _vela_commands(text)
    assert any(c[0] == "train" for c in commands), "found no `vela train` line: the pattern above is stale"
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv)  # SystemExit here means an unknown subcommand or flag
        if args.command == "train":
            assert _job_path(args.config).is_file(), argv


def test_every_ray_process_the_deploy_files_start_uses_token_auth():
    cluster = _load(DEPLOY / "cluster-gpu.yaml")
    for commands in (cluster["head_start_ray_commands"], cluster["worker_start_ray_commands"]):
        start = next(c for c in commands if "ray start" in c)
        assert "RAY_AUTH_MODE=token" in start, start
    assert "~/.ray/auth_token" in cluster["file_mounts"]  # the token every node reads
    rayjob = _load(DEPLOY / "kuberay-rayjob.yaml")
    for pod in _rayjob_pods(rayjob) + [rayjob["spec"]["submitterPodTemplate"]["spec"]]:
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]


def test_no_deploy_file_turns_token_auth_off():
    for path in [*DEPLOY.rglob("*.yaml"), DEPLOY / "README.md"]:
        assert not re.search(r"RAY_AUTH_MODE\W*(=|value:)\W*disabled", path.read_text(), re.I), path


# --- the Grafana dashboard ------------------------------------------------------------------------------


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "vela_dashboard.json").read_text())


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def _metric_of(series: str) -> str:
    """`ray_vela_x_bucket` -> `vela_x`, checking that only histograms carry histogram suffixes."""
    name = series.removeprefix(PROMETHEUS_PREFIX)
    if name in METRICS:
        return name
    base = next((name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
    assert base in METRICS and METRICS[base].kind == "histogram", \
        f"{series} is not a metric of vela_ray.observability.metrics"
    return base


def test_dashboard_queries_only_metrics_that_vela_exports_and_shows_them_all():
    dashboard = _dashboard()
    used = {_metric_of(s) for e in _exprs(dashboard) for s in re.findall(r"\bray_vela_\w+", e)}
    assert used == set(METRICS)
    assert not [e for e in _exprs(dashboard) if re.search(r"(?<!ray_)\bvela_\w+\{", e)], "missing ray_ prefix"


def test_dashboard_imports_into_any_prometheus_datasource():
    """Grafana asks for the datasource on import only if every panel uses the variable; ids must be unique."""
    dashboard = _dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == "${datasource}", panel["title"]
            assert all(t["datasource"] == "${datasource}" for t in panel["targets"]), panel["title"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
