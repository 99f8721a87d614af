"""The engine's Prometheus metrics of LoRA adapters: loads and evictions in each tier (host memory, device
slots), load durations as histograms, requests by adapter, adapters resident; read from an engine that
swaps two adapters through one device slot and a one-adapter host LRU."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from engine.llm import LLM
from engine.lora.registry import LoRARequest
from engine.metrics import EngineMetrics
from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams
from tests.engine.test_lora_adapter import peft_bundle

GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def _samples(stats: EngineStats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = EngineMetrics(lambda: stats, "tiny", "interactive").render().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    def extra(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, v) for k, v in labels.items() if k not in ("model", "pool")))

    return {(s.name, extra(s.labels)): s.value for s in samples}


def test_loads_evictions_load_times_and_requests_by_adapter(tiny_llama_dir: Path, tmp_path: Path) -> None:
    a = LoRARequest("support", str(peft_bundle(tiny_llama_dir, tmp_path / "a", seed=1)))
    b = LoRARequest("sales", str(peft_bundle(tiny_llama_dir, tmp_path / "b", seed=2)))
    with LLM(str(tiny_llama_dir), num_kv_blocks=64, max_loras=1, max_cpu_loras=1) as llm:  # type: ignore[arg-type]
        for adapter in (a, b, a, None):  # each one evicts the other from its slot and from the host LRU
            llm.generate([[5, 6, 7]], GREEDY, lora_request=adapter)
        stats = llm.engine.stats()
    got = _samples(stats)

    def tier(name: str, value: str) -> float:
        return got[(name, (("tier", value),))]

    assert tier("tollgate_engine_lora_loads_total", "host") == 3
    assert tier("tollgate_engine_lora_loads_total", "device") == 3
    assert tier("tollgate_engine_lora_evictions_total", "host") == 2
    assert tier("tollgate_engine_lora_evictions_total", "device") == 2
    assert tier("tollgate_engine_lora_resident_adapters", "host") == 1
    assert tier("tollgate_engine_lora_resident_adapters", "device") == 1
    for name in ("host", "device"):  # one observation per load, each in a bucket, none lost
        assert tier("tollgate_engine_lora_load_seconds_count", name) == 3
        assert tier("tollgate_engine_lora_load_seconds_sum", name) > 0
        assert got[("tollgate_engine_lora_load_seconds_bucket", (("le", "+Inf"), ("tier", name)))] == 3
        assert got[("tollgate_engine_lora_load_seconds_bucket", (("le", "0.0005"), ("tier", name)))] <= 3
    assert got[("tollgate_engine_lora_requests_total", (("adapter", "support"),))] == 2
    assert got[("tollgate_engine_lora_requests_total", (("adapter", "sales"),))] == 1


def test_an_engine_without_adapter_slots_exports_no_lora_series(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), num_kv_blocks=64) as llm:  # type: ignore[arg-type]
        llm.generate([[5, 6, 7]], GREEDY)
        stats = llm.engine.stats()
    assert stats.lora is None
    assert not [name for name, _ in _samples(stats) if "lora" in name]
