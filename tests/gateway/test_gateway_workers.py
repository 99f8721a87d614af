"""``tollgate gateway --workers N``: the workers are forked from the parent, which has loaded the app's
modules (a spawned worker would import them all again, ~2.5 s of CPU each), and a worker that dies is
replaced by another fork that serves."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.factories import create_api_key, create_price, create_tenant
from tests.gateway.gateway_processes import (
    MODEL,
    gateway_env,
    gateway_process,
    synthetic_engine,
    wait_model_served,
)
from tests.polling import wait_until
from tollgate.commands.gateway import worker_pids
from tollgate.db import Database
from tollgate.processes import pid_alive

pytestmark = pytest.mark.slow


async def _seed(database_url: str) -> str:
    db = Database(database_url, pool_size=1)
    try:
        async with db.session() as session:
            await create_price(session, model=MODEL)
            _, key = await create_api_key(session, await create_tenant(session))
        return key
    finally:
        await db.dispose()


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _workers(parent: int) -> set[int]:
    return set(worker_pids(parent))


async def test_workers_are_forked_from_the_parent_and_a_dead_one_is_forked_again(
    new_database: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    key = await _seed(new_database)
    with synthetic_engine(tmp_path / "engine.log", token_interval_s=0.0, ttft_s=0.0) as engine:
        env = gateway_env(database_url=new_database, redis_url=redis_url, replicas=[engine.url],
                          tokenizer_dir=tiny_model_dir)  # fmt: skip
        with gateway_process(env, tmp_path / "gateway.log", workers=2, api_key=key) as gw:
            parent = gw.proc.pid
            first = _workers(parent)
            assert len(first) == 2
            # Forked: the parent's own command line, not multiprocessing's spawn_main.
            assert {_cmdline(pid) for pid in first} == {_cmdline(parent)}

            victim = min(first)
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: not pid_alive(victim), "the killed worker to be gone")
            again = wait_until(lambda: (w := _workers(parent)) - first and len(w) == 2 and w,
                               "the supervisor to fork a replacement")  # fmt: skip
            (replacement,) = again - first
            assert _cmdline(replacement) == _cmdline(parent)
            # Both workers serve: eight requests in a row, each on a fresh connection, all answered.
            wait_model_served(gw.url, key, gw.proc, gw.log, workers=2)
