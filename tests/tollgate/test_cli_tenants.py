"""``tollgate tenants|keys|migrate`` against a database of their own (the commands commit);
``tenants purge-cache`` against a synthetic engine replica and a dead one."""

from __future__ import annotations

import asyncio
import json

import httpx
import psycopg
import pytest
from click.testing import CliRunner

from engine.protocol import GenerateRequest
from gateway.tenants.cache_salt import cache_salt
from gateway.tenants.keys import parse_key
from gateway.tenants.service import ApiKeyService, InvalidApiKey
from tests.gateway.gateway_processes import synthetic_engine
from tollgate.cli import main
from tollgate.db import Database
from tollgate.local_services import free_port
from tollgate.settings import get_settings


@pytest.fixture
def cli(settings, new_database, monkeypatch):
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", new_database)
    get_settings.cache_clear()
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(main, list(args), catch_exceptions=False)

    invoke.url = new_database  # type: ignore[attr-defined]
    yield invoke
    get_settings.cache_clear()


def resolve(key: str):
    async def run():
        settings = get_settings()
        db = Database.from_settings(settings)
        try:
            async with db.session() as session:
                return await ApiKeyService(session, settings).resolve(key)
        finally:
            await db.dispose()

    return asyncio.run(run())


def test_create_tenant_then_key_prints_the_key_last(cli):
    created = cli(
        "tenants",
        "create",
        "acme",
        "--tier",
        "priority",
        "--tpm",
        "90000",
        "--rpm",
        "60",
        "--max-concurrency",
        "4",
        "--batch-tpd",
        "1000000",
        "--monthly-budget-usd",
        "250.50",
    )
    assert created.exit_code == 0, created.output
    assert "'acme'" in created.output and "tpm=90000" in created.output and "$250.50" in created.output

    issued = cli("keys", "create", "acme", "--name", "ci")
    assert issued.exit_code == 0, issued.output
    full_key = issued.output.strip().splitlines()[-1]
    key_id, secret = parse_key(full_key)
    key, tenant = resolve(full_key)
    assert tenant.name == "acme" and tenant.monthly_budget_pico_usd == 250_500_000_000_000
    assert key.prefix == key_id and key.name == "ci"
    with psycopg.connect(cli.url) as conn:
        stored = conn.execute("SELECT key_hash FROM api_keys").fetchall()
        audit = [a for (a,) in conn.execute("SELECT action FROM audit_log ORDER BY id")]
    assert secret not in str(stored) and full_key not in str(stored)
    assert audit == ["tenant.create", "api_key.create"]

    listed = cli("keys", "list", "acme")
    assert key_id in listed.output and secret not in listed.output and "active" in listed.output
    revoked = cli("keys", "revoke", "acme", str(key.id))
    assert revoked.exit_code == 0, revoked.output
    assert "revoked" in cli("keys", "list", "acme").output
    with pytest.raises(InvalidApiKey):
        resolve(full_key)


def test_errors_are_messages_with_non_zero_exit(cli):
    assert cli("tenants", "create", "dup").exit_code == 0
    duplicate = cli("tenants", "create", "dup")
    assert duplicate.exit_code == 1 and "already exists" in duplicate.output
    unknown_tier = cli("tenants", "create", "t2", "--tier", "gold")
    assert unknown_tier.exit_code == 1 and "unknown tier 'gold'" in unknown_tier.output
    bad_budget = cli("tenants", "create", "t3", "--monthly-budget-usd", "lots")
    assert bad_budget.exit_code == 2 and "dollar amount" in bad_budget.output
    no_tenant = cli("keys", "create", "nobody")
    assert no_tenant.exit_code == 1 and "no tenant 'nobody'" in no_tenant.output
    assert "Traceback" not in duplicate.output + unknown_tier.output + no_tenant.output
    # Past the columns' ranges, or digits alone as a name: a message, not the database's traceback.
    for args in (("--tpm", "99999999999999999999"), ("--max-concurrency", "3000000000"),
                 ("--monthly-budget-usd", "1e30")):
        huge = cli("tenants", "create", "t4", *args)
        assert huge.exit_code in (1, 2) and "Traceback" not in huge.output, huge.output
    digits = cli("tenants", "create", "42")
    assert digits.exit_code in (1, 2) and "digits alone" in digits.output


