"""Prefill and decode apart on Kubernetes (issue #40, ``components/disaggregated``; the gpu-disaggregated
overlay): a prefill pool whose KV transfer server is advertised at the pod's IP on a named port, the
interactive pool decoding, the pool in tollgate.toml beside the model's others, the gateway's threshold,
the decode replicas admitted to the transfer port only, and each pool scaled by KEDA on its own signal
(pending prompt tokens, running sequences) with the interactive pool's behaviour. With tensor
parallelism, prefill and decode replicas split the model alike. The component refuses to render out of
order.

Everything else the overlay renders (schemas, namespace and references, probes, disruption budgets,
spread, GPUs, model fetch, images, adapters) is checked by the other modules, over every overlay.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.manifests import (
    KUBERNETES_VERSION,
    ROOT,
    Manifests,
    argv,
    container,
    kubectl,
    literal_env,
    option,
    pod_labels,
    pod_spec,
    tensor_parallel_size,
)
from tests.deploy.promql import SERVICE_MONITOR_LABELS, check
from tollgate.commands.model import engine as engine_command
from tollgate.settings import Settings

OVERLAY = "gpu-disaggregated"
OVERLAYS = ROOT / "deploy" / "kubernetes" / "overlays"
SCHEMAS = ROOT / "tests" / "deploy" / "schemas"
(ROLES,) = [p.type.choices for p in engine_command.params if p.name == "role"]
(MAX_NUM_BATCHED_TOKENS,) = [p.default for p in engine_command.params if p.name == "max_num_batched_tokens"]
MIN_PROMPT_TOKENS_DEFAULT = Settings.model_fields["disagg_min_prompt_tokens"].default


def _role(engine) -> str:
    words = argv(container(engine, "engine"))
    return option(words, "--role") if "--role" in words else "both"


def _trigger(manifests: Manifests, name: str) -> dict:
    triggers = manifests.get("ScaledObject", name)["spec"]["triggers"]
    (trigger,) = [t for t in triggers if t["type"] == "prometheus"]
    return trigger


@pytest.fixture
def disaggregated(rendered) -> Manifests:
    return rendered[OVERLAY]


def test_only_the_disaggregated_overlay_gives_engines_a_role(manifests):
    roles = {e["metadata"]["name"]: _role(e) for e in manifests.component("engine")}
    assert set(roles.values()) <= set(ROLES)
    if manifests.overlay != OVERLAY:
        assert set(roles.values()) == {"both"}, roles
        assert "prefill" not in manifests.tollgate_toml()["pools"]
        return
    assert roles == {"engine-interactive": "decode", "engine-prefill": "prefill", "engine-batch": "both"}
    words = argv(container(manifests.workload("engine-interactive"), "engine"))
    assert words[:4] == ["tollgate", "engine", "--role", "decode"]


def test_the_prefill_pool_advertises_its_transfer_server_at_the_pods_ip(disaggregated):
    engine = container(disaggregated.workload("engine-prefill"), "engine")
    words = argv(engine)
    assert option(words, "--pool") == "prefill"
    assert option(words, "--kv-transfer-host") == "0.0.0.0"  # the pod's every address
    (port,) = [p for p in engine["ports"] if p["name"] == "kv-transfer"]
    assert option(words, "--kv-transfer-port") == str(port["containerPort"])
    assert port["containerPort"] != 8100
    # Decode replicas connect to the pod that leased the blocks: its own IP, from the downward API.
    variable = option(words, "--kv-transfer-advertise-host")
    assert variable.startswith("$(") and variable.endswith(")")
    (env,) = [e for e in engine["env"] if e["name"] == variable[2:-1]]
    assert env["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_the_prefill_pool_has_the_interactive_pools_shape(disaggregated):
    """Same model, cache, adapters, probes, drain, priority and spread over nodes as the pool it serves."""
    prefill, interactive = (disaggregated.workload(n) for n in ("engine-prefill", "engine-interactive"))
    for field in ("strategy", "minReadySeconds", "progressDeadlineSeconds"):
        assert prefill["spec"][field] == interactive["spec"][field], field
    assert "replicas" not in prefill["spec"]  # KEDA's
    ours, theirs = pod_spec(prefill), pod_spec(interactive)
    for field in ("priorityClassName", "terminationGracePeriodSeconds", "volumes", "initContainers",
                  "nodeSelector", "affinity", "tolerations", "runtimeClassName", "imagePullSecrets"):
        assert ours.get(field) == theirs.get(field), field
    spread = json.loads(json.dumps(theirs["topologySpreadConstraints"]).replace('"interactive"', '"prefill"'))
    assert ours["topologySpreadConstraints"] == spread
    a, b = container(prefill, "engine"), container(interactive, "engine")
    for field in ("image", "resources", "volumeMounts", "startupProbe", "readinessProbe", "livenessProbe",
                  "lifecycle"):
        assert a[field] == b[field], field
    assert literal_env(a) == literal_env(b)  # the downward API's POD_IP aside
    for flag in ("--model", "--model-name", "--device", "--dtype", "--host-kv-gb", "--disk-kv-gb",
                 "--kv-disk-dir", "--max-loras", "--max-lora-rank", "--lora-dir", "--drain-timeout-s"):
        assert option(argv(a), flag) == option(argv(b), flag), flag
    assert pod_labels(prefill)["tollgate/pool"] == "prefill"


def test_the_gateway_prefills_apart_from_its_threshold(disaggregated, rendered):
    config = disaggregated.tollgate_toml()
    (model,) = config["models"]
    assert "prefill" in model["pools"] and "interactive" in model["pools"]
    assert config["pools"]["prefill"] == {"dns": "engine-prefill-headless:8100"}
    gateway = disaggregated.workload("gateway")
    threshold = int(literal_env(container(gateway, "gateway"))["TOLLGATE_DISAGG_MIN_PROMPT_TOKENS"])
    assert threshold >= MIN_PROMPT_TOKENS_DEFAULT  # shorter: a transfer costs more than it saves
    for name, manifests in rendered.items():
        if name != OVERLAY:
            assert "TOLLGATE_DISAGG_MIN_PROMPT_TOKENS" not in literal_env(
                container(manifests.workload("gateway"), "gateway"))


def test_each_pool_scales_on_its_own_signal(disaggregated, rendered, exposed):
    """Prefill on the prompt tokens its replicas still have to compute, against a capacity per replica of
    whole prompts; decode on the sequences it runs; both with the interactive pool's behaviour."""
    namespace = disaggregated.namespace
    prefill = _trigger(disaggregated, "engine-prefill")
    query, _ = check("engine-prefill", prefill["metadata"]["query"], exposed, SERVICE_MONITOR_LABELS)
    assert query.series == {"tollgate_engine_pending_prefill_tokens"}
    assert query.selectors[0][1] == [("namespace", "=", namespace),
                                      ("service", "=", "engine-prefill-headless")]
    assert disaggregated.selected_workloads(
        disaggregated.get("Service", "engine-prefill-headless")["spec"]["selector"]) == ["engine-prefill"]
    gateway = container(disaggregated.workload("gateway"), "gateway")
    min_prompt = int(literal_env(gateway)["TOLLGATE_DISAGG_MIN_PROMPT_TOKENS"])
    capacity = float(prefill["metadata"]["threshold"])
    words = argv(container(disaggregated.workload("engine-prefill"), "engine"))
    step = int(option(words, "--max-num-batched-tokens")) if "--max-num-batched-tokens" in words else (
        MAX_NUM_BATCHED_TOKENS)
    assert min_prompt <= capacity and capacity % step == 0  # whole engine steps, each prompt at least this
    decode = _trigger(disaggregated, "engine-interactive")
    query, _ = check("engine-interactive", decode["metadata"]["query"], exposed, SERVICE_MONITOR_LABELS)
    assert query.series == {"vllm:num_requests_running"}
    assert query.selectors[0][1] == [("namespace", "=", namespace),
                                      ("service", "=", "engine-interactive-headless")]
    colocated = rendered["gpu"].get("ScaledObject", "engine-interactive")["spec"]
    assert decode["metadata"]["threshold"] == _trigger(rendered["gpu"], "engine-interactive")["metadata"][
        "threshold"]
    for name in ("engine-prefill", "engine-interactive"):
        spec = disaggregated.get("ScaledObject", name)["spec"]
        assert spec["advanced"] == colocated["advanced"], name  # the same stabilisation windows and rates
        assert spec["triggers"][0]["metadata"]["serverAddress"] == colocated["triggers"][0]["metadata"][
            "serverAddress"]
        assert spec["minReplicaCount"] >= 1, name  # an empty prefill pool reports nothing to wake it


