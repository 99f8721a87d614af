"""What an operator sets per cluster, in every overlay, each from one place: the engines on their own
image tag (``tollgate-engine``, so a gateway-only release does not roll them through a model load, and
vice versa), and where GPU engine pods run: the GPU products, the runtime class, a priority above the
batch pool's for the interactive engines, and the pull Secret of a private registry
(docs/deploy-kubernetes.md, "Per-cluster values").
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.manifests import (
    GPU_OVERLAYS,
    KUSTOMIZE,
    OVERLAYS,
    ROOT,
    containers,
    kubectl,
    pod_labels,
    pod_spec,
)

DOC = ROOT / "docs" / "deploy-kubernetes.md"
PLATFORM_IMAGE, ENGINE_IMAGE = "tollgate", "tollgate-engine"
DATASTORES = {"postgres", "redis"}
PULL_SECRET = "tollgate-registry"


def _kustomization(path) -> dict:
    return yaml.safe_load((path / "kustomization.yaml").read_text())


def _is_engine(workload) -> bool:
    return pod_labels(workload).get("app.kubernetes.io/component") == "engine"


def _tollgate_workloads(manifests):
    return [w for w in manifests.workloads()
            if pod_labels(w).get("app.kubernetes.io/component") not in DATASTORES]


# --- Engines on their own image tag ---------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_sets_the_platform_and_engine_tags_in_one_place_each(overlay):
    entries = _kustomization(KUSTOMIZE / "overlays" / overlay).get("images", [])
    names = [e["name"] for e in entries]
    assert sorted(names) == [PLATFORM_IMAGE, ENGINE_IMAGE], f"{overlay}: {names}"
    assert all(e.get("newName") and e.get("newTag") for e in entries), overlay
    # Nowhere else: the base and the components name the two images only by their placeholders, and
    # set no tag of their own.
    for path in KUSTOMIZE.rglob("*.yaml"):
        if path.parent.parent.name == "overlays" and path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") in ("Kustomization", "Component"):
                assert "images" not in doc, path
        for image in re.findall(r"^\s*image:\s*(\S+)", path.read_text(), re.M):
            assert image in (PLATFORM_IMAGE, ENGINE_IMAGE, "postgres:16", "redis:7"), (path, image)


def _render_with_tags(overlay: str, tmp_path) -> list[dict]:
    """The overlay rendered from a copy of deploy/ whose overlay gives the two images different tags."""
    copy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", copy)
    path = copy / "kubernetes" / "overlays" / overlay / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    for entry in kustomization["images"]:
        entry["newTag"] = {PLATFORM_IMAGE: "platform-tag", ENGINE_IMAGE: "engine-tag"}[entry["name"]]
    path.write_text(yaml.safe_dump(kustomization))
    binary = kubectl()
    assert binary is not None
    result = subprocess.run([binary, "kustomize", str(path.parent)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_run_the_engine_tag_and_every_other_process_the_platform_tag(overlay, rendered, tmp_path):
    del rendered  # only for its skip where kubectl is missing
    objects = _render_with_tags(overlay, tmp_path)
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    engines = [w for w in workloads if _is_engine(w)]
    assert {"engine-interactive", "engine-batch"} <= {w["metadata"]["name"] for w in engines}
    for workload in workloads:
        if pod_labels(workload)["app.kubernetes.io/component"] in DATASTORES:
            continue
        tag = "engine-tag" if _is_engine(workload) else "platform-tag"
        for c in containers(workload):  # init containers included (migrate, model-init)
            where = (overlay, workload["metadata"]["name"], c["name"], c["image"])
            assert c["image"].endswith(f":{tag}"), where


# --- Scheduling values per cluster ----------------------------------------------------------------


def _gpu_products(spec) -> set[str]:
    terms = spec.get("affinity", {}).get("nodeAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
    products = []
    for term in terms:  # the terms are alternatives: each must restrict the product
        exprs = [e for e in term.get("matchExpressions", []) if e["key"] == "nvidia.com/gpu.product"]
        assert len(exprs) == 1 and exprs[0]["operator"] == "In", term
        products.append(set(exprs[0]["values"]))
    if "nvidia.com/gpu.product" in spec.get("nodeSelector", {}):
        products.append({spec["nodeSelector"]["nvidia.com/gpu.product"]})
    return set().union(*products) if products else set()


def _on_gpu_nodes(workload) -> bool:
    """The engines, and the model prefetch that fills those nodes' model cache (components/model-source)."""
    return _is_engine(workload) or pod_labels(workload).get("app.kubernetes.io/component") == "model-prefetch"


