"""Engine pools that roll, and lose a node, without an outage, in every overlay: a new replica loads its
model while the old ones serve (a Deployment that surges one and stops none before its replacement is
ready), two interactive replicas at least where GPUs serve, spread over nodes, a disruption budget that a
broken replica cannot block, and the disk tier on node-local ephemeral storage (a cache: nothing pins a
replica to a node or a zone, so a lost node's replicas are replaced elsewhere at once).

The grace period that covers the engine's drain: ``test_kubernetes.py``.
"""

from __future__ import annotations

from tests.deploy.manifests import (
    GPU_OVERLAYS,
    argv,
    option,
    pod_labels,
    pod_spec,
    quantity_gib,
    tensor_parallel_size,
)
from tollgate.settings import Settings

DISCOVERY_S = Settings.model_fields["replica_discovery_interval_s"].default


def _startup_allowance_s(engine) -> float:
    probe = pod_spec(engine)["containers"][0]["startupProbe"]
    return probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]


def test_a_rollout_starts_each_new_replica_before_it_stops_an_old_one(manifests):
    for engine in manifests.component("engine"):
        name = f"{manifests.overlay}: {engine['metadata']['name']}"
        # Not a StatefulSet: it cannot surge, and it never replaces a pod whose node is lost until
        # someone deletes that pod.
        assert engine["kind"] == "Deployment", name
        spec = engine["spec"]
        assert spec["strategy"] == {"type": "RollingUpdate",
                                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}, name
        # Old replicas stop only once the new one is in every gateway's routing (they re-resolve the pool).
        assert spec["minReadySeconds"] > DISCOVERY_S, name
        # A model load is progress: the rollout is reported stuck only once it outlasts the startup probe.
        assert spec["progressDeadlineSeconds"] > _startup_allowance_s(engine) + spec["minReadySeconds"], name


def test_the_interactive_pool_keeps_two_replicas_where_gpus_serve(manifests):
    engine = manifests.workload("engine-interactive")
    scaled = [s for s in manifests.of_kind("ScaledObject")
              if s["spec"]["scaleTargetRef"]["name"] == "engine-interactive"]
    if scaled:
        assert "replicas" not in engine["spec"]
        least = scaled[0]["spec"]["minReplicaCount"]
    else:
        least = engine["spec"]["replicas"]
    # Two: one may be rolling or lost with its node while the other serves. The minimal overlay (a
    # laptop's one-node cluster) runs one; its rollouts still surge.
    assert least >= (2 if manifests.overlay in GPU_OVERLAYS else 1), manifests.overlay


def test_a_pools_replicas_spread_over_nodes(manifests):
    for engine in manifests.component("engine"):
        name = f"{manifests.overlay}: {engine['metadata']['name']}"
        constraints = pod_spec(engine).get("topologySpreadConstraints", [])
        (by_node,) = [c for c in constraints if c["topologyKey"] == "kubernetes.io/hostname"]
        assert by_node["maxSkew"] == 1 and by_node["whenUnsatisfiable"] == "DoNotSchedule", name
        # Only nodes the pod could run on are counted (a GPU-less or tainted node is no domain).
        assert by_node.get("nodeTaintsPolicy") == "Honor", name
        assert by_node.get("nodeAffinityPolicy", "Honor") == "Honor", name
        for constraint in constraints:
            # The pool's own replicas, of one revision: a rollout's new replicas spread among themselves.
            assert manifests.selected_workloads(constraint["labelSelector"]) == [engine["metadata"]["name"]]
            assert "pod-template-hash" in constraint.get("matchLabelKeys", []), name
        assert not pod_spec(engine).get("affinity", {}).get("podAffinity"), name


def test_the_disk_tier_is_a_cache_on_node_local_storage(manifests):
    for engine in manifests.component("engine"):
        name = f"{manifests.overlay}: {engine['metadata']['name']}"
        spec = pod_spec(engine)
        main = spec["containers"][0]
        words = argv(main)
        assert "volumeClaimTemplates" not in engine["spec"], name
        mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
        (kv,) = [v for v in spec["volumes"] if mounts.get(v["name"]) == option(words, "--kv-disk-dir")]
        assert set(kv) == {"name", "emptyDir"} and kv["emptyDir"].get("medium", "") == "", name  # on disk
        limit_gib = quantity_gib(kv["emptyDir"]["sizeLimit"])
        # The engine's "GB" are GiB, and every rank of a tensor-parallel replica writes that much. Past
        # the sizeLimit the kubelet evicts the pod: the tier stays below it.
        on_disk_gib = tensor_parallel_size(words) * float(option(words, "--disk-kv-gb"))
        assert 0 < on_disk_gib < limit_gib, name
        # Scheduled where that much local disk is free.
        assert quantity_gib(main["resources"]["requests"]["ephemeral-storage"]) >= limit_gib, name
        # The claims an engine mounts (the checkpoints, the adapter store) are ones every replica can
        # mount wherever it runs: shared read-only volumes, or the node's model cache (a host directory
        # that every node has, so the claim pins no replica to a node). The minimal overlay's one node
        # makes do with ReadWriteOnce (what kind's and minikube's default storage offers).
        shared = ["ReadWriteOnce"] if manifests.overlay == "minimal" else ["ReadWriteMany"]
        for volume in [v for v in spec["volumes"] if "persistentVolumeClaim" in v]:
            source = volume["persistentVolumeClaim"]
            claim = manifests.get("PersistentVolumeClaim", source["claimName"])["spec"]
            assert claim["accessModes"] in (["ReadWriteMany"], shared), name
            if claim.get("volumeName"):
                pv = manifests.get("PersistentVolume", claim["volumeName"])["spec"]
                assert "hostPath" in pv and "nodeAffinity" not in pv, name
            else:
                assert source.get("readOnly"), name


def test_a_broken_replica_never_blocks_a_node_drain(manifests):
    for engine in manifests.component("engine"):
        (pdb,) = [p for p in manifests.of_kind("PodDisruptionBudget")
                  if manifests.selected_workloads(p["spec"]["selector"]) == [engine["metadata"]["name"]]]
        assert pdb["spec"]["maxUnavailable"] == 1
        # A replica that is not ready (loading, crash-looping) serves nothing: evicting it costs nothing.
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        assert pod_labels(engine)["tollgate/pool"] in pdb["metadata"]["name"]
