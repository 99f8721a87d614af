"""Tenants' LoRA adapters as models, through a gateway and a real engine replica serving adapters from the
store the gateway writes: registration from an uploaded bundle (and the 400s of bundles that do not fit),
listing, serving, pricing, isolation between tenants, deletion, and the prefix cache across a deletion
and a new registration under the same name."""

from __future__ import annotations

import io
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from engine.kv.block_hash import adapter_cache_salt, prefix_block_hashes
from gateway.tenants.cache_salt import cache_salt
from tests.engine.test_lora_serving import strong_bundle
from tests.factories import create_price
from tests.gateway.conftest import (
    GatewayUnderTest,
    TenantKey,
    gateway_settings,
    make_tenant_key,
    run_engine,
    run_gateway,
    wait_for_usage,
)
from tests.openai_schema import assert_conforms
from tests.polling import eventually
from tollgate.models import Adapter

pytestmark = pytest.mark.xdist_group("adapter_models")

PROMPT = "The adapter under test reads this prompt, long enough to fill a few KV blocks of the tiny model."


@pytest.fixture(scope="module")
def adapter_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def lora_engine_url(tiny_model_dir: Path, adapter_store: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    options = ("--num-kv-blocks", "256", "--max-loras", "2", "--max-lora-rank", "8", "--lora-dir",
               str(adapter_store))
    with run_engine(tiny_model_dir, tmp_path_factory.mktemp("lora_engine") / "engine.log",
                    options=options) as (url, _):
        yield url


@pytest.fixture(scope="module")
async def lora_gateway(lora_engine_url: str, tiny_model_dir: Path, adapter_store: Path, api_database_url: str,
                       redis_url: str, model_price: None,
                       tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GatewayUnderTest]:
    settings = gateway_settings([lora_engine_url], tiny_model_dir, api_database_url, redis_url)
    settings = settings.model_copy(update={"adapter_dir": adapter_store,
                                           "file_storage_dir": tmp_path_factory.mktemp("adapter_files"),
                                           "key_cache_ttl_s": 0.5})
    async with run_gateway(settings) as running:
        yield running


def zipped(bundle: Path, *, drop: str | None = None, folder: str = "") -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for path in bundle.iterdir():
            if path.name != drop:
                zf.write(path, f"{folder}{path.name}")
    return out.getvalue()


def client(gateway: GatewayUnderTest, key: TenantKey) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=key.headers, timeout=120.0)


async def register(api: httpx.AsyncClient, archive: bytes, name: str, base: str = "tiny") -> httpx.Response:
    upload = await api.post("/files", files={"file": ("adapter.zip", archive, "application/zip")},
                            data={"purpose": "fine-tune"})
    assert upload.status_code == 200, upload.text
    return await api.post("/models", json={"file_id": upload.json()["id"], "name": name, "base_model": base})


