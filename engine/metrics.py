"""Prometheus metrics of one engine replica, in a registry of its own (never the process-global one, so
several engines or test apps in one process do not collide).

Latency histograms are observed once per finished request (seconds). Gauges and counters are read at
scrape time from the latest ``EngineStats`` snapshot, so the engine thread never blocks on a scrape and
a counter can never go backwards (the engine's counters are monotonic).

Beside Tollgate's own names, the gauges that operators' autoscalers and dashboards already know from
vLLM, where the meaning is the same, labelled as vLLM labels them (``model_name``):
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc`` (the
fraction of KV blocks held, 0..1, despite the name). A KEDA trigger or a dashboard written for a vLLM
fleet reads a Tollgate fleet unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.lora.stats import LoRAStats
from engine.outputs import EngineStats, Timings

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1.0,
                    1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.5, 1.0)


class _StatsCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats], labels: dict[str, str]) -> None:
        self._snapshot = snapshot
        self._labels = labels
        self._vllm_labels = {"model_name": labels["model"]}

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("tollgate_engine_requests_running", "Sequences running (holding KV blocks).",
                    s.num_running)
        yield gauge("tollgate_engine_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("tollgate_engine_kv_cache_usage", "Fraction of KV blocks held by live sequences.",
                    s.kv_usage)
        yield gauge("tollgate_engine_kv_blocks", "KV cache blocks in the pool.", s.num_kv_blocks)
        yield gauge("tollgate_engine_pending_prefill_tokens", "Prompt tokens still to compute.",
                    s.pending_prefill_tokens)
        by_priority = GaugeMetricFamily("tollgate_engine_pending_prefill_tokens_by_priority",
                                        "Prompt tokens still to compute, by engine priority.",
                                        labels=[*names, "priority"])
        for priority, tokens in sorted(s.pending_prefill_tokens_by_priority.items()):
            by_priority.add_metric([*values, str(priority)], tokens)
        yield by_priority
        yield counter("tollgate_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_query_tokens)
        yield counter("tollgate_engine_prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      s.prefix_hit_tokens)
        yield from _labelled(CounterMetricFamily, "tollgate_engine_prefix_cache_hits_by_tier",
                             "Prompt tokens served from the prefix cache, by the tier that held them.",
                             names, values, "tier", s.prefix_hit_tokens_by_tier)
        yield from _labelled(GaugeMetricFamily, "tollgate_engine_kv_tier_blocks",
                             "Prefix-cache blocks held in the host and disk tiers.", names, values, "tier",
                             s.kv_tier_blocks)
        yield from _labelled(GaugeMetricFamily, "tollgate_engine_kv_tier_capacity_blocks",
                             "Capacity of the host and disk tiers, in blocks.", names, values, "tier",
                             s.kv_tier_capacity)
        moves = {kind.removesuffix("_blocks"): n for kind, n in s.kv_tier_moves.items()}
        yield from _labelled(CounterMetricFamily, "tollgate_engine_kv_tier_moved_blocks",
                             "Blocks moved between tiers (offloaded, persisted, demoted, loaded, disk_read) "
                             "or dropped (host_evicted, disk_evicted).", names, values, "kind", moves)
        yield from _labelled(CounterMetricFamily, "tollgate_engine_kv_tier_moved_bytes",
                             "Bytes copied between tiers, by kind of move.", names, values, "kind",
                             {k: n * s.kv_block_bytes for k, n in moves.items() if "evicted" not in k})
        transfer = s.kv_transfer  # disaggregated serving (``engine.kv.connector``): empty in role both
        yield from _labelled(CounterMetricFamily, "tollgate_engine_kv_transfer_events",
                             "Disaggregated serving: pulls started, blocks pulled, pulls failed (decode); "
                             "leases taken, delivered, expired, pulls refused (prefill).", names, values,
                             "kind", {k: n for k, n in transfer.items() if k in _TRANSFER_COUNTERS})
        yield from _labelled(GaugeMetricFamily, "tollgate_engine_kv_transfer_held",
                             "Disaggregated serving now: active leases and the blocks they hold (prefill), "
                             "pulls in flight (decode).", names, values, "kind",
                             {k: n for k, n in transfer.items() if k not in _TRANSFER_COUNTERS})
        yield counter("tollgate_engine_preemptions", "Sequences preempted (by recompute).", s.num_preemptions)
        yield counter("tollgate_engine_fairness_preemptions", "Of the preemptions, those that gave a tenant "
                      "under its fair share of running slots a slot (also in preemptions).",
                      s.num_fairness_preemptions)
        yield counter("tollgate_engine_prompt_tokens", "Prompt tokens of accepted requests.", s.prompt_tokens)
        yield counter("tollgate_engine_generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("tollgate_engine_computed_prefill_tokens", "Prompt tokens computed (incl. recompute).",
                      s.computed_prefill_tokens)
        yield counter("tollgate_engine_steps", "Engine steps run.", s.num_steps)
        yield counter("tollgate_engine_spec_draft_tokens", "Draft tokens verified (speculative decoding).",
                      s.speculation.get("drafted_tokens", 0))
        yield counter("tollgate_engine_spec_accepted_tokens", "Draft tokens accepted (speculative decoding).",
                      s.speculation.get("accepted_tokens", 0))
        if s.lora is not None:
            yield from _lora(s.lora, names, values)
        yield from self._vllm(s)
        finished = CounterMetricFamily("tollgate_engine_sequences_finished",
                                       "Finished sequences by finish reason.", labels=[*names, "reason"])
        for reason, count in sorted(s.num_requests_finished.items()):
            finished.add_metric([*values, reason], count)
        yield finished


    def _vllm(self, s: EngineStats) -> Iterator[Metric]:
        """The same figures under vLLM's names and label."""
        names, values = list(self._vllm_labels), list(self._vllm_labels.values())
        for name, doc, value in (
                ("vllm:num_requests_waiting", "Sequences queued, not yet scheduled.", s.num_waiting),
                ("vllm:num_requests_running", "Sequences running (holding KV blocks).", s.num_running),
                ("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by live sequences (0..1).",
                 s.kv_usage)):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            yield g


