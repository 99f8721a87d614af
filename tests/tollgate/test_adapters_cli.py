"""``tollgate adapters create|list|delete`` against a database of its own and a real engine replica
that serves adapters from the store the command writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.engine.test_lora_serving import strong_bundle
from tests.gateway.conftest import run_engine
from tollgate.cli import main
from tollgate.settings import get_settings


@pytest.fixture
def cli(settings, new_database, monkeypatch, tmp_path):
    from engine.tiny import create_tiny_checkpoint

    model_dir = create_tiny_checkpoint(tmp_path / "tiny", arch="llama", seed=0)
    store = tmp_path / "adapters"
    options = ("--num-kv-blocks", "64", "--max-loras", "1", "--max-lora-rank", "8", "--lora-dir", str(store))
    with run_engine(model_dir, tmp_path / "engine.log", options=options) as (url, _):
        monkeypatch.setenv("TOLLGATE_DATABASE_URL", new_database)
        monkeypatch.setenv("TOLLGATE_MODELS", json.dumps([{"name": "tiny", "path": str(model_dir)}]))
        monkeypatch.setenv("TOLLGATE_POOLS", json.dumps({"interactive": {"replicas": [url]}}))
        monkeypatch.setenv("TOLLGATE_ADAPTER_DIR", str(store))
        monkeypatch.delenv("TOLLGATE_REDIS_URL", raising=False)
        get_settings.cache_clear()
        runner = CliRunner()

        def invoke(*args: str):
            return runner.invoke(main, list(args), catch_exceptions=False)

        invoke.model_dir = model_dir  # type: ignore[attr-defined]
        invoke.store = store  # type: ignore[attr-defined]
        yield invoke
    get_settings.cache_clear()


def test_an_adapter_is_created_listed_and_deleted_from_the_command_line(cli, tmp_path: Path) -> None:
    assert cli("tenants", "create", "Globex Corp").exit_code == 0
    bundle = strong_bundle(cli.model_dir, tmp_path / "bundle", 1, ["q_proj", "v_proj"], 4)
    created = cli("adapters", "create", "Globex Corp", "support-v2", str(bundle), "--base", "tiny")
    assert created.exit_code == 0, created.output
    model = created.output.splitlines()[-1]
    assert model.startswith("ft:tiny:globex-corp:support-v2:")
    assert (cli.store / model.rsplit(":", 1)[1] / "adapter_model.safetensors").is_file()
    listed = cli("adapters", "list", "Globex Corp")
    assert listed.output.startswith(f"{model}  base=tiny rank=4 targets=q_proj,v_proj")

    again = cli("adapters", "create", "Globex Corp", "support-v2", str(bundle), "--base", "tiny")
    assert again.exit_code == 1 and "already exists" in again.output
    too_big = strong_bundle(cli.model_dir, tmp_path / "r16", 2, ["q_proj"], 16)
    refused = cli("adapters", "create", "Globex Corp", "wide", str(too_big), "--base", "tiny")
    assert refused.exit_code == 1 and "r must be an integer in [1, 8]" in refused.output
    assert sorted(p.name for p in cli.store.iterdir()) == [model.rsplit(":", 1)[1]]

    deleted = cli("adapters", "delete", "Globex Corp", model)
    assert deleted.exit_code == 0 and deleted.output.strip() == f"deleted {model}"
    assert not list(cli.store.iterdir())
    assert cli("adapters", "list", "Globex Corp").output == ""
    assert cli("adapters", "delete", "Globex Corp", model).exit_code == 1
    assert "no tenant" in cli("adapters", "list", "Initech").output