def test_gpu_engine_pods_carry_the_per_cluster_scheduling_values(manifests):
    for workload in manifests.workloads():
        spec = pod_spec(workload)
        name = f"{manifests.overlay}: {workload['metadata']['name']}"
        gpus = any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in containers(workload))
        if manifests.overlay in GPU_OVERLAYS and _on_gpu_nodes(workload):
            assert gpus == _is_engine(workload), name  # the prefetch runs there without holding a GPU
            assert _gpu_products(spec), name
            assert spec.get("runtimeClassName") == "nvidia", name
            assert spec.get("nodeSelector", {}).get("nvidia.com/gpu.present") == "true", name
            assert any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", [])), name
        else:
            # The CPU overlay and the pods that need no GPU node get none of the GPU-only fields.
            assert not gpus, name
            assert "runtimeClassName" not in spec, name
            assert not _gpu_products(spec), name
            assert not any(k.startswith("nvidia.com/") for k in spec.get("nodeSelector", {})), name
            tolerated = [t.get("key", "") for t in spec.get("tolerations", [])]
            assert not any(key.startswith("nvidia.com/") for key in tolerated), name


def test_the_gpu_product_and_runtime_class_are_set_in_one_place():
    sources = [p for p in KUSTOMIZE.rglob("*.yaml")
               if re.search(r"key:\s*nvidia\.com/gpu\.product", p.read_text())]
    assert [p.relative_to(KUSTOMIZE).as_posix() for p in sources] == ["components/gpu/scheduling.yaml"]
    runtime = [p for p in KUSTOMIZE.rglob("*.yaml")
               if re.search(r"^\s*runtimeClassName:", p.read_text(), re.M)]
    assert [p.relative_to(KUSTOMIZE).as_posix() for p in runtime] == ["components/gpu/scheduling.yaml"]


def test_interactive_engines_have_a_priority_class_above_the_batch_pools(manifests):
    classes = {c["metadata"]["name"]: c for c in manifests.of_kind("PriorityClass")}
    assert all("namespace" not in c["metadata"] and not c.get("globalDefault") for c in classes.values())
    interactive = pod_spec(manifests.workload("engine-interactive")).get("priorityClassName")
    batch = pod_spec(manifests.workload("engine-batch")).get("priorityClassName")
    assert interactive in classes and batch in classes, (manifests.overlay, interactive, batch)
    assert classes[interactive]["value"] > classes[batch]["value"] > 0
    assert classes[batch].get("preemptionPolicy") == "Never"  # batch never evicts anyone for a GPU
    # Every class referenced is rendered; only the engines have one.
    for workload in manifests.workloads():
        ref = pod_spec(workload).get("priorityClassName")
        assert ref is None or ref in classes, (manifests.overlay, workload["metadata"]["name"])
        assert ref is None or _is_engine(workload), (manifests.overlay, workload["metadata"]["name"])


def test_pods_pulling_from_a_registry_present_its_secret(manifests):
    for workload in _tollgate_workloads(manifests):
        name = f"{manifests.overlay}: {workload['metadata']['name']}"
        secrets = [s["name"] for s in pod_spec(workload).get("imagePullSecrets", [])]
        registry = all("/" in c["image"] for c in containers(workload))
        # The minimal overlay's image is loaded into the node (kind load): nothing to pull.
        assert secrets == ([PULL_SECRET] if manifests.overlay in GPU_OVERLAYS else []), name
        assert registry == (manifests.overlay in GPU_OVERLAYS), name
    for workload in manifests.workloads():
        if pod_labels(workload)["app.kubernetes.io/component"] in DATASTORES:
            assert "imagePullSecrets" not in pod_spec(workload)  # public images


def test_the_guide_lists_each_per_cluster_value_and_creates_the_pull_secret():
    text = DOC.read_text()
    (section,) = re.findall(r"\n## Per-cluster values\n(.*?)(?=\n## )", text, re.S)
    for needle in ("nvidia.com/gpu.product", "components/gpu/scheduling.yaml", "runtimeClassName",
                   "priorityClassName", "base/priority-classes.yaml", "imagePullSecrets",
                   "components/registry-credentials", "tollgate-engine", "kubectl kustomize"):
        assert needle in section, needle
    assert re.search(rf"kubectl -n tollgate create secret docker-registry {PULL_SECRET}\b", text)