def _render_with(overlay: str, tmp_path, components: list[str]) -> subprocess.CompletedProcess:
    copy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", copy)
    where = copy / "kubernetes" / "overlays" / overlay
    kustomization = yaml.safe_load((where / "kustomization.yaml").read_text())
    kustomization["components"] = [f"../../components/{c}" for c in components]
    (where / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    binary = kubectl()
    assert binary is not None
    return subprocess.run([binary, "kustomize", str(where)], capture_output=True, text=True, timeout=120)


def _components(overlay: str) -> list[str]:
    kustomization = yaml.safe_load((OVERLAYS / overlay / "kustomization.yaml").read_text())
    return [c.rsplit("/", 1)[1] for c in kustomization["components"]]


def test_with_tensor_parallelism_prefill_and_decode_replicas_split_alike(rendered, tmp_path):
    """gpu-tp with the component (right after keda): every engine, the prefill pool's included, splits the
    model over the overlay's tensor-parallel size with a GPU per rank, and the prefill pool waits as long
    as the others before giving back a replica that loads for twenty minutes."""
    components = _components("gpu-tp")
    components.insert(components.index("keda") + 1, "disaggregated")
    result = _render_with("gpu-tp", tmp_path, components)
    assert result.returncode == 0, result.stderr
    manifests = Manifests("gpu-tp", [d for d in yaml.safe_load_all(result.stdout) if d])
    _validate(manifests)
    values = yaml.safe_load((OVERLAYS / "gpu-tp" / "values.yaml").read_text())["data"]
    size = int(values["tensorParallelSize"])
    assert size > 1
    roles = {}
    for engine in manifests.component("engine"):
        main = container(engine, "engine")
        roles[engine["metadata"]["name"]] = _role(engine)
        assert tensor_parallel_size(argv(main)) == size, engine["metadata"]["name"]
        assert int(main["resources"]["limits"]["nvidia.com/gpu"]) == size, engine["metadata"]["name"]
    assert roles == {"engine-interactive": "decode", "engine-prefill": "prefill", "engine-batch": "both"}
    tp = rendered["gpu-tp"]
    for name in ("engine-prefill", "engine-interactive"):
        spec = manifests.get("ScaledObject", name)["spec"]
        assert spec["advanced"] == tp.get("ScaledObject", "engine-interactive")["spec"]["advanced"], name


def _validate(manifests: Manifests) -> None:
    """Every object against the Kubernetes schemas (strict) or its CRD's schema (tests/deploy/schemas)."""
    crds = {"ScaledObject": "keda-scaledobject.json",
            "TriggerAuthentication": "keda-triggerauthentication.json",
            "ServiceMonitor": "servicemonitor.json", "PrometheusRule": "prometheusrule.json"}
    for obj in manifests.objects:
        if obj["kind"] in crds:
            schema = json.loads((SCHEMAS / crds[obj["kind"]]).read_text())
            jsonschema.validate(obj, schema, cls=jsonschema.Draft202012Validator)
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("first", ["model-source", "gpu", "registry-credentials"])
def test_the_component_refuses_to_render_after_what_fits_out_the_engines(first, rendered, tmp_path):
    """Listed after a component that fits out every engine Deployment, the prefill pool would miss it."""
    del rendered
    components = _components(OVERLAY)
    components.remove(first)
    components.insert(components.index("disaggregated"), first)
    result = _render_with(OVERLAY, tmp_path, components)
    assert result.returncode != 0 and "components/disaggregated" in result.stderr, result.stderr
    assert "testing value /spec/template/spec/" in result.stderr


def test_the_component_refuses_to_render_before_keda(rendered, tmp_path):
    del rendered
    components = _components(OVERLAY)
    components.remove("keda")
    components.insert(components.index("disaggregated") + 1, "keda")
    result = _render_with(OVERLAY, tmp_path, components)
    assert result.returncode != 0 and "ScaledObject.v1alpha1.keda.sh/engine-interactive" in result.stderr


def test_the_guides_way_into_the_external_overlay_renders_and_validates(rendered, tmp_path):
    """docs/deploy-kubernetes.md: add the component right after keda in external (or a copy of it)."""
    del rendered
    components = _components("external")
    components.insert(components.index("keda") + 1, "disaggregated")
    result = _render_with("external", tmp_path, components)
    assert result.returncode == 0, result.stderr
    manifests = Manifests("external", [d for d in yaml.safe_load_all(result.stdout) if d])
    _validate(manifests)
    assert {e["metadata"]["name"]: _role(e) for e in manifests.component("engine")} == {
        "engine-interactive": "decode", "engine-prefill": "prefill", "engine-batch": "both"}
    assert {o["metadata"]["name"] for o in manifests.of_kind("ScaledObject")} == {
        "engine-interactive", "engine-batch", "engine-prefill"}
    prefill = pod_spec(manifests.workload("engine-prefill"))
    assert [c["name"] for c in prefill["initContainers"]] == ["model-fetch"] and prefill["runtimeClassName"]
    guide = (ROOT / "docs" / "deploy-kubernetes.md").read_text()
    assert "  - ../../components/keda\n  - ../../components/disaggregated\n" in guide


def test_what_the_component_adds_is_what_the_guide_deletes_to_leave_it(disaggregated, rendered):
    """Leaving disaggregation: the guide deletes by the prefill pool's label the kinds it names; those
    are exactly the objects the component adds (an apply does not prune them)."""
    added = {(o["kind"], o["metadata"]["name"]) for o in disaggregated.objects} - {
        (o["kind"], o["metadata"]["name"]) for o in rendered["gpu"].objects}
    added = {(kind, name) for kind, name in added if not name.startswith("tollgate-config")}  # its hash
    labelled = {(o["kind"], o["metadata"]["name"]) for o in disaggregated.objects
                if o["metadata"].get("labels", {}).get("tollgate/pool") == "prefill"}
    assert added == labelled
    guide = (ROOT / "docs" / "deploy-kubernetes.md").read_text()
    (kinds,) = re.findall(r"kubectl -n tollgate delete (\S+) -l tollgate/pool=prefill", guide)
    names = {"scaledobject": "ScaledObject", "deploy": "Deployment", "svc": "Service",
             "pdb": "PodDisruptionBudget", "networkpolicy": "NetworkPolicy"}
    assert {names[k] for k in kinds.split(",")} == {kind for kind, _ in added}


def test_a_prefill_replica_down_is_alerted_like_the_others(disaggregated):
    (rules,) = disaggregated.of_kind("PrometheusRule")
    exprs = [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]
             if r.get("alert") == "TollgateEngineReplicaDown"]
    (expr,) = exprs
    (pattern,) = re.findall(r'service=~"([^"]+)"', expr)
    services = {s["metadata"]["name"] for s in disaggregated.of_kind("Service")
                if s["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"}
    assert services == {s for s in services if re.fullmatch(pattern, s)}
    assert "engine-prefill-headless" in services
