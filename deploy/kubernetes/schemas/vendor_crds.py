"""Vendor the JSON schemas of the Prometheus Operator objects deploy/kubernetes uses.

The Kubernetes API server validates a custom resource against the
``openAPIV3Schema`` of its CustomResourceDefinition; ``kubernetes-validate``
knows only built-in kinds. This script extracts that schema from the
operator's CRD files (``example/prometheus-operator-crd/*.yaml`` in
github.com/prometheus-operator/prometheus-operator), drops the
``description`` texts (most of the bytes; they do not constrain anything),
and writes one JSON file per kind, named ``GROUP_VERSION_KIND.json``, which
``deploy/kubernetes/validate.py`` reads. Run it when moving to a newer
operator release:

    python deploy/kubernetes/schemas/vendor_crds.py CRD.yaml [CRD.yaml ...]

Needs PyYAML (a dependency of kubernetes-validate, in the dev extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


def _strip(node):
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def extract(path: str) -> list[Path]:
    written = []
    for crd in yaml.safe_load_all(Path(path).read_text(encoding="utf-8")):
        if not crd or crd.get("kind") != "CustomResourceDefinition":
            continue
        spec, operator = crd["spec"], crd["metadata"].get("annotations", {}).get("operator.prometheus.io/version")
        for version in spec["versions"]:
            schema = _strip(version["schema"]["openAPIV3Schema"])
            schema["x-vendored-from"] = f"{crd['metadata']['name']} (prometheus-operator {operator})"
            out = HERE / f"{spec['group']}_{version['name']}_{spec['names']['kind'].lower()}.json"
            out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            written.append(out)
    return written


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for path in argv:
        for out in extract(path):
            print(f"wrote {out.relative_to(HERE.parent.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
