"""The Kubernetes deployment's scaling and hardware: the gateway's HPA on CPU, KEDA on each engine
pool's queue depth (the batch pool down to zero and back), disruption budgets, GPUs only where the
overlay asks for them (one per tensor-parallel rank, with the shared and host memory the ranks need),
the scrape configuration KEDA's queries rely on, and where Postgres and Redis live (bundled, or external
from Secrets)."""

from __future__ import annotations

import re

from tests.deploy.manifests import (
    GPU_OVERLAYS,
    argv,
    containers,
    option,
    pod_labels,
    pod_spec,
    quantity_gib,
    selects,
    tensor_parallel_size,
)
from tollgate.commands.model import engine as engine_command
from tollgate.settings import Settings

(MAX_NUM_SEQS,) = [p.default for p in engine_command.params if p.name == "max_num_seqs"]
TENSOR_PARALLEL_OVERLAYS = {"gpu-tp"}
BUNDLED_OVERLAYS = {"minimal", "gpu", "gpu-tp", "gpu-disaggregated"}
APP = ("beat", "gateway", "worker")
ENGINE_POOLS = {"engine-interactive": "interactive", "engine-batch": "batch"}


def test_the_gateway_scales_on_cpu(manifests):
    (hpa,) = manifests.of_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    gateway = manifests.workload("gateway")
    assert "replicas" not in gateway["spec"]  # re-applying must not undo the HPA
    assert pod_spec(gateway)["containers"][0]["resources"]["requests"]["cpu"]  # utilisation needs a request


def test_disruption_budgets_cover_the_gateway_and_every_engine_pool(manifests):
    covered = {}
    for pdb in manifests.of_kind("PodDisruptionBudget"):
        assert pdb["spec"].get("maxUnavailable") == 1  # a drain proceeds, one pod at a time
        for name in manifests.selected_workloads(pdb["spec"]["selector"]):
            covered[name] = pdb["metadata"]["name"]
    assert {"gateway", *ENGINE_POOLS} <= set(covered)


def test_gpus_only_where_the_overlay_asks_for_them(manifests):
    gpu = manifests.overlay in GPU_OVERLAYS
    for workload in manifests.workloads():
        is_engine = pod_labels(workload).get("app.kubernetes.io/component") == "engine"
        spec = pod_spec(workload)
        gpus = tensor_parallel_size(argv(spec["containers"][0]))  # one GPU per rank
        for c in containers(workload):
            resources = c.get("resources", {})
            wanted = {"nvidia.com/gpu": gpus} if gpu and is_engine and c["name"] == "engine" else {}
            for kind in ("requests", "limits"):
                got = {k: int(v) for k, v in resources.get(kind, {}).items() if k.startswith("nvidia.com/")}
                where = f"{manifests.overlay}: {workload['metadata']['name']}/{c['name']} {kind}"
                assert got == wanted, where
        if is_engine:
            words = argv(spec["containers"][0])
            assert option(words, "--device") == ("cuda" if gpu else "cpu")
            assert option(words, "--dtype") == ("bfloat16" if gpu else "float32")
            tolerations = spec.get("tolerations", [])
            assert bool(spec.get("nodeSelector")) == gpu
            tolerated = any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in tolerations)
            assert tolerated == gpu
        elif workload["metadata"]["name"] == "model-prefetch":  # the engines' nodes, without a GPU
            engine = pod_spec(manifests.workload("engine-interactive"))
            for field in ("nodeSelector", "tolerations", "affinity"):
                assert spec.get(field) == engine.get(field), field
        else:
            assert not spec.get("nodeSelector") and not spec.get("tolerations")


def test_the_tensor_parallel_overlay_splits_each_replica_over_its_gpus(manifests):
    for name in ENGINE_POOLS:
        main = pod_spec(manifests.workload(name))["containers"][0]
        size = tensor_parallel_size(argv(main))
        if manifests.overlay not in TENSOR_PARALLEL_OVERLAYS:
            assert size == 1, f"{manifests.overlay}: {name}"
            continue
        assert size in (4, 8), name  # a 70B model in bfloat16 (140 GB) over H100s of 80 GB
        assert main["args"] == ["--tensor-parallel-size", str(size)]  # after the command's own flags
        for kind in ("requests", "limits"):
            assert int(main["resources"][kind]["nvidia.com/gpu"]) == size, f"{name} {kind}"


