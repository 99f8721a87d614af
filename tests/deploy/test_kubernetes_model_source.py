"""Weights from a model source, once per node (``components/model-source``, in the GPU overlays): each
engine pod's init container fetches the checkpoint with ``tollgate fetch-model`` into its node's model
cache (a host directory reached through a PersistentVolume, so the namespace's pods stay "restricted"),
the engine loads it from there read-only, and Triton's compiled kernels persist beside it; the gateway and
worker fetch only the tokenizer and configuration, into the files volume they share.

The command lines are parsed by the real ``fetch-model`` command, so a renamed option fails here, not in
a cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import PurePosixPath

import pytest
import yaml

from tests.deploy.manifests import KUSTOMIZE, argv, container, containers, literal_env, option, pod_spec
from tollgate.commands.model_fetch import DEFAULT_INCLUDE, fetch_model

GPU_OVERLAYS = {"gpu", "gpu-tp", "external"}
SOURCE_SCHEMES = ("hf://", "s3://", "/", "file://")


def _fetch_call(c) -> tuple[str, str, tuple[str, ...]]:
    """(source, destination, include patterns) of a container that runs ``tollgate fetch-model``, as the
    command would read them."""
    words = argv(c)
    if words[:2] == ["sh", "-c"]:  # sh -c 'SCRIPT "$0" "$1"' ARG0 ARG1: the script's words, then its args
        script, *args = words[2:]
        assert "tollgate fetch-model \"$0\" \"$1\"" in script, script
        words = ["tollgate", "fetch-model", *args]
    assert words[:2] == ["tollgate", "fetch-model"], words
    context = fetch_model.make_context("fetch-model", words[2:])
    return context.params["source"], str(context.params["dest"]), context.params["include"]


def _mount(c, path: str) -> dict:
    """The volume mount of ``c`` that holds ``path``."""
    mounts = [m for m in c.get("volumeMounts", []) if PurePosixPath(path).is_relative_to(m["mountPath"])]
    assert mounts, (c["name"], path)
    return max(mounts, key=lambda m: len(m["mountPath"]))


def _values(manifests) -> dict[str, str]:
    """The overlay's tollgate-values, read from its values.yaml (not rendered: local-config)."""
    return yaml.safe_load((KUSTOMIZE / "overlays" / manifests.overlay / "values.yaml").read_text())["data"]


@pytest.fixture
def gpu_manifests(manifests):
    if manifests.overlay not in GPU_OVERLAYS:
        pytest.skip(f"{manifests.overlay} writes the tiny demo model in each pod")
    return manifests


