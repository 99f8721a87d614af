"""Tenants' LoRA adapters on Kubernetes (issue #39), in every overlay: the gateway writes registered PEFT
bundles into the adapter store (``TOLLGATE_ADAPTER_DIR``), a volume of its own that every engine replica
(interactive, batch, tensor-parallel, prefill) mounts read-only at its ``--lora-dir``; the engines' adapter
slots and highest rank come from the overlay's ``values.yaml``, the same in every engine.
"""

from __future__ import annotations

from pathlib import PurePosixPath

import yaml

from tests.deploy.manifests import KUSTOMIZE, argv, container, containers, literal_env, option, pod_spec

STORE_WRITERS = {"gateway"}  # registration: the API, the dashboard, `tollgate adapters create` in its pod


def _mount(c: dict, path: str) -> dict | None:
    """The volume mount of ``c`` that holds ``path`` (the deepest), or None."""
    mounts = [m for m in c.get("volumeMounts", []) if PurePosixPath(path).is_relative_to(m["mountPath"])]
    return max(mounts, key=lambda m: len(m["mountPath"])) if mounts else None


def _claim(workload: dict, volume_name: str) -> dict:
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == volume_name]
    assert set(volume) == {"name", "persistentVolumeClaim"}, volume  # shared by pods, never a pod's own
    return volume["persistentVolumeClaim"]


def _store(manifests) -> tuple[str, str]:
    """(the adapter store's path, its claim's name), as the gateway sees them."""
    gateway = container(manifests.workload("gateway"), "gateway")
    path = literal_env(gateway)["TOLLGATE_ADAPTER_DIR"]
    mount = _mount(gateway, path)
    assert mount is not None and mount["mountPath"] == path and not mount.get("readOnly"), mount
    assert "subPath" not in mount
    source = _claim(manifests.workload("gateway"), mount["name"])
    assert not source.get("readOnly")
    return path, source["claimName"]


def test_every_engine_reads_the_store_the_gateway_writes(manifests):
    path, claim = _store(manifests)
    spec = manifests.get("PersistentVolumeClaim", claim)["spec"]
    single_node = manifests.overlay == "minimal"  # kind, minikube: the one node's ReadWriteOnce is enough
    assert spec["accessModes"] == (["ReadWriteOnce"] if single_node else ["ReadWriteMany"])
    engines = manifests.component("engine")
    assert engines
    for engine in engines:
        name = f"{manifests.overlay}: {engine['metadata']['name']}"
        main = container(engine, "engine")
        words = argv(main)
        assert option(words, "--lora-dir") == path, name
        mount = _mount(main, path)
        assert mount is not None and mount["mountPath"] == path and "subPath" not in mount, name
        assert mount["readOnly"] is True, name  # only the gateway writes the store
        source = _claim(engine, mount["name"])
        assert source == {"claimName": claim, "readOnly": True}, name


def test_only_the_gateway_writes_the_store(manifests):
    _, claim = _store(manifests)
    for workload in manifests.workloads():
        name = workload["metadata"]["name"]
        volumes = {v["name"] for v in pod_spec(workload).get("volumes", [])
                   if v.get("persistentVolumeClaim", {}).get("claimName") == claim}
        for c in containers(workload):
            for mount in c.get("volumeMounts", []):
                if mount["name"] in volumes and not mount.get("readOnly"):
                    assert name in STORE_WRITERS and c["name"] == name, (manifests.overlay, name, c["name"])


def test_every_engine_serves_adapters_with_the_overlays_slots_and_rank(manifests):
    values = yaml.safe_load((KUSTOMIZE / "overlays" / manifests.overlay / "values.yaml").read_text())["data"]
    for engine in manifests.component("engine"):
        words = argv(container(engine, "engine"))
        name = f"{manifests.overlay}: {engine['metadata']['name']}"
        assert option(words, "--max-loras") == values["maxLoras"], name
        assert option(words, "--max-lora-rank") == values["maxLoraRank"], name
        assert int(values["maxLoras"]) >= 1 and int(values["maxLoraRank"]) >= 1  # 0 slots: no adapters
