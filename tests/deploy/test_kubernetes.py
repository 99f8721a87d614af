"""The Kubernetes deployment (``deploy/kubernetes``), rendered for each overlay (minimal: bundled
Postgres/Redis and CPU engines; gpu: GPU pools with KEDA; gpu-tp: the same with each replica split over
several GPUs; external: managed Postgres/Redis) and checked:
every object against the Kubernetes schemas (core kinds, strict) or Tollgate's schemas of the CRDs it
uses (KEDA, Prometheus Operator; ``tests/deploy/schemas``), then what makes it work: selectors that pick
the pods they mean, probes on the right ports, drain times that cover the drain, the engines reachable
only from the gateway and worker, secrets only from Secrets, settings and engine options that exist, one
image.

Autoscaling, GPUs and the CRDs' content: ``test_kubernetes_scaling.py``; migrations:
``test_kubernetes_migrations.py``.
"""

from __future__ import annotations

import json
import os
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import SecretStr

from engine.gate import CUT_GRACE_S
from tests.deploy.manifests import (
    KUBERNETES_VERSION,
    ROOT,
    argv,
    container,
    containers,
    literal_env,
    option,
    pod_labels,
    pod_spec,
    port_number,
    quantity_gib,
    selects,
)
from tollgate.commands.model import engine as engine_command
from tollgate.settings import PoolConfig, Settings

SCHEMAS = ROOT / "tests" / "deploy" / "schemas"
CRD_SCHEMAS = {"ScaledObject": "keda-scaledobject.json",
               "TriggerAuthentication": "keda-triggerauthentication.json",
               "ServiceMonitor": "servicemonitor.json", "PrometheusRule": "prometheusrule.json"}
DOC = ROOT / "docs" / "deploy-kubernetes.md"
# Names this deployment uses that issue #24's other parts add beside it: the engines' internal token
# (a setting) and a pool named by DNS (a pool field). Empty these sets once those parts have landed; the
# tests then check the names like every other.
SETTINGS = {f"TOLLGATE_{name.upper()}" for name in Settings.model_fields}
SECRET_SETTINGS = {f"TOLLGATE_{name.upper()}" for name, field in Settings.model_fields.items()
                   if SecretStr in (getattr(field.annotation, "__args__", None) or (field.annotation,))}
SECRET_SETTINGS |= {"TOLLGATE_DATABASE_URL", "TOLLGATE_REDIS_URL"}
ENGINE_OPTIONS = {opt for param in engine_command.params for opt in param.opts}
(ENGINE_DRAIN_S,) = [param.default for param in engine_command.params if param.name == "drain_timeout_s"]
# The engine's exit after its drain: the step loop stopped, tensor-parallel ranks joined.
ENGINE_SHUTDOWN_S = 10


def crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[kind]).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_every_object_validates_against_its_schema(manifests):
    for obj in manifests.objects:
        name = f"{manifests.overlay}: {obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in CRD_SCHEMAS:
            errors = [e.message for e in crd_validator(obj["kind"]).iter_errors(obj)]
            assert errors == [], name
        else:
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {e.message} at {list(e.path)}")


def test_the_crd_schemas_refuse_what_the_api_server_would_silently_drop():
    scaled = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"},
              "spec": {"scaleTargetRef": {"name": "engine"}, "minReplicas": 1,
                       "triggers": [{"type": "prometheus", "metadata": {"serverAddress": "http://p:9090",
                                                                        "query": "sum(x)", "threshold": 5}}]}}
    messages = " ".join(e.message for e in crd_validator("ScaledObject").iter_errors(scaled))
    assert "minReplicas" in messages and "5 is not of type 'string'" in messages
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"},
               "spec": {"selector": {"matchLabels": {"a": "b"}},
                        "endpoints": [{"port": "http", "bearer": "t"}]}}
    assert not crd_validator("ServiceMonitor").is_valid(monitor)
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "x"},
            "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up == 0", "for": "5m"}]}]}}
    assert crd_validator("PrometheusRule").is_valid(rule)
    for wrong in ({"alert": "A", "expr": "up == 0", "for": "five minutes"},  # not a duration
                  {"alert": "A", "expr": "up == 0", "severity": "critical"},  # a label outside `labels`
                  {"alert": "A", "record": "b", "expr": "up"},  # both
                  {"record": "b", "expr": "up", "for": "5m"}):  # `for` on a recording rule
        rule["spec"]["groups"][0]["rules"] = [wrong]
        assert not crd_validator("PrometheusRule").is_valid(rule), wrong


