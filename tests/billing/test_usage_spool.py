"""The usage spool: records Redis refused wait on local disk and reach the outbox once it answers."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord
from billing.usage_spool import UsageSpool
from tollgate.local_services import free_port


def _record(request_id: str, completion: int = 5, accepted: int = 0, rejected: int = 0) -> UsageRecord:
    return UsageRecord.of(request_id=request_id, tenant_id=7, api_key_id=1, model="tiny",
                       request_class="interactive", tier="default", prompt_tokens=11, cached_tokens=0,
                       completion_tokens=completion, cost_pico_usd=123, status="completed", ttft_ms=None,
                       tpot_ms=None, created_at=datetime.now(UTC), accepted_prediction_tokens=accepted,
                       rejected_prediction_tokens=rejected)


async def _outbox(redis: Redis) -> list[UsageRecord]:
    return [UsageRecord.from_json(fields[RECORD_FIELD]) for _, fields in await redis.xrange(USAGE_STREAM)]


async def test_kept_records_reach_the_outbox_once_redis_answers(tmp_path: Path, redis_client: Redis) -> None:
    spool = UsageSpool(tmp_path / "spool")
    assert not spool.pending()
    assert spool.keep(_record("a")) and spool.keep(_record("b", completion=9, accepted=4, rejected=3))
    assert spool.pending()
    down = Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)  # nothing listens there
    with pytest.raises(RedisError):
        await spool.drain(down)
    await down.aclose()
    assert spool.pending(), "nothing leaves the spool while Redis refuses"
    assert await spool.drain(redis_client) == 2
    assert [(r.request_id, r.completion_tokens) for r in await _outbox(redis_client)] == [("a", 5), ("b", 9)]
    assert [(r.accepted_prediction_tokens, r.rejected_prediction_tokens)
            for r in await _outbox(redis_client)] == [(0, 0), (4, 3)]  # every count survives the spool
    assert not spool.pending() and not spool.path.exists()
    assert await spool.drain(redis_client) == 0


async def test_a_record_kept_while_draining_stays_for_the_next_drain(tmp_path: Path,
                                                                    redis_client: Redis) -> None:
    spool = UsageSpool(tmp_path)
    spool.keep(_record("first"))

    class KeepsOneMore:
        """A Redis whose XADD answers after another request's record was kept meanwhile."""

        async def xadd(self, *args, **kwargs):
            spool.keep(_record("meanwhile"))
            return await redis_client.xadd(*args, **kwargs)

    assert await spool.drain(KeepsOneMore()) == 1  # type: ignore[arg-type]
    assert spool.pending()
    assert await spool.drain(redis_client) == 1
    assert [r.request_id for r in await _outbox(redis_client)] == ["first", "meanwhile"]


async def test_a_dead_process_file_is_adopted_and_a_living_one_is_not(tmp_path: Path,
                                                                     redis_client: Redis) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f"usage-{dead_pid}.jsonl").write_bytes(
            _record("orphan").to_json() + b"\n" + b'{"request_id": "cut mid-wri')  # its writer died mid-line
        (tmp_path / f"usage-{living.pid}.jsonl").write_bytes(_record("not-mine").to_json() + b"\n")
        spool = UsageSpool(tmp_path)
        assert spool.pending()
        assert await spool.drain(redis_client) == 1
        assert [r.request_id for r in await _outbox(redis_client)] == ["orphan"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"usage-{living.pid}.jsonl"]
    finally:
        living.kill()
        living.wait()
    assert os.getpid() != dead_pid


async def test_a_disk_that_refuses_is_logged_with_the_record(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spool directory should be")
    assert UsageSpool(blocker).keep(_record("lost")) is False
    assert "USAGE NOT RECORDED for request lost" in caplog.text and '"completion_tokens":5' in caplog.text