async def complete(api: httpx.AsyncClient, model: str, prompt: str = PROMPT) -> httpx.Response:
    return await api.post("/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                "temperature": 0})


def not_found(response: httpx.Response) -> bool:
    return response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


async def test_an_adapter_is_registered_served_priced_and_deleted(lora_gateway: GatewayUnderTest,
                                                                   tiny_model_dir: Path, adapter_store: Path,
                                                                   tmp_path: Path) -> None:
    owner = await make_tenant_key(lora_gateway, name="Acme Support Co")
    other = await make_tenant_key(lora_gateway)
    bundle = strong_bundle(tiny_model_dir, tmp_path / "v1", 3, ["q_proj", "v_proj", "down_proj"], 4)
    async with client(lora_gateway, owner) as api, client(lora_gateway, other) as stranger:
        created = await register(api, zipped(bundle, folder="checkpoint/"), "support")
        assert created.status_code == 200, created.text
        model = created.json()["id"]
        assert model.startswith("ft:tiny:acme-support-co:support:") and created.json()["base_model"] == "tiny"
        assert created.json()["adapter"]["rank"] == 4
        assert_conforms(created.json(), "Model")
        assert_conforms((await api.get("/models")).json(), "ListModelsResponse")
        assert model in [m["id"] for m in (await api.get("/models")).json()["data"]]
        assert (await api.get(f"/models/{model}")).json()["owned_by"] == "acme-support-co"

        # Served: the adapter changes the base model's greedy answer.
        tuned, base = await complete(api, model), await complete(api, "tiny")
        await the_gateway_keys_its_blocks_as_the_replica_does(lora_gateway, owner, model)
        assert tuned.status_code == 200, tuned.text
        assert tuned.json()["model"] == model
        assert tuned.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
        chat = await api.post("/chat/completions", json={"model": model, "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["model"] == model, chat.text
        responses = await api.post("/responses", json={"model": model, "input": "hi", "max_output_tokens": 4})
        assert responses.status_code == 200 and responses.json()["model"] == model, responses.text
        embeddings = await api.post("/embeddings", json={"model": model, "input": "hi"})
        assert embeddings.status_code == 400 and embeddings.json()["error"]["param"] == "model"

        # Metered under its own model id, at its base's price until it has one of its own.
        record = (await wait_for_usage(lora_gateway.settings.redis_url or "",
                                       tuned.headers["x-request-id"]))[0]
        plain = (await wait_for_usage(lora_gateway.settings.redis_url or "", base.headers["x-request-id"]))[0]
        assert record["model"] == model
        per_token = record["cost_pico_usd"] / (record["prompt_tokens"] + 4 * record["completion_tokens"])
        assert per_token == pytest.approx(plain["cost_pico_usd"] / (plain["prompt_tokens"]
                                                                    + 4 * plain["completion_tokens"]))
        async with lora_gateway.db.session() as session:
            await create_price(session, model=model, input=3 * 10**9, output=12 * 10**9)
        await lora_gateway.runtime.prices.refresh()
        priced = await complete(api, model)
        record = (await wait_for_usage(lora_gateway.settings.redis_url or "",
                                       priced.headers["x-request-id"]))[0]
        uncached = record["prompt_tokens"] - record["cached_tokens"]
        assert record["cost_pico_usd"] == (uncached * 3 * 10**9 + record["cached_tokens"] * 3 * 10**8
                                           + record["completion_tokens"] * 12 * 10**9)

        # Another tenant: it does not exist, on every endpoint.
        assert model not in [m["id"] for m in (await stranger.get("/models")).json()["data"]]
        assert not_found(await stranger.get(f"/models/{model}"))
        assert not_found(await complete(stranger, model))
        assert not_found(await stranger.post("/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}]}))
        assert not_found(await stranger.post("/responses", json={"model": model, "input": "hi"}))
        assert not_found(await stranger.post("/embeddings", json={"model": model, "input": "hi"}))
        assert not_found(await stranger.delete(f"/models/{model}"))

        # Deleted: gone from the list, the store and every endpoint; the name is free again.
        deleted = await api.delete(f"/models/{model}")
        assert deleted.json() == {"id": model, "object": "model", "deleted": True}
        assert_conforms(deleted.json(), "DeleteModelResponse")
        assert not_found(await complete(api, model)) and not_found(await api.get(f"/models/{model}"))
        assert not (adapter_store / model.rsplit(":", 1)[1]).exists()
        assert not_found(await api.delete(f"/models/{model}"))
        assert not_found(await api.delete("/models/tiny"))


async def test_a_new_registration_under_a_deleted_name_never_meets_the_old_kv(
        lora_gateway: GatewayUnderTest, tiny_model_dir: Path, tmp_path: Path) -> None:
    key = await make_tenant_key(lora_gateway)
    first = strong_bundle(tiny_model_dir, tmp_path / "first", 5, ["q_proj", "k_proj", "v_proj"], 4)
    second = strong_bundle(tiny_model_dir, tmp_path / "second", 6, ["q_proj", "k_proj", "v_proj"], 4)
    async with client(lora_gateway, key) as api:
        old = (await register(api, zipped(first), "agent")).json()["id"]
        await complete(api, old)
        again = await complete(api, old)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        old_text = again.json()["choices"][0]["text"]
        assert (await api.delete(f"/models/{old}")).status_code == 200
        new = (await register(api, zipped(second), "agent")).json()["id"]
        assert new != old and new.rsplit(":", 2)[0] == old.rsplit(":", 2)[0]
        fresh = await complete(api, new)
        assert fresh.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert fresh.json()["choices"][0]["text"] != old_text
        # Nor does the base model meet the adapter's blocks, or the adapter the base's.
        other = "Only the base model has read this one, a prompt of several KV blocks before the adapter."
        assert (await complete(api, "tiny", other)).status_code == 200
        crossed = await complete(api, new, other)
        assert crossed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def the_gateway_keys_its_blocks_as_the_replica_does(gateway: GatewayUnderTest, key: TenantKey,
                                                         model: str) -> None:
    """The prompt's blocks, hashed by the gateway with the tenant's salt and the adapter's digest, are
    blocks the replica says it holds (its ``/kv/events``), and the routing index sees them there."""

    runtime = gateway.runtime
    async with gateway.db.session() as session:
        digest = (await session.execute(select(Adapter.digest).where(Adapter.model == model))).scalar_one()
    salt = adapter_cache_salt(cache_salt(gateway.settings.key_hash_secret.get_secret_value(), key.tenant_id),
                              digest)
    prompt = runtime.tokenizer("tiny").encode(PROMPT)  # as the completions endpoint encodes it
    hashes = prefix_block_hashes(prompt, 16, salt)
    assert len(hashes) >= 2
    replica = runtime.router.models["tiny"].replicas[0]
    async with httpx.AsyncClient(base_url=replica.url) as engine:
        held = (await engine.get("/kv/events", params={"after": 0, "epoch": "none"})).json()
    stored = set(held["snapshot"] or {}) | {h for _, kind, _, h in held["events"] if kind == "stored"}
    assert {h.hex() for h in hashes} <= stored
    await eventually(lambda: runtime.router.cached_prefix_blocks(replica, hashes) == len(hashes),
                     "the routing index to hold the adapter's blocks")


@pytest.mark.parametrize(("case", "says"), [
    ("no weights", "exactly one adapter_model.safetensors"),
    ("not an archive", "not a zip or tar archive"),
    ("rank over the replica's limit", "r must be an integer in [1, 8]"),
    ("another base's shapes", "has shape"),
    ("unknown target", "target_modules"),
])
async def test_a_bundle_that_does_not_fit_is_a_400_and_leaves_nothing(
        lora_gateway: GatewayUnderTest, tiny_model_dir: Path, adapter_store: Path, tmp_path: Path,
        case: str, says: str) -> None:
    key = await make_tenant_key(lora_gateway)
    bundle = strong_bundle(tiny_model_dir, tmp_path / "b", 7, ["q_proj"], 4)
    archive: bytes
    if case == "no weights":
        archive = zipped(bundle, drop="adapter_model.safetensors")
    elif case == "not an archive":
        archive = b"PK but not really a zip file"
    elif case == "rank over the replica's limit":
        archive = zipped(strong_bundle(tiny_model_dir, tmp_path / "r16", 7, ["q_proj"], 16))
    elif case == "another base's shapes":
        from safetensors.torch import load_file, save_file
        weights = load_file(str(bundle / "adapter_model.safetensors"))
        save_file({k: v[:, :-1].contiguous() if "lora_A" in k else v for k, v in weights.items()},
                  str(bundle / "adapter_model.safetensors"))
        archive = zipped(bundle)
    else:
        import json
        config = json.loads((bundle / "adapter_config.json").read_text())
        (bundle / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["lm_head"]}))
        archive = zipped(bundle)
    before = sorted(p.name for p in adapter_store.iterdir())
    async with client(lora_gateway, key) as api:
        refused = await register(api, archive, "bad")
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "file_id" and says in refused.json()["error"]["message"]
        assert_conforms(refused.json(), "ErrorResponse")
        assert not [m for m in (await api.get("/models")).json()["data"] if m["id"].startswith("ft:")]
    assert sorted(p.name for p in adapter_store.iterdir()) == before


async def test_registration_refuses_bad_requests_clearly(lora_gateway: GatewayUnderTest, tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    key = await make_tenant_key(lora_gateway)
    archive = zipped(strong_bundle(tiny_model_dir, tmp_path / "b", 8, ["q_proj"], 2))
    async with client(lora_gateway, key) as api:
        bad_name = await register(api, archive, "no:colons")
        assert bad_name.status_code == 400 and bad_name.json()["error"]["param"] == "name"
        assert not_found(await register(api, archive, "x", base="no-such-model"))
        missing: dict[str, Any] = {"name": "x", "base_model": "tiny"}
        r = await api.post("/models", json=missing)
        assert r.status_code == 400 and r.json()["error"]["param"] == "file_id"
        batch_file = await api.post("/files", files={"file": ("in.jsonl", b"{}\n")},
                                    data={"purpose": "batch"})
        r = await api.post("/models", json={**missing, "file_id": batch_file.json()["id"]})
        assert r.status_code == 400 and "fine-tune" in r.json()["error"]["message"]
        r = await api.post("/files", files={"file": ("adapter.bin", b"x")}, data={"purpose": "fine-tune"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_file_format"
        assert (await register(api, archive, "dup")).status_code == 200
        dup = await register(api, archive, "dup")
        assert dup.status_code == 409 and dup.json()["error"]["code"] == "adapter_exists"


async def test_an_adapter_deleted_behind_a_gateways_back_is_a_404_there_too(
        lora_gateway: GatewayUnderTest, tiny_model_dir: Path, adapter_store: Path, tmp_path: Path) -> None:
    """Another gateway deleted it and this one has not heard (its lookup is cached): the replica finds no
    bundle, and this gateway answers as for a model that does not exist, never with the store's path."""
    key = await make_tenant_key(lora_gateway)
    async with client(lora_gateway, key) as api:
        model = (await register(api, zipped(strong_bundle(tiny_model_dir, tmp_path / "b", 9, ["q_proj"], 2)),
                                "stale")).json()["id"]
        assert (await complete(api, model)).status_code == 200  # looked up, cached, read by the replica
        import shutil
        shutil.rmtree(adapter_store / model.rsplit(":", 1)[1])
        gone = await complete(api, model)
        assert not_found(gone), gone.text
        assert str(adapter_store) not in gone.text


async def test_a_replica_that_does_not_share_the_gateways_store_is_a_503_that_names_no_path(
        lora_engine_url: str, tiny_model_dir: Path, api_database_url: str, redis_url: str, model_price: None,
        tmp_path: Path) -> None:
    """A misconfigured platform (the replicas' --lora-dir is not the gateway's adapter store): registration
    cannot be checked, so it is the platform's 503, not the tenant's 400, and nothing is left behind."""
    settings = gateway_settings([lora_engine_url], tiny_model_dir, api_database_url, redis_url)
    store = tmp_path / "elsewhere"
    settings = settings.model_copy(update={"adapter_dir": store, "file_storage_dir": tmp_path / "files"})
    async with run_gateway(settings) as apart:
        key = await make_tenant_key(apart)
        async with client(apart, key) as api:
            bundle = strong_bundle(tiny_model_dir, tmp_path / "b", 2, ["q_proj"], 2)
            refused = await register(api, zipped(bundle), "lost")
            assert refused.status_code == 503, refused.text
            assert str(store) not in refused.text and "adapters" not in refused.json()["error"]["message"]
            assert not [m for m in (await api.get("/models")).json()["data"] if m["id"].startswith("ft:")]
    assert not list(store.iterdir())
