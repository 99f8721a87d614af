"""Finding server binaries, making a data dir reachable for postgres, Redis durability settings."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tollgate.local_services import (
    INSTALL_HINT,
    LocalPostgres,
    LocalRedis,
    MissingServerBinaries,
    find_postgres_bin_dir,
    find_redis_server,
    find_server_binaries,
    grant_traversal,
)
from tollgate.redis import check_durability
from tollgate.settings import Settings


def test_configured_paths_that_do_not_exist_are_not_found(tmp_path):
    assert find_postgres_bin_dir(tmp_path / "nowhere") is None
    assert find_redis_server(tmp_path / "nowhere" / "redis-server") is None


def test_missing_binaries_say_what_to_install(tmp_path):
    settings = Settings(postgres_bin_dir=tmp_path / "pg", redis_server_bin=tmp_path / "redis-server")
    with pytest.raises(MissingServerBinaries) as info:
        find_server_binaries(settings)
    message = str(info.value)
    assert INSTALL_HINT == "apt-get install postgresql redis-server"
    assert INSTALL_HINT in message and "PostgreSQL" in message and "redis-server" in message


def test_installed_binaries_are_found():
    binaries = find_server_binaries(Settings())
    assert (binaries.postgres_bin_dir / "initdb").is_file() and binaries.redis_server.is_file()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"port": 0, "password": "x"}, "port"), ({"port": 5432, "password": ""}, "password")],
)
def test_server_arguments_are_validated(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalPostgres(tmp_path, tmp_path, **kwargs)
    with pytest.raises(ValueError, match=message):
        LocalRedis(tmp_path, tmp_path, **kwargs)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the data directory to the postgres user")
def test_grant_traversal_opens_a_private_parent_for_postgres(tmp_path):
    home = tmp_path / "home"
    target = home / "project" / ".tollgate" / "postgres"
    target.mkdir(parents=True)
    os.chmod(home, 0o700)
    os.chmod(tmp_path, 0o700)

    def postgres_can_reach() -> bool:
        return (
            subprocess.run(
                ["/usr/bin/test", "-x", str(target.parent)],
                user="postgres",
                group="postgres",
                extra_groups=[],
            ).returncode
            == 0
        )

    assert not postgres_can_reach()
    changes = grant_traversal(target, "postgres")
    assert any(str(home) in change for change in changes)
    assert postgres_can_reach()
    assert not os.stat(home).st_mode & 0o004  # search only (ACL or o+x): the folder still cannot be listed
    assert grant_traversal(target, "postgres") == []


async def test_local_redis_is_durable_and_never_evicts(private_redis):
    client = aioredis.Redis.from_url(private_redis.url)
    try:
        assert await check_durability(client) == []
        await client.config_set("maxmemory-policy", "allkeys-lru")
        problems = await check_durability(client)
        assert len(problems) == 1 and "noeviction" in problems[0]
    finally:
        await client.aclose()


async def test_a_server_that_evicts_or_does_not_persist_is_reported_at_start(private_redis, caplog):
    """What the gateway logs when it starts against a Redis that is not fit (a managed one, configured by
    its provider), and against one that refuses CONFIG GET: a warning, never a refusal to start."""
    import logging

    import redis as redis_sync

    from tollgate.redis import warn_if_not_durable

    client = aioredis.Redis.from_url(private_redis.url)
    try:
        # (Not appendonly: turning it back on makes the server rewrite its log, which the fixture's stop
        # then waits for.)
        await client.config_set("maxmemory-policy", "volatile-lru")
        with caplog.at_level(logging.WARNING, logger="tollgate.redis"):
            problems = await warn_if_not_durable(client)
        assert len(problems) == 1 and "noeviction" in problems[0]
        assert "Redis server: maxmemory-policy is 'volatile-lru'" in caplog.text
    finally:
        await client.config_set("maxmemory-policy", "noeviction")
        await client.aclose()

    class NoConfig:
        async def config_get(self, name: str) -> dict:
            raise redis_sync.ResponseError("unknown command 'CONFIG'")

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tollgate.redis"):
        assert await warn_if_not_durable(NoConfig()) == []  # type: ignore[arg-type]
    assert "could not check the Redis server's durability settings" in caplog.text


def test_redis_url_refuses_unknown_database_index(tmp_path: Path):
    server = LocalRedis(tmp_path, tmp_path / "redis-server", port=6390, password="pw", databases=4)
    assert server.url(3).endswith(":6390/3")
    with pytest.raises(ValueError, match="db must be"):
        server.url(4)


def test_free_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    """A port outgoing connections can never take between the pick and the caller's bind."""
    import socket

    from tollgate.local_services import _ephemeral_floor, free_port

    for _ in range(20):
        port = free_port()
        assert 10_000 <= port < _ephemeral_floor()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as every server we start binds
            s.bind(("127.0.0.1", port))


def test_a_port_is_free_over_time_wait_leftovers_but_not_while_something_listens() -> None:
    """What lets ``tollgate up`` start again right after Ctrl-C: the connections a stopped server closed
    first stay in TIME_WAIT on its port for a minute, and its successor can bind over them."""
    import socket

    from tollgate.local_services import free_port, port_is_free

    port = free_port()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    assert not port_is_free(port)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server closes first, as a draining server does: its side goes to TIME_WAIT
    assert client.recv(1) == b""
    client.close()
    listener.close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain:
        with pytest.raises(OSError):  # the leftover is there: a bind without SO_REUSEADDR is refused
            plain.bind(("127.0.0.1", port))
    assert port_is_free(port)