def test_suspend_and_resume(cli):
    cli("tenants", "create", "sleepy")
    suspended = cli("tenants", "suspend", "sleepy", "--reason", "billing")
    assert suspended.exit_code == 0 and "suspended (billing)" in suspended.output
    refused = cli("tenants", "resume", "sleepy")
    assert refused.exit_code == 1 and "suspended for billing" in refused.output
    # An admin suspension over it would let a plain resume lift the billing one: refused, nothing changes.
    hidden = cli("tenants", "suspend", "sleepy")
    assert hidden.exit_code == 1 and "suspended for billing" in hidden.output, hidden.output
    assert "Traceback" not in hidden.output
    assert cli("tenants", "resume", "sleepy").exit_code == 1
    resumed = cli("tenants", "resume", "sleepy", "--force")
    assert resumed.exit_code == 0 and "status=active" in resumed.output
    assert "sleepy" in cli("tenants", "list").output


def test_purge_cache_reports_every_replica_and_fails_when_one_was_missed(cli, monkeypatch, tmp_path):
    assert cli("tenants", "create", "leaving").exit_code == 0
    with psycopg.connect(cli.url) as conn:
        (tenant_id,) = conn.execute("SELECT id FROM tenants WHERE name = 'leaving'").fetchone()
    with synthetic_engine(tmp_path / "engine.log") as engine:
        dead = f"http://127.0.0.1:{free_port()}"
        monkeypatch.setenv("TOLLGATE_POOLS", json.dumps({"interactive": {"replicas": [engine.url]},
                                                         "batch": {"replicas": [dead]}}))
        get_settings.cache_clear()
        salt = cache_salt(get_settings().key_hash_secret.get_secret_value(), tenant_id)
        request = GenerateRequest(request_id="seed", prompt_token_ids=list(range(1, 41)), max_tokens=1,
                                  cache_salt=salt)
        seeded = httpx.post(f"{engine.url}/generate", json=request.model_dump(), timeout=30.0)
        assert seeded.status_code == 200, seeded.text

        missed = cli("tenants", "purge-cache", "leaving", "--note", "erasure #7")
        assert missed.exit_code == 1, missed.output
        lines = missed.output.splitlines()
        assert lines[0] == f"{engine.url}\t2 blocks purged"  # the two full blocks of 40 prompt tokens
        assert lines[1].startswith(f"{dead}\tNOT purged: ")
        assert f"tenant {tenant_id}: 2 blocks purged on 1 of 2 replicas" in missed.output
        assert "1 replica(s) not purged" in missed.output and "Traceback" not in missed.output

        monkeypatch.setenv("TOLLGATE_POOLS", json.dumps({"interactive": {"replicas": [engine.url]}}))
        get_settings.cache_clear()
        again = cli("tenants", "purge-cache", str(tenant_id))
        assert again.exit_code == 0, again.output
        assert again.output.splitlines() == [f"{engine.url}\t0 blocks purged",
                                             f"tenant {tenant_id}: 0 blocks purged on 1 of 1 replicas"]
    with psycopg.connect(cli.url) as conn:
        audit = conn.execute("SELECT actor, details FROM audit_log WHERE action = 'tenant.purge_cache' "
                             "ORDER BY id").fetchall()
    assert [details["purged_blocks"] for _, details in audit] == [2, 0]
    assert audit[0][0].startswith("cli") and audit[0][1]["note"] == "erasure #7"
    assert set(audit[0][1]["failed"]) == {dead} and audit[1][1]["failed"] is None
    assert cli("tenants", "purge-cache", "nobody").exit_code == 1


def test_migrate_is_idempotent_and_needs_a_database_url(cli, monkeypatch):
    assert cli("migrate").exit_code == 0
    monkeypatch.delenv("TOLLGATE_DATABASE_URL")
    get_settings.cache_clear()
    result = cli("migrate")
    assert result.exit_code == 1 and "TOLLGATE_DATABASE_URL is not set" in result.output
