"""One source per value (docs/deploy-kubernetes.md, "One place per value"): each overlay sets its
namespace (``namespace:``), image tags (``images:``), model name and source (and the tensor-parallel
size) and the engines' adapter slots and rank (``values.yaml``) once, and kustomize writes each into
every field that uses it: replacements, not copies. Checked by changing each source in a copy of
``deploy/`` and finding every use changed and the old value nowhere in what renders.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.manifests import (
    GPU_OVERLAYS,
    OVERLAYS,
    ROOT,
    Manifests,
    argv,
    containers,
    kubectl,
    option,
    pod_spec,
    tensor_parallel_size,
)

NAMESPACE = "acme-llm"
MODEL = "acme-chat-v2"
SOURCE = "s3://acme-weights/chat/v2"
TAGS = {"tollgate": "9.9.9-platform", "tollgate-engine": "9.9.9-engine"}


def _render_changed(overlay: str, tmp_path, values: dict[str, str]) -> tuple[Manifests, str]:
    copy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", copy)
    where = copy / "kubernetes" / "overlays" / overlay
    kustomization = yaml.safe_load((where / "kustomization.yaml").read_text())
    kustomization["namespace"] = NAMESPACE
    for entry in kustomization["images"]:
        entry["newTag"] = TAGS[entry["name"]]
    (where / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    if values:
        document = yaml.safe_load((where / "values.yaml").read_text())
        document["data"].update(values)
        (where / "values.yaml").write_text(yaml.safe_dump(document))
    binary = kubectl()
    assert binary is not None
    result = subprocess.run([binary, "kustomize", str(where)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return Manifests(overlay, [d for d in yaml.safe_load_all(result.stdout) if d]), result.stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_namespace_and_image_tags_are_set_once(overlay, rendered, tmp_path):
    before = rendered[overlay]
    old = before.namespace
    manifests, text = _render_changed(overlay, tmp_path, {})
    assert manifests.namespace == NAMESPACE
    for obj in manifests.objects:
        namespace = obj["metadata"].get("namespace")
        assert namespace in (None, NAMESPACE), (obj["kind"], obj["metadata"]["name"])
    for scaled in manifests.of_kind("ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                assert f'namespace="{NAMESPACE}"' in trigger["metadata"]["query"]
    for pv in manifests.of_kind("PersistentVolume"):  # cluster-scoped: one per installation
        assert pv["spec"]["claimRef"]["namespace"] == NAMESPACE
        assert pv["metadata"]["name"].endswith(f"-{NAMESPACE}")
        claim = manifests.get("PersistentVolumeClaim", pv["spec"]["claimRef"]["name"])
        assert claim["spec"]["volumeName"] == pv["metadata"]["name"]
    # The old namespace as a namespace nowhere: not as a field, a label value in a query, a DNS name.
    assert not re.search(rf'namespace: {old}\n|namespace="{old}"|\.{old}\.svc', text)
    for workload in manifests.workloads():
        for c in containers(workload):
            if not c["image"].startswith(("postgres:", "redis:")):
                where = (workload["metadata"]["name"], c["name"])
                assert c["image"].rsplit(":", 1)[1] in TAGS.values(), where


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_the_model_name_source_and_tensor_parallel_size_are_set_once(overlay, rendered, tmp_path):
    before_values = yaml.safe_load(
        (ROOT / "deploy" / "kubernetes" / "overlays" / overlay / "values.yaml").read_text())["data"]
    changed = {"modelName": MODEL, "modelSource": SOURCE}
    tp = "tensorParallelSize" in before_values
    if tp:
        changed["tensorParallelSize"] = "8"
    manifests, text = _render_changed(overlay, tmp_path, changed)
    (model,) = manifests.tollgate_toml()["models"]
    assert model["name"] == MODEL
    for engine in manifests.component("engine"):
        spec = pod_spec(engine)
        words = argv(spec["containers"][0])
        assert option(words, "--model-name") == MODEL and option(words, "--model").endswith(f"/{MODEL}")
        fetch = [c for c in spec["initContainers"] if c["name"] == "model-fetch"]
        assert fetch and SOURCE in argv(fetch[0]) and f"/models/{MODEL}" in argv(fetch[0])
        if tp:
            assert tensor_parallel_size(words) == 8
            for kind in ("requests", "limits"):
                assert int(spec["containers"][0]["resources"][kind]["nvidia.com/gpu"]) == 8
    for name in ("gateway", "worker"):
        inits = pod_spec(manifests.workload(name))["initContainers"]
        (fetch,) = [c for c in inits if c["name"] == "model-fetch"]
        assert SOURCE in argv(fetch)
    # The old values are gone from everything that renders: no copy was left behind.
    assert before_values["modelName"] not in text and before_values["modelSource"] not in text
    # The tollgate.toml the gateway mounts changed, so its hash-suffixed name did, and the pods roll.
    def config_name(m: Manifests) -> str:
        (config,) = [c["metadata"]["name"] for c in m.of_kind("ConfigMap")
                     if c["metadata"]["name"].startswith("tollgate-config")]
        return config
    assert config_name(manifests) != config_name(rendered[overlay])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_adapter_slots_and_rank_are_set_once(overlay, rendered, tmp_path):
    """``maxLoras`` and ``maxLoraRank`` in values.yaml reach every engine Deployment, those a component adds
    (the prefill pool) included."""
    manifests, _ = _render_changed(overlay, tmp_path, {"maxLoras": "13", "maxLoraRank": "96"})
    engines = manifests.component("engine")
    assert {e["metadata"]["name"] for e in engines} == {
        e["metadata"]["name"] for e in rendered[overlay].component("engine")}
    for engine in engines:
        words = argv(pod_spec(engine)["containers"][0])
        where = (overlay, engine["metadata"]["name"])
        assert option(words, "--max-loras") == "13" and option(words, "--max-lora-rank") == "96", where