def test_engines_fetch_the_checkpoint_into_the_node_cache_and_load_it_from_there(gpu_manifests):
    values = _values(gpu_manifests)
    assert values["modelSource"].startswith(SOURCE_SCHEMES)
    for engine in gpu_manifests.component("engine"):
        name = engine["metadata"]["name"]
        spec = pod_spec(engine)
        fetch, main = container(engine, "model-fetch"), spec["containers"][0]
        assert fetch["image"] == main["image"], name  # the engine image: an engine-only release rolls it
        source, dest, include = _fetch_call(fetch)
        assert source == values["modelSource"] and include == DEFAULT_INCLUDE, name
        words = argv(main)
        assert dest == option(words, "--model"), name  # the engine loads what was fetched
        assert PurePosixPath(dest).name == values["modelName"] == option(words, "--model-name"), name
        # Both reach it through the same volume: the init container writes, the engine only reads.
        written, read = _mount(fetch, dest), _mount(main, dest)
        assert written["name"] == read["name"] and not written.get("readOnly") and read.get("readOnly"), name
        (volume,) = [v for v in spec["volumes"] if v["name"] == read["name"]]
        claim = gpu_manifests.get("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        assert not volume["persistentVolumeClaim"].get("readOnly"), name
        # Credentials, where the source needs them, from an optional Secret (a public model needs none).
        assert {"secretRef": {"name": "tollgate-model-source", "optional": True}} in fetch["envFrom"], name
        assert claim["metadata"]["name"] == "tollgate-model-cache"


def test_the_node_cache_is_one_host_directory_per_node_reserved_for_this_namespace(gpu_manifests):
    claim = gpu_manifests.get("PersistentVolumeClaim", "tollgate-model-cache")
    pv = gpu_manifests.get("PersistentVolume", claim["spec"]["volumeName"])
    assert "namespace" not in pv["metadata"]
    # Bound only to this claim, in this namespace: no other namespace's claim can take the host directory.
    assert pv["spec"]["claimRef"] == {"namespace": gpu_manifests.namespace, "name": "tollgate-model-cache"}
    assert claim["spec"]["storageClassName"] == pv["spec"]["storageClassName"] == ""  # no provisioner
    # The same path on every node and no node affinity: each pod gets its own node's copy, and nothing
    # pins a replica to a node. `Directory`: prepared by the node's bootstrap, owned by the engines' user
    # (a directory the kubelet created would be root's, unwritable).
    assert pv["spec"]["hostPath"]["type"] == "Directory" and "nodeAffinity" not in pv["spec"]
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert set(claim["spec"]["accessModes"]) <= set(pv["spec"]["accessModes"])
    # Its pods stay within the restricted profile: the host path is in the PersistentVolume only.
    for workload in gpu_manifests.workloads():
        assert all("hostPath" not in v for v in pod_spec(workload).get("volumes", []))
    assert not gpu_manifests.has("PersistentVolumeClaim", "tollgate-models")  # nothing to fill by hand


def test_triton_compiles_into_the_node_cache(gpu_manifests):
    """A restarted or new engine on a node reads the kernels the previous one compiled."""
    for engine in gpu_manifests.component("engine"):
        name = engine["metadata"]["name"]
        fetch, main = container(engine, "model-fetch"), pod_spec(engine)["containers"][0]
        cache_dir = literal_env(main)["TRITON_CACHE_DIR"]
        mount = _mount(main, cache_dir)
        assert mount["mountPath"] == cache_dir and not mount.get("readOnly"), name
        models = _mount(main, option(argv(main), "--model"))
        assert mount["name"] == models["name"], name  # the node cache, not the container's own disk
        # The subdirectory exists, created by the init container as the engines' user, before the kubelet
        # mounts it (a subPath it had to create would be root's).
        subdir = str(PurePosixPath(_mount(fetch, "/models")["mountPath"]) / mount["subPath"])
        assert f"mkdir -p {subdir}" in " ".join(argv(fetch)), name


def test_the_installed_triton_compiles_into_the_directory_the_engines_are_given(rendered, tmp_path):
    """TRITON_CACHE_DIR is the variable the Triton in the image reads (checked with the installed one)."""
    pytest.importorskip("triton")
    (engine, *_) = rendered["gpu"].component("engine")
    name = "TRITON_CACHE_DIR"
    assert name in literal_env(pod_spec(engine)["containers"][0])
    probe = ("from triton.runtime.cache import get_cache_manager\n"
             "print(get_cache_manager('0' * 64).cache_dir)")
    result = subprocess.run([sys.executable, "-c", probe], env={**os.environ, name: str(tmp_path)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(tmp_path))


def test_the_gateway_and_worker_fetch_the_tokenizer_not_the_weights(gpu_manifests):
    values = _values(gpu_manifests)
    (model,) = gpu_manifests.tollgate_toml()["models"]
    assert model["name"] == values["modelName"]
    for name in ("gateway", "worker"):
        workload = gpu_manifests.workload(name)
        fetch, main = container(workload, "model-fetch"), pod_spec(workload)["containers"][0]
        assert fetch["image"] == main["image"]
        source, dest, include = _fetch_call(fetch)
        assert source == values["modelSource"] and dest == model["path"], name
        assert include and not any("safetensors" in pattern for pattern in include), name
        assert _mount(fetch, dest)["name"] == _mount(main, dest)["name"], name
        # The volume all gateways and workers share: fetched once for the cluster, and found there by a
        # pod that restarts while the source is unreachable.
        (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == _mount(main, dest)["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] == "tollgate-files", name
        assert gpu_manifests.get("PersistentVolumeClaim", "tollgate-files")["spec"]["accessModes"] == [
            "ReadWriteMany"], name
        # No checkpoint volume left to mount.
        mounted = [m["mountPath"] for c in containers(workload) for m in c.get("volumeMounts", [])]
        assert "/models" not in mounted, name