def test_tensor_parallel_ranks_get_shared_memory_host_memory_and_time_to_load(manifests):
    for engine in manifests.component("engine"):
        spec = pod_spec(engine)
        main = spec["containers"][0]
        words = argv(main)
        size = tensor_parallel_size(words)
        if size == 1:
            continue
        name = f"{manifests.overlay}: {engine['metadata']['name']}"
        # NCCL between the ranks needs more /dev/shm than the runtime's 64 MB: a memory-backed emptyDir.
        (shm,) = [m["name"] for m in main["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == shm]
        assert volume["emptyDir"]["medium"] == "Memory", name
        shm_gib = quantity_gib(volume["emptyDir"]["sizeLimit"])
        assert shm_gib >= 1, name
        # Every rank pins its own host tier (--host-kv-gb is per rank, in GiB); /dev/shm is pod memory.
        pinned_gib = size * float(option(words, "--host-kv-gb"))
        assert pinned_gib + shm_gib < quantity_gib(main["resources"]["requests"]["memory"]), name
        assert quantity_gib(main["resources"]["limits"]["memory"]) >= quantity_gib(
            main["resources"]["requests"]["memory"]), name
        startup = main["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 900, name  # 140 GB to load


DEMAND = re.compile(r'sum\(\{namespace="([^"]+)",service="([^"]+)",'
                    r'__name__=~"vllm:num_requests_\(waiting\|running\)"\}\)')


def _disaggregated(manifests) -> bool:
    """Whether the overlay runs prefill and decode apart (components/disaggregated)."""
    return manifests.has("Deployment", "engine-prefill")


def _scaled(manifests) -> dict[str, dict]:
    return {s["spec"]["scaleTargetRef"]["name"]: s for s in manifests.of_kind("ScaledObject")}


def _startup_allowance_s(engine) -> float:
    probe = pod_spec(engine)["containers"][0]["startupProbe"]
    return probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]


def test_keda_scales_each_engine_pool_on_demand_against_capacity(manifests, exposed):
    """Demand is what the pool holds, waiting and running; capacity is a share of the sequences a replica
    runs at once (--max-num-seqs): KEDA asks for ceil(demand / threshold) replicas."""
    scaled = _scaled(manifests)
    if manifests.overlay not in GPU_OVERLAYS:
        assert scaled == {} and manifests.of_kind("TriggerAuthentication") == []
        return
    disaggregated = _disaggregated(manifests)
    assert set(scaled) == set(ENGINE_POOLS) | ({"engine-prefill"} if disaggregated else set())
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running"} <= set(exposed.labels)  # the engine's
    for name, pool in ENGINE_POOLS.items():
        if name == "engine-interactive" and disaggregated:
            continue  # decode: its running sequences (test_kubernetes_disaggregated.py)
        spec = scaled[name]["spec"]
        target = manifests.get("Deployment", name)
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert "replicas" not in target["spec"]  # re-applying must not undo KEDA
        assert spec["minReplicaCount"] < spec["maxReplicaCount"]
        (demand,) = [t for t in spec["triggers"] if t["type"] == "prometheus"]
        match = DEMAND.fullmatch(demand["metadata"]["query"])
        assert match, demand["metadata"]["query"]
        namespace, service = match.groups()
        assert namespace == manifests.namespace
        assert manifests.selected_workloads(manifests.get("Service", service)["spec"]["selector"]) == [name]
        assert pool in service
        words = argv(pod_spec(target)["containers"][0])
        capacity = int(option(words, "--max-num-seqs")) if "--max-num-seqs" in words else MAX_NUM_SEQS
        threshold = float(demand["metadata"]["threshold"])
        assert 0 < threshold <= capacity, name
    # Interactive: room is added before a replica's batch is full (time to first token stays low).
    (demand,) = [t for t in scaled["engine-interactive"]["spec"]["triggers"] if t["type"] == "prometheus"]
    assert float(demand["metadata"]["threshold"]) < MAX_NUM_SEQS
    # Two at least: a rollout or a node's loss never leaves the interactive pool without a ready replica.
    assert scaled["engine-interactive"]["spec"]["minReplicaCount"] >= 2


def test_scaling_is_sized_to_model_loads(manifests):
    """A new replica serves only after its model load (up to the startup probe's allowance): scale-up
    waits for demand that lasts, without waiting as long as a load; scale-down gives a replica back only
    after lower demand has lasted as long as getting it back would take."""
    for name, scaled in _scaled(manifests).items():
        spec = scaled["spec"]
        load_s = _startup_allowance_s(manifests.get("Deployment", name))
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        up, down = behavior["scaleUp"], behavior["scaleDown"]
        where = f"{manifests.overlay}: {name}"
        assert 0 < up["stabilizationWindowSeconds"] < load_s, where
        assert down["stabilizationWindowSeconds"] >= load_s, where
        assert all(p["type"] == "Pods" and p["value"] >= 1 for p in up["policies"]), where
        assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": down["policies"][0][
            "periodSeconds"]}], where  # one replica at a time
        if spec["minReplicaCount"] == 0:  # the last replica goes only after as long too
            assert spec["cooldownPeriod"] >= load_s, where


