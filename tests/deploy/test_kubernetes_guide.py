"""docs/deploy-kubernetes.md walks an operator from an empty cluster to a served model, through upgrades
and rollbacks; every command it gives is checked here against what the overlays render, so a renamed
object, path, container, Secret or CLI command breaks a test rather than an operator's install:

- ``kubectl apply -k PATH`` and ``kubectl kustomize PATH``: the path (each overlay for ``<name>``) renders;
- ``-n NAMESPACE``: the namespace the overlays render;
- ``kind/name`` and ``get KIND NAME`` references, ``-c CONTAINER``: rendered (``test_kubernetes.py``
  checks the ``-l`` selectors); what a ``delete`` names: not rendered (an apply would bring it back);
- ``create secret``: a Secret the manifests read;
- ``port-forward svc/NAME LOCAL:PORT``: a port the Service has;
- ``tollgate ...`` run in a pod: a command the CLI has, with options it accepts;
- the ``patches:`` entries the page gives (YAML blocks): they apply to an overlay and validate.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import PurePosixPath

import click
import kubernetes_validate
import pytest
import yaml

from tests.deploy.manifests import KUBERNETES_VERSION, OVERLAYS, ROOT, argv, containers, kubectl, pod_spec
from tollgate.cli import main as tollgate_cli

DOC = ROOT / "docs" / "deploy-kubernetes.md"
KINDS = {"deploy": "Deployment", "deployment": "Deployment", "statefulset": "StatefulSet",
         "ds": "DaemonSet", "daemonset": "DaemonSet",
         "sts": "StatefulSet", "svc": "Service", "service": "Service", "hpa": "HorizontalPodAutoscaler",
         "pvc": "PersistentVolumeClaim", "scaledobject": "ScaledObject", "pv": "PersistentVolume",
         "configmap": "ConfigMap"}


def _commands() -> list[list[str]]:
    """Every ``kubectl`` command of the page's ``sh`` blocks and inline code, as argv (a pipeline's first
    command; continuation lines joined; comments dropped)."""
    text = DOC.read_text()
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`(kubectl [^`]+)`", text.replace("\n", " "))
    found = []
    for line in lines:
        line = re.sub(r"\s+#.*$", "", line.strip())
        if not line.startswith("kubectl "):
            continue
        words = shlex.split(line.split(" | ")[0])
        found.append(words)
    return found


def _references(words: list[str]) -> list[tuple[str, str]]:
    """The (kind, name) objects a command names: ``kind/name`` words, or ``get|describe|edit KIND NAME``."""
    refs = []
    for word in words:
        if m := re.fullmatch(r"([a-z]+)/([a-z0-9][a-z0-9-]*)", word):
            if m.group(1) in KINDS:
                refs.append((KINDS[m.group(1)], m.group(2)))
    for verb in ("get", "describe", "edit", "delete"):
        if verb in words:
            rest, skip = [], False
            for word in words[words.index(verb) + 1:]:
                if not skip and not word.startswith("-"):
                    rest.append(word)
                skip = word in ("-o", "-l", "-c", "-n")  # an option's value, not a name
            if len(rest) >= 2 and rest[0] in KINDS and "/" not in rest[1] and not rest[1].startswith("<"):
                refs += [(KINDS[rest[0]], name) for name in rest[1:] if re.fullmatch(r"[a-z0-9-]+", name)]
    return refs


def _verb(words: list[str]) -> str:
    """The kubectl verb (``apply``, ``rollout``, ...), past ``-n NAMESPACE``."""
    rest = words[1:]
    while rest and rest[0].startswith("-"):
        rest = rest[2:] if rest[0] in ("-n", "--namespace") else rest[1:]
    return rest[0] if rest else ""


COMMANDS = _commands()


def test_the_guide_gives_commands_for_every_step():
    verbs = {_verb(words) for words in COMMANDS}
    assert {"apply", "kustomize", "create", "rollout", "logs", "exec", "port-forward", "get"} <= verbs


def test_every_kustomize_path_renders(rendered, tmp_path):
    paths = set()
    for words in COMMANDS:
        if words[1:3] == ["apply", "-k"] and len(words) > 3:
            paths.add(words[3])
        elif words[1] == "kustomize" and len(words) > 2:
            paths.add(words[2])
    assert paths
    for path in paths:
        if "<name>" in path:
            expanded = [path.replace("<name>", overlay) for overlay in OVERLAYS]
        else:
            expanded = [path]
        for concrete in expanded:
            assert (ROOT / concrete / "kustomization.yaml").is_file(), concrete
            overlay = PurePosixPath(concrete).name
            if PurePosixPath(concrete).parent.as_posix() == "deploy/kubernetes/overlays":
                assert overlay in rendered, concrete  # rendered (and validated) by the other tests
            else:
                binary = kubectl()
                assert binary is not None
                result = subprocess.run([binary, "kustomize", str(ROOT / concrete)], capture_output=True,
                                        text=True, timeout=120)
                assert result.returncode == 0, (concrete, result.stderr)


def test_every_namespace_object_and_container_named_is_rendered(rendered):
    namespaces = {m.namespace for m in rendered.values()}
    checked = 0
    for words in COMMANDS:
        if "-n" in words:
            assert words[words.index("-n") + 1] in namespaces | {"monitoring"}, words
        for kind, name in _references(words):
            found = [o for m in rendered.values() for o in m.of_kind(kind) if o["metadata"]["name"] == name]
            if kind == "PersistentVolumeClaim":  # a StatefulSet's claims: <template>-<statefulset>-<n>
                found += [s for m in rendered.values() for s in m.of_kind("StatefulSet")
                          for t in s["spec"].get("volumeClaimTemplates", [])
                          if re.fullmatch(rf"{t['metadata']['name']}-{s['metadata']['name']}-\d+", name)]
            if _verb(words) == "delete":  # what an upgrade leaves behind: never what an apply recreates
                assert not found, (" ".join(words), kind, name)
                continue
            assert found, (" ".join(words), kind, name)
            checked += 1
            if "-c" in words and kind in ("Deployment", "StatefulSet"):
                wanted = words[words.index("-c") + 1]
                assert any(wanted in [c["name"] for c in containers(o)] for o in found), (words, wanted)
    assert checked > 10


def test_every_secret_the_guide_creates_is_one_the_manifests_read(rendered):
    read: set[str] = set()
    for manifests in rendered.values():
        for workload in manifests.workloads():
            spec = pod_spec(workload)
            read |= {s["name"] for s in spec.get("imagePullSecrets", [])}
            for c in containers(workload):
                read |= {s["secretRef"]["name"] for s in c.get("envFrom", []) if "secretRef" in s}
                read |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                         if "secretKeyRef" in e.get("valueFrom", {})}
    created = [words[words.index("secret") + 2] for words in COMMANDS
               if "create" in words and "secret" in words and words[words.index("secret") + 1] != "..."]
    assert {"tollgate-secrets", "tollgate-datastores", "tollgate-model-source", "tollgate-registry"} <= set(
        created)
    for name in created:
        assert name in read, name


def test_port_forwards_reach_ports_the_services_have(rendered):
    for words in COMMANDS:
        if "port-forward" in words:
            target = words[words.index("port-forward") + 1]
            kind, name = target.split("/")
            port = int(words[words.index(target) + 1].split(":")[1])
            services = [o for m in rendered.values() for o in m.of_kind(KINDS[kind])
                        if o["metadata"]["name"] == name]
            assert services and all(port in [p["port"] for p in s["spec"]["ports"]] for s in services), words


def test_the_tollgate_commands_run_in_pods_exist():
    run = [words[words.index("--") + 1:] for words in COMMANDS if "--" in words and "exec" in words]
    run = [args for args in run if args and args[0] == "tollgate"]
    assert len(run) >= 3
    for args in run:
        command: click.Command = tollgate_cli
        rest = args[1:]
        while isinstance(command, click.Group):
            sub = command.get_command(click.Context(command), rest[0])
            assert sub is not None, args
            command, rest = sub, rest[1:]
        command.make_context(command.name, [w.replace("<", "").replace(">", "") for w in rest])


def _patches() -> list[tuple[str, str]]:
    """The page's YAML blocks that are entries of an overlay's ``patches:``, with the paragraph before
    each (what it is for)."""
    text = DOC.read_text()
    return [(m.group(1), m.group(2)) for m in
            re.finditer(r"([^\n]*(?:\n[^\n`]+)*)\n\n```yaml\n(  - target:.*?)```", text, re.S)]


@pytest.mark.parametrize("index", range(2))
def test_the_guides_patches_apply_to_an_overlay_and_validate(index, rendered, tmp_path):
    del rendered  # only for its skip where kubectl is missing
    patches = _patches()
    assert len(patches) == 2
    _, patch = patches[index]
    copy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", copy)
    overlay = copy / "kubernetes" / "overlays" / "gpu"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    kustomization.setdefault("patches", []).extend(yaml.safe_load(patch))
    volume_source = "model-share" in patch
    if volume_source:  # what the paragraph says to add beside the patch
        (overlay / "model-share.yaml").write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "model-share"},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}}}}))
        kustomization["resources"].append("model-share.yaml")
        values = yaml.safe_load((overlay / "values.yaml").read_text())
        values["data"]["modelSource"] = "/source/llama-3.1-8b-instruct"
        (overlay / "values.yaml").write_text(yaml.safe_dump(values))
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    binary = kubectl()
    assert binary is not None
    result = subprocess.run([binary, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    objects = [d for d in yaml.safe_load_all(result.stdout) if d]
    for obj in objects:
        if obj["apiVersion"].startswith(("keda.sh", "monitoring.coreos.com")):
            continue  # test_kubernetes.py validates those against their CRDs' schemas
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    workloads = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "DaemonSet")}
    if volume_source:
        for name in ("engine-interactive", "engine-batch", "gateway", "worker", "model-prefetch"):
            spec = pod_spec(workloads[name])
            fetch = spec["initContainers"][0]
            assert fetch["name"] == "model-fetch" and "/source/llama-3.1-8b-instruct" in argv(fetch), name
            assert {"name": "source", "mountPath": "/source", "readOnly": True} in fetch["volumeMounts"], name
            assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "model-share"
                       for v in spec["volumes"]), name
    else:
        for name in ("engine-interactive", "engine-batch"):
            strategy = workloads[name]["spec"]["strategy"]["rollingUpdate"]
            assert strategy == {"maxSurge": 0, "maxUnavailable": 1}, name


def test_the_requests_the_guide_sends_name_a_model_an_overlay_serves(rendered):
    served = {m["name"] for manifests in rendered.values() for m in manifests.tollgate_toml()["models"]}
    blocks = "\n".join(re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S))
    named = re.findall(r'"model":\s*"([^"]+)"', blocks)
    assert named
    assert set(named) <= served, (named, served)


def test_the_add_ons_are_installed_where_the_manifests_look_for_them(rendered):
    """KEDA and the Prometheus stack go into the namespaces the NetworkPolicies admit and the KEDA
    triggers query; the RuntimeClass checked is the one the GPU engines run with."""
    blocks = "\n".join(re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S)).replace("\\\n", " ")
    installed = dict(re.findall(r"helm install \S+ (\S+) --namespace (\S+)", blocks))
    assert installed["kedacore/keda"] == "keda"
    assert installed["prometheus-community/kube-prometheus-stack"] == "monitoring"
    gpu = rendered["gpu"]
    admitted = {peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                for policy in gpu.of_kind("NetworkPolicy") for rule in policy["spec"]["ingress"]
                for peer in rule["from"] if "namespaceSelector" in peer}
    assert {"keda", "monitoring"} <= admitted
    for scaled in gpu.of_kind("ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                assert ".monitoring.svc:" in trigger["metadata"]["serverAddress"]
    (runtime,) = re.findall(r"kubectl get runtimeclass (\S+)", blocks)
    assert {pod_spec(e).get("runtimeClassName") for e in gpu.component("engine")} == {runtime}
    assert "serviceMonitorSelectorNilUsesHelmValues=false" in blocks  # it takes this deployment's monitors