def test_selectors_pick_the_pods_they_mean(manifests):
    for workload in manifests.workloads():
        name = workload["metadata"]["name"]
        assert selects(workload["spec"]["selector"], pod_labels(workload)), name
        others = [w for w in manifests.workloads() if w is not workload]
        assert not any(selects(workload["spec"]["selector"], pod_labels(w)) for w in others), name
    for service in manifests.of_kind("Service"):
        picked = manifests.selected_workloads(service["spec"]["selector"])
        assert len(picked) == 1, f"{service['metadata']['name']} selects {picked}"
        (workload,) = [w for w in manifests.workloads() if w["metadata"]["name"] == picked[0]]
        main = pod_spec(workload)["containers"][0]
        for port in service["spec"]["ports"]:
            port_number(main, port["targetPort"])  # a port the pods really have
    for pdb in manifests.of_kind("PodDisruptionBudget"):
        assert manifests.selected_workloads(pdb["spec"]["selector"]), pdb["metadata"]["name"]
    for policy in manifests.of_kind("NetworkPolicy"):
        assert manifests.selected_workloads(policy["spec"]["podSelector"]), policy["metadata"]["name"]


def test_probes_ask_health_on_the_serving_port(manifests):
    for name, port in (("gateway", 8000), ("engine-interactive", 8100), ("engine-batch", 8100)):
        workload = manifests.workload(name)
        main = pod_spec(workload)["containers"][0]
        readiness = main["readinessProbe"]["httpGet"]
        assert readiness["path"] == "/health" and port_number(main, readiness["port"]) == port, name
        liveness = main["livenessProbe"]
        if name == "gateway":
            assert port_number(main, liveness["tcpSocket"]["port"]) == port, name
        else:  # the engine's own judgement of a stuck step loop or failing device (engine /live)
            probe = liveness["httpGet"]
            assert probe["path"] == "/live" and port_number(main, probe["port"]) == port, name
    for name in ("engine-interactive", "engine-batch"):
        main = pod_spec(manifests.workload(name))["containers"][0]
        startup = main["startupProbe"]
        assert startup["httpGet"]["path"] == "/health"
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # loading weights takes minutes
        assert option(argv(main), "--port") == "8100" and option(argv(main), "--host") == "0.0.0.0"
    for name in ("worker", "beat"):
        main = pod_spec(manifests.workload(name))["containers"][0]
        assert main["livenessProbe"]["exec"]["command"] == ["python", "-m", "tollgate.worker", "check", name]


def test_beat_is_a_singleton(manifests):
    beat = manifests.workload("beat")
    assert beat["kind"] == "Deployment" and beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    targets = [h["spec"]["scaleTargetRef"]["name"] for h in manifests.of_kind("HorizontalPodAutoscaler")]
    targets += [s["spec"]["scaleTargetRef"]["name"] for s in manifests.of_kind("ScaledObject")]
    assert "beat" not in targets