def test_a_removed_replica_lets_its_streams_finish(manifests):
    """Scale-down, a rollout or a node drain stops an engine with SIGTERM: it drains for its
    --drain-timeout-s, which is at least the gateway's request timeout, so no stream is cut that the
    gateway would not have timed out; the grace period covers it (test_kubernetes.py)."""
    request_timeout_s = manifests.tollgate_toml().get(
        "request_timeout_s", Settings.model_fields["request_timeout_s"].default)
    for engine in manifests.component("engine"):
        words = argv(pod_spec(engine)["containers"][0])
        assert float(option(words, "--drain-timeout-s")) >= request_timeout_s, engine["metadata"]["name"]


def test_the_batch_pool_scales_to_zero_and_wakes_on_its_backlog(manifests):
    if manifests.overlay not in GPU_OVERLAYS:
        return
    spec = manifests.get("ScaledObject", "engine-batch")["spec"]
    assert spec["minReplicaCount"] == 0
    # At zero replicas no engine reports a queue: the backlog in Postgres must wake the pool.
    (backlog,) = [t for t in spec["triggers"] if t["type"] == "postgresql"]
    assert "batch_items" in backlog["metadata"]["query"]
    assert float(backlog["metadata"]["activationTargetQueryValue"]) == 0
    auth = manifests.get("TriggerAuthentication", backlog["authenticationRef"]["name"])
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "connection", "name": "tollgate-datastores", "key": "TOLLGATE_DATABASE_URL"}]


def test_prometheus_scrapes_what_keda_queries(manifests):
    monitors = {m["metadata"]["name"]: m for m in manifests.of_kind("ServiceMonitor")}
    if manifests.overlay not in GPU_OVERLAYS:
        assert monitors == {}
        return
    services = manifests.of_kind("Service")
    scraped = {s["metadata"]["name"]: m["spec"]["endpoints"] for m in monitors.values() for s in services
               if selects(m["spec"]["selector"], s["metadata"]["labels"])}
    engines = {"engine-interactive-headless", "engine-batch-headless"}
    if _disaggregated(manifests):
        engines.add("engine-prefill-headless")
    assert set(scraped) == {"gateway", *engines}
    for name, endpoints in scraped.items():
        (endpoint,) = endpoints
        assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
        service = manifests.get("Service", name)
        assert "http" in [p["name"] for p in service["spec"]["ports"]]
    (gateway,) = scraped["gateway"]
    assert gateway["authorization"] == {
        "type": "Bearer", "credentials": {"name": "tollgate-secrets", "key": "TOLLGATE_METRICS_TOKEN"}}


def test_postgres_and_redis_are_bundled_or_external(manifests):
    bundled = manifests.overlay in BUNDLED_OVERLAYS
    for name in ("postgres", "redis"):
        assert manifests.has("StatefulSet", name) == bundled
    for name in ("gateway", "worker", "beat"):
        for c in containers(manifests.workload(name)):
            if c["name"] in (name, "migrate"):  # URLs from the Secret only, never in the manifests
                assert {"secretRef": {"name": "tollgate-datastores"}} in c["envFrom"]
    if bundled:
        for name, port in (("postgres", 5432), ("redis", 6379)):
            policy = manifests.get("NetworkPolicy", f"{name}-from-tollgate")
            assert manifests.selected_workloads(policy["spec"]["podSelector"]) == [name]
            (rule,) = policy["spec"]["ingress"]
            assert [p["port"] for p in rule["ports"]] == [port]
            pods = [peer for peer in rule["from"] if "podSelector" in peer]
            assert [manifests.selected_workloads(p["podSelector"]) for p in pods] == [list(APP)]