_TRANSFER_COUNTERS = frozenset({"pulls", "pulled_blocks", "failed_pulls", "leases", "delivered_leases",
                                "expired_leases", "refused_pulls"})


def _lora(s: LoRAStats, names: list[str], values: list[str]) -> Iterator[Metric]:
    """LoRA adapters (``engine.lora.stats``), by tier (``host``: bundles read into host memory,
    ``device``: adapters copied into device slots), and requests by adapter."""
    yield from _labelled(CounterMetricFamily, "tollgate_engine_lora_loads",
                         "LoRA adapters loaded: bundles read into host memory, copies into device slots.",
                         names, values, "tier", s.loads)
    yield from _labelled(CounterMetricFamily, "tollgate_engine_lora_evictions",
                         "LoRA adapters evicted to make room: from the host LRU, from device slots.",
                         names, values, "tier", s.evictions)
    yield from _labelled(GaugeMetricFamily, "tollgate_engine_lora_resident_adapters",
                         "LoRA adapters held in host memory and in device slots.", names, values, "tier",
                         s.resident)
    seconds = HistogramMetricFamily("tollgate_engine_lora_load_seconds",
                                    "Time to load a LoRA adapter: read and check a bundle (host), copy it "
                                    "into a device slot (device).", labels=[*names, "tier"])
    for tier, histogram in sorted(s.load_seconds.items()):
        buckets = [(floatToGoString(bound), count) for bound, count in histogram.buckets]
        seconds.add_metric([*values, tier], buckets, histogram.sum)
    yield seconds
    yield from _labelled(CounterMetricFamily, "tollgate_engine_lora_requests",
                         "Requests accepted, by the LoRA adapter they named.", names, values, "adapter",
                         s.requests)


def _labelled(family: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, doc: str,
              names: list[str], values: list[str], label: str, by: dict[str, int]) -> Iterator[Metric]:
    """One metric with an extra label, a sample per key of ``by`` (nothing when ``by`` is empty)."""
    if not by:
        return
    metric = family(name, doc, labels=[*names, label])
    for key, value in sorted(by.items()):
        metric.add_metric([*values, key], value)
    yield metric


class EngineMetrics:
    """The replica's registry: latency histograms plus a collector over the latest stats snapshot."""

    def __init__(self, snapshot: Callable[[], EngineStats], model: str, pool: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model": model, "pool": pool}
        label_names = list(labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label_names, buckets=buckets, registry=self.registry).labels(**labels)

        self.ttft = histogram("tollgate_engine_time_to_first_token_seconds",
                              "Time from acceptance to the first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("tollgate_engine_time_per_output_token_seconds",
                              "Mean time per output token after the first.", _TPOT_BUCKETS)
        self.queue_time = histogram("tollgate_engine_queue_time_seconds",
                                    "Time from acceptance to first being scheduled.", _LATENCY_BUCKETS)
        self.e2e = histogram("tollgate_engine_e2e_request_latency_seconds",
                             "Time from acceptance to the last token.", _LATENCY_BUCKETS)
        self.registry.register(_StatsCollector(snapshot, labels))

    def observe_finished(self, timings: Timings, num_output_tokens: int) -> None:
        if num_output_tokens > 0:
            self.ttft.observe(timings.ttft)
        if num_output_tokens > 1:
            self.tpot.observe(timings.tpot)
        self.queue_time.observe(timings.queued)
        self.e2e.observe(timings.e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