def test_grace_periods_cover_the_drain(manifests):
    gateway = pod_spec(manifests.workload("gateway"))
    pause = int(gateway["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = manifests.tollgate_toml()["drain_timeout_s"]
    # uvicorn's graceful shutdown, then the metering of cut streams: each bounded by drain_timeout_s.
    assert pause + 2 * drain < gateway["terminationGracePeriodSeconds"]
    for engine in manifests.component("engine"):
        spec = pod_spec(engine)
        main = spec["containers"][0]
        pause = int(main["lifecycle"]["preStop"]["exec"]["command"][1])
        words = argv(main)
        # The engine's drain on SIGTERM (engine.gate): open streams get --drain-timeout-s, then uvicorn
        # lets the cut connections close (CUT_GRACE_S), then the engine and its ranks shut down.
        drain = float(option(words, "--drain-timeout-s")) if "--drain-timeout-s" in words else ENGINE_DRAIN_S
        assert spec["terminationGracePeriodSeconds"] - pause >= drain + CUT_GRACE_S + ENGINE_SHUTDOWN_S, (
            engine["metadata"]["name"])


def _engine_pools(manifests) -> set[str]:
    """The pools the rendered engine Deployments serve (``--pool``)."""
    return {option(argv(pod_spec(e)["containers"][0]), "--pool") for e in manifests.component("engine")}


def test_pools_are_found_through_their_headless_services(manifests):
    config = manifests.tollgate_toml()
    # Every pool an engine Deployment serves, and no other (components/disaggregated adds prefill).
    assert set(config["pools"]) == _engine_pools(manifests)
    assert {"interactive", "batch"} <= set(config["pools"])
    for pool, entry in config["pools"].items():
        host, port = entry["dns"].rsplit(":", 1)
        # The Service's name alone (the pod's DNS search path adds its own namespace), or fully qualified.
        service_name, *rest = host.split(".", 2)
        assert rest in ([], [manifests.namespace, "svc.cluster.local"]), host
        service = manifests.get("Service", service_name)
        assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses")
        assert int(port) in [p["port"] for p in service["spec"]["ports"]]
        (engine,) = manifests.selected_workloads(service["spec"]["selector"])
        words = argv(pod_spec(manifests.workload(engine))["containers"][0])
        assert option(words, "--pool") == pool
        models = [m for m in config["models"] if pool in m["pools"]]
        assert [m["name"] for m in models] == [option(words, "--model-name")]
        # The checkpoint the engine loads is the one its init container writes (or fetches).
        inits = pod_spec(manifests.workload(engine)).get("initContainers", [])
        assert any(option(words, "--model") in " ".join(argv(c)) for c in inits), engine
    # The gateway and worker read the model's tokenizer where their own init container put it.
    for model in config["models"]:
        for name in ("gateway", "worker"):
            inits = pod_spec(manifests.workload(name)).get("initContainers", [])
            assert any(model["path"] in " ".join(argv(c)) for c in inits), (name, model["path"])


def _policy_ports(manifests, policy) -> list[list[int]]:
    """Each ingress rule's ports as numbers (a named port resolved in every pod the policy selects)."""
    found = []
    for rule in policy["spec"]["ingress"]:
        numbers = set()
        for port in rule["ports"]:
            for name in manifests.selected_workloads(policy["spec"]["podSelector"]):
                numbers.add(port_number(pod_spec(manifests.workload(name))["containers"][0], port["port"]))
        assert len(numbers) == len(rule["ports"]), policy["metadata"]["name"]
        found.append(sorted(numbers))
    return found


def test_only_the_gateway_and_worker_reach_the_engines(manifests):
    """And, where prefill and decode are apart, the decode replicas reach the prefill replicas' KV transfer
    port: that port only, those pods only."""
    engines = {w["metadata"]["name"] for w in manifests.component("engine")}
    policies = [p for p in manifests.of_kind("NetworkPolicy")
                if set(manifests.selected_workloads(p["spec"]["podSelector"])) & engines]
    base = manifests.get("NetworkPolicy", "engines-from-gateway-and-worker")
    assert set(manifests.selected_workloads(base["spec"]["podSelector"])) == engines
    for policy in policies:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert set(manifests.selected_workloads(policy["spec"]["podSelector"])) <= engines
        if policy["metadata"]["name"] == "engine-prefill-from-decode":
            assert manifests.selected_workloads(policy["spec"]["podSelector"]) == ["engine-prefill"]
            (rule,) = policy["spec"]["ingress"]
            (peer,) = rule["from"]
            assert set(peer) == {"podSelector"}
            assert manifests.selected_workloads(peer["podSelector"]) == ["engine-interactive"]
            prefill = container(manifests.workload("engine-prefill"), "engine")
            assert _policy_ports(manifests, policy) == [[int(option(argv(prefill), "--kv-transfer-port"))]]
            continue
        for rule, ports in zip(policy["spec"]["ingress"], _policy_ports(manifests, policy), strict=True):
            assert ports == [8100]
            for peer in rule["from"]:
                if "podSelector" in peer:
                    assert "namespaceSelector" not in peer
                    assert manifests.selected_workloads(peer["podSelector"]) == ["gateway", "worker"]
                else:  # Prometheus, for /metrics: only where something scrapes it
                    assert peer == {"namespaceSelector": {"matchLabels": {
                        "kubernetes.io/metadata.name": "monitoring"}}}
                    assert manifests.of_kind("ServiceMonitor")


def test_secrets_come_from_secrets_never_from_the_manifests(manifests):
    assert manifests.of_kind("Secret") == []  # created by the operator (docs), never rendered from git
    for workload in manifests.workloads():
        for c in containers(workload):
            assert not set(literal_env(c)) & SECRET_SETTINGS, f"{workload['metadata']['name']}/{c['name']}"
    text = yaml.safe_dump_all(manifests.objects)
    assert not re.search(r"(postgres(ql)?|redis)://[^\s/]*:[^\s/@]*@", text)  # no URL with a password


def _secret_keys(manifests) -> set[tuple[str, str]]:
    keys = set()
    for workload in manifests.workloads():
        for c in containers(workload):
            for e in c.get("env", []):
                if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                    keys.add((ref["name"], ref["key"]))
    for auth in manifests.of_kind("TriggerAuthentication"):
        keys |= {(ref["name"], ref["key"]) for ref in auth["spec"]["secretTargetRef"]}
    for monitor in manifests.of_kind("ServiceMonitor"):
        for endpoint in monitor["spec"]["endpoints"]:
            if creds := endpoint.get("authorization", {}).get("credentials"):
                keys.add((creds["name"], creds["key"]))
    return keys


def _documented_secret_keys() -> dict[str, set[str]]:
    """The keys each ``kubectl create secret generic NAME`` command of the guide writes."""
    found: dict[str, set[str]] = {}
    commands = re.findall(r"kubectl[^\n]*create secret generic (\S+)((?:[^\n]*\\\n)*[^\n]*)", DOC.read_text())
    for name, rest in commands:
        found.setdefault(name, set()).update(re.findall(r"--from-literal=([A-Z_]+)=", rest))
    return found


def test_every_secret_key_used_is_created_by_the_guide(manifests):
    documented = _documented_secret_keys()
    for name, key in _secret_keys(manifests):
        assert key in documented.get(name, set()), f"{name}/{key} is not in {DOC.name}'s commands"
    app_keys = {"TOLLGATE_KEY_HASH_SECRET", "TOLLGATE_SESSION_SECRET", "TOLLGATE_INTERNAL_TOKEN"}
    assert app_keys <= documented["tollgate-secrets"]
    assert {"TOLLGATE_DATABASE_URL", "TOLLGATE_REDIS_URL"} <= documented["tollgate-datastores"]
    for workload in manifests.workloads():
        for c in containers(workload):
            for source in c.get("envFrom", []):
                assert source["secretRef"]["name"] in documented


def test_environment_and_configuration_name_real_settings(manifests):
    for workload in manifests.workloads():
        for c in containers(workload):
            for e in c.get("env", []):
                if e["name"].startswith("TOLLGATE_"):
                    assert e["name"] in SETTINGS, f"{workload['metadata']['name']}: {e['name']}"
    for keys in _documented_secret_keys().values():
        assert {k for k in keys if k.startswith("TOLLGATE_")} <= SETTINGS
    config = manifests.tollgate_toml()
    assert set(config) <= set(Settings.model_fields)
    for pool in config["pools"].values():
        assert set(pool) <= set(PoolConfig.model_fields)


def test_engines_are_started_with_options_the_engine_has(manifests):
    for engine in manifests.component("engine"):
        words = argv(pod_spec(engine)["containers"][0])
        assert words[:2] == ["tollgate", "engine"]
        flags = {word for word in words[2:] if word.startswith("-")}
        assert flags <= ENGINE_OPTIONS, engine["metadata"]["name"]


def test_the_configuration_loads_into_the_settings(manifests, tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("TOLLGATE_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "tollgate.toml"
    path.write_text(manifests.tollgate_toml_text())
    monkeypatch.setenv("TOLLGATE_CONFIG_FILE", str(path))
    monkeypatch.setenv("TOLLGATE_KEY_HASH_SECRET", "from-the-secret")
    monkeypatch.setenv("TOLLGATE_SESSION_SECRET", "from-the-secret-too")
    monkeypatch.setenv("TOLLGATE_INTERNAL_TOKEN", "from-the-secret-as-well-32-chars")
    settings = Settings()
    assert settings.environment == "production" and settings.port == 8000
    assert {m.name for m in settings.models} and set(settings.pools) == _engine_pools(manifests)
    for model in settings.models:
        assert set(model.pools) == set(settings.pools), model.name  # every pool serves the one model
    assert all(pool.dns for pool in settings.pools.values())  # replicas found through the headless Services


def test_one_image_for_every_tollgate_process(manifests):
    """One image build, under two names: the engines' (``tollgate-engine``) and every other process's
    (``tollgate``), each with its own tag (``test_kubernetes_cluster_values.py``), from one repository."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    images: dict[bool, set[str]] = {True: set(), False: set()}
    for workload in manifests.workloads():
        for c in containers(workload):
            assert c["imagePullPolicy"] == "IfNotPresent"
            component = pod_labels(workload)["app.kubernetes.io/component"]
            if component in ("postgres", "redis"):
                assert c["image"] == compose[component]["image"]  # the versions docker-compose.yml runs
                if component == "redis":
                    assert c["command"] == compose["redis"]["command"]  # durable, never evicting
            else:
                images[component == "engine"].add(c["image"])
    assert len(images[True]) == 1 and len(images[False]) == 1, images
    assert len({image.rsplit(":", 1)[0] for image in images[True] | images[False]}) == 1, images
    assert manifests.overlay != "minimal" or images[True] | images[False] == {"tollgate:latest"}


def test_the_guide_installs_every_overlay(rendered):
    text = DOC.read_text()
    for overlay in rendered:
        assert f"kubectl apply -k deploy/kubernetes/overlays/{overlay}" in text
    assert "docs/deploy-kubernetes.md" in (ROOT / "README.md").read_text()


GUIDE_KINDS = {"deploy": "Deployment", "statefulset": "StatefulSet", "svc": "Service",
               "hpa": "HorizontalPodAutoscaler", "pvc": "PersistentVolumeClaim",
               "scaledobject": "ScaledObject"}


def test_the_guides_commands_name_objects_the_overlays_render(rendered):
    """Every ``kind/name`` (and ``-c`` container of it) and every ``-l`` label selector in the guide's
    commands is rendered by an overlay: a renamed or re-kinded object breaks a test, not an operator's
    upgrade."""
    text = DOC.read_text()
    kinds = "|".join(GUIDE_KINDS)
    reference = re.compile(rf"(?<![\w/-])({kinds})/([a-z0-9][a-z0-9-]*)(?![\w/-])(?: -c ([a-z0-9-]+))?")
    references = reference.findall(text)
    assert references
    for short, name, container_name in references:
        found = [o for m in rendered.values() for o in m.of_kind(GUIDE_KINDS[short])
                 if o["metadata"]["name"] == name]
        assert found, f"{short}/{name} is rendered by no overlay"
        if container_name:
            # In the overlays that have it (the model fetch is the GPU overlays' only).
            assert any(container_name in [c["name"] for c in containers(o)] for o in found), (
                name, container_name)
    selectors = re.findall(r" -l ([\w./-]+=[\w.-]+(?:,[\w./-]+=[\w.-]+)*)", text)
    assert selectors
    for selector in selectors:
        wanted = dict(term.split("=", 1) for term in selector.split(","))
        assert any(m.selected_workloads({"matchLabels": wanted}) for m in rendered.values()), selector


def test_pods_run_unprivileged(manifests):
    for workload in manifests.workloads():
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for c in containers(workload):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container(manifests.workload("gateway"), "gateway")["resources"]["requests"]["cpu"]


# Kinds with no namespace (the API server ignores one on them).
CLUSTER_SCOPED = {"Namespace", "StorageClass", "PriorityClass", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "RuntimeClass", "PersistentVolume"}


def test_every_namespaced_object_lands_in_the_namespace(manifests):
    """``kubectl apply -k`` of an overlay puts every object in the one namespace, the components' too:
    a component's object without one would land in ``default``, where its Secrets, Services and targets
    are not (the bundled Postgres could not read its password; KEDA would find no engine to scale)."""
    strays = [(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace"))
              for o in manifests.objects
              if o["kind"] not in CLUSTER_SCOPED and o["metadata"].get("namespace") != manifests.namespace]
    assert not strays, f"{manifests.overlay}: outside {manifests.namespace}: {strays}"


def test_every_reference_resolves_inside_the_rendered_set(manifests):
    """What an object names (a ScaledObject's target and its TriggerAuthentication, a ServiceMonitor's
    Services, a pool's headless Service and its namespace in tollgate.toml, a Service a URL names) is
    rendered beside it, in the same namespace."""
    for scaled in manifests.of_kind("ScaledObject"):
        target = scaled["spec"]["scaleTargetRef"]
        assert manifests.has(target.get("kind", "Deployment"), target["name"]), target
        for trigger in scaled["spec"]["triggers"]:
            auth = trigger.get("authenticationRef")
            if auth:
                assert manifests.has(auth.get("kind", "TriggerAuthentication"), auth["name"]), auth
    for monitor in manifests.of_kind("ServiceMonitor"):
        assert any(selects(monitor["spec"]["selector"], s["metadata"].get("labels", {}))
                   for s in manifests.of_kind("Service")), monitor["metadata"]["name"]
    for host in re.findall(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc", manifests.tollgate_toml_text()):
        service, namespace = host
        assert namespace == manifests.namespace and manifests.has("Service", service), host


def test_the_bundled_redis_refuses_writes_before_its_memory_limit(manifests):
    """noeviction without maxmemory is an OOM kill: the bundled Redis stops short of its limit."""
    if not manifests.has("StatefulSet", "redis"):
        pytest.skip(f"{manifests.overlay} uses an external Redis")
    redis_container = container(manifests.get("StatefulSet", "redis"), "redis")
    words = argv(redis_container)
    assert option(words, "--maxmemory-policy") == "noeviction"
    maxmemory = option(words, "--maxmemory")
    assert maxmemory.endswith("mb") and int(maxmemory[:-2]) / 1024 < 0.8 * quantity_gib(
        redis_container["resources"]["limits"]["memory"])


# The volume types Pod Security's "restricted" profile allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def test_the_namespace_enforces_the_restricted_pod_security_profile_and_every_pod_meets_it(manifests):
    """The namespace refuses pods that would run privileged; every pod rendered here passes: non-root,
    RuntimeDefault seccomp, no privilege escalation, all capabilities dropped, only allowed volumes."""
    labels = manifests.get("Namespace", manifests.namespace)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    for workload in manifests.workloads():
        name = workload["metadata"]["name"]
        spec = pod_spec(workload)
        pod = spec.get("securityContext", {})
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
        for volume in spec.get("volumes", []):
            kinds = set(volume) - {"name"}
            assert kinds <= RESTRICTED_VOLUMES, (name, volume["name"], kinds)
        for c in containers(workload):
            sc = c.get("securityContext", {})
            assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, (name, c["name"])
            assert sc.get("runAsUser", pod.get("runAsUser", 1)) != 0, (name, c["name"])
            seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {}))
            assert seccomp.get("type") in ("RuntimeDefault", "Localhost"), (name, c["name"])
            assert sc.get("allowPrivilegeEscalation") is False and not sc.get("privileged"), (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"] and set(sc["capabilities"].get("add", [])) <= {
                "NET_BIND_SERVICE"}, (name, c["name"])
