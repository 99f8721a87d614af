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

from tests.deploy.manifests import (
    GPU_OVERLAYS,
    KUSTOMIZE,
    argv,
    container,
    containers,
    literal_env,
    option,
    pod_spec,
)
from tollgate.commands.model_fetch import DEFAULT_INCLUDE, fetch_model

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
    # Cluster-scoped, so named after the installation's namespace: two namespaces, two volumes.
    assert pv["metadata"]["name"] == f"tollgate-model-cache-{gpu_manifests.namespace}"
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


def test_every_gpu_node_prefetches_the_model_without_holding_a_gpu(gpu_manifests):
    """The model-prefetch DaemonSet runs the engines' fetch on every node the engines may use, so a
    replica KEDA adds finds the model there; it requests no GPU, and a new source reaches every node at
    once."""
    prefetch = gpu_manifests.get("DaemonSet", "model-prefetch")
    spec = pod_spec(prefetch)
    fetch = container(prefetch, "model-fetch")
    for engine in gpu_manifests.component("engine"):
        engine_fetch = container(engine, "model-fetch")
        assert argv(fetch) == argv(engine_fetch) and fetch["envFrom"] == engine_fetch["envFrom"]
        (engine_volume,) = [v for v in pod_spec(engine)["volumes"] if v["name"] == _mount(engine_fetch,
                                                                                          "/models")["name"]]
        (volume,) = [v for v in spec["volumes"] if v["name"] == _mount(fetch, "/models")["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] == engine_volume["persistentVolumeClaim"][
            "claimName"]
    for c in containers(prefetch):
        assert not any(k.startswith("nvidia.com/") for kind in ("requests", "limits")
                       for k in c.get("resources", {}).get(kind, {})), c["name"]
    assert prefetch["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "100%"


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


def _run_as_rendered(c, source: str, root, tmp_path) -> subprocess.CompletedProcess:
    """Runs an init container's command as the kubelet would (its $(VAR)s from its environment, with
    MODEL_SOURCE pointed at ``source``), with every absolute path of the pod moved under ``root`` and the
    repository's ``tollgate`` first on PATH."""
    c = {**c, "env": [{"name": e["name"], "value": source} if e["name"] == "MODEL_SOURCE" else e
                      for e in c.get("env", [])]}
    words = [w.replace("/models", f"{root}/models").replace("/var/lib/tollgate", f"{root}/var/lib/tollgate")
             for w in argv(c)]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(words, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_rendered_fetch_commands_fetch(rendered, tmp_path):
    """The init containers' command lines, as rendered, run: the engines' (through sh, with its Triton
    directory) puts the checkpoint where the engine loads it, the gateway's only the tokenizer files where
    tollgate.toml says, and a second run on the same node finds the copy."""
    manifests = rendered["gpu"]
    published = tmp_path / "published"
    files = {"config.json": b"{}", "tokenizer.json": b"{}", "chat_template.jinja": b"{{ x }}",
             "model.safetensors": b"weights" * 1000}
    published.mkdir()
    for name, body in files.items():
        (published / name).write_bytes(body)
    root = tmp_path / "node"
    engine = manifests.workload("engine-interactive")
    fetch, main = container(engine, "model-fetch"), pod_spec(engine)["containers"][0]
    (root / "models").mkdir(parents=True)  # the node cache directory the bootstrap prepares
    first = _run_as_rendered(fetch, str(published), root, tmp_path)
    assert first.returncode == 0, first.stderr
    loaded = root / option(argv(main), "--model").lstrip("/")
    assert {p.name: p.read_bytes() for p in loaded.iterdir() if not p.name.startswith(".")} == files
    assert (root / "models" / ".triton").is_dir()
    again = _run_as_rendered(fetch, str(published), root, tmp_path)
    assert again.returncode == 0 and "already held" in again.stdout

    gateway_fetch = container(manifests.workload("gateway"), "model-fetch")
    (root / "var" / "lib" / "tollgate" / "files").mkdir(parents=True)
    done = _run_as_rendered(gateway_fetch, str(published), root, tmp_path)
    assert done.returncode == 0, done.stderr
    (model,) = manifests.tollgate_toml()["models"]
    tokenizer = root / model["path"].lstrip("/")
    assert sorted(p.name for p in tokenizer.iterdir() if not p.name.startswith(".")) == [
        "chat_template.jinja", "config.json", "tokenizer.json"]  # no weights
