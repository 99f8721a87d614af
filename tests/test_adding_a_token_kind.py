"""Adding a token kind touches three files (docs/architecture.md, "Adding a token kind"), proved by doing it.

A copy of the repository gets a new kind, ``reasoning_tokens`` (a part of the output), through exactly
the walk-through's three files: ``engine/usage.py`` (the kind), a migration (its columns) and
``engine/output_processor.py`` (the engine counts it). Then, in that copy, the kind reaches everything that
meters usage without another edit: the engine's final usage and wire form, the outbox record, the ledger
and its rollups (which reconcile), the statement's output line, the admin usage API, the Usage API's
result fields, and the ORM models that autogenerate compares with the migrated schema.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from alembic.config import Config
from alembic.script import ScriptDirectory

ROOT = Path(__file__).resolve().parents[1]
FILES_TOUCHED = 3

_KIND = '''    REJECTED_PREDICTION = "rejected_prediction"'''
_SPEC = '''    K.CACHE_WRITE: KindSpec('''
_PRODUCER = ("            TokenKind.REJECTED_PREDICTION: sum(s.num_rejected_prediction_tokens for s in seqs),"
             "\n")

_MIGRATION = '''"""Reasoning tokens on the ledger (the test's new kind).

Revision ID: 9999
Revises: {head}
"""

import sqlalchemy as sa
from alembic import op

revision = "9999"
down_revision = "{head}"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("usage_events", sa.Column("reasoning_tokens", sa.Integer(), server_default=sa.text("0"),
                                            nullable=False))
    op.create_check_constraint(op.f("ck_usage_events_reasoning_tokens"), "usage_events",
                               "reasoning_tokens BETWEEN 0 AND completion_tokens")
    op.add_column("usage_hourly", sa.Column("reasoning_tokens", sa.BigInteger(), server_default=sa.text("0"),
                                            nullable=False))


def downgrade() -> None:
    op.drop_column("usage_hourly", "reasoning_tokens")
    op.drop_constraint(op.f("ck_usage_events_reasoning_tokens"), "usage_events", type_="check")
    op.drop_column("usage_events", "reasoning_tokens")
'''

# Runs in the copy: everything below it is unchanged code.
_CHECK = r'''
import asyncio
import sys
from datetime import UTC, datetime, timedelta

import orjson
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, pool, text

import engine.usage
from tollgate import schema

url, checkpoint, copy = sys.argv[1:4]
assert engine.usage.__file__.startswith(copy), engine.usage.__file__
schema.upgrade(url)

from billing.ledger import _insert_and_roll_up
from billing.outbox import UsageRecord
from billing.prices import charge
from billing.rollups import find_rollup_mismatches
from billing.statements import build_statement
from engine.llm import LLM
from engine.protocol import FinalRecord
from engine.sampling_params import SamplingParams
from engine.usage import TokenKind
from gateway.admin import service as admin
from gateway.usage.service import detail_fields
from tests.factories import create_price, create_tenant
from tollgate.db import Database, to_psycopg_url
from tollgate.models import Base
from tollgate.settings import get_settings

# The engine counts it, its final record carries it.
usage = LLM(checkpoint, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=128).generate(
    [[5] * 20], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].usage
assert usage.reasoning_tokens == usage[TokenKind.REASONING] == 4, usage
final = FinalRecord.model_validate({"request_id": "r", "finish_reasons": ["length"], "usage": usage.fields(),
                                    "timings": {"queued": 0, "ttft": 0, "tpot": 0, "e2e": 0}})
assert orjson.loads(final.model_dump_json())["usage"]["reasoning_tokens"] == 4
assert detail_fields(usage)["output_reasoning_tokens"] == 4

# The ORM follows the kinds: autogenerate finds the migrated schema equal to the models.
sync = create_engine(to_psycopg_url(url), poolclass=pool.NullPool)
with sync.connect() as conn:
    context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
    assert compare_metadata(context, Base.metadata) == []
sync.dispose()


async def ledger() -> None:
    db = Database(url, pool_size=2)
    at = datetime(2032, 5, 7, 10, 30, tzinfo=UTC)
    try:
        async with db.session() as session:
            tenant = await create_tenant(session)
            price = await create_price(session, model="tiny")
        record = UsageRecord.charged(
            request_id="reasoning-1", tenant_id=tenant.id, api_key_id=None, model="tiny",
            request_class="interactive", tier="default", usage=usage,
            costs=charge(usage, price, "interactive"), status="completed", ttft_ms=None, tpot_ms=None,
            created_at=at)
        assert UsageRecord.from_json(record.to_json()) == record
        assert orjson.loads(record.to_json())["reasoning_tokens"] == 4
        async with db.session() as session:
            assert await _insert_and_roll_up(session, [record.row()]) == 1
        async with db.session() as session:
            ledger = await session.scalar(text("SELECT reasoning_tokens FROM usage_events"))
            hourly = await session.scalar(text("SELECT reasoning_tokens FROM usage_hourly"))
            assert (ledger, hourly) == (4, 4)
            hour = timedelta(hours=1)
            assert await find_rollup_mismatches(session, at - hour, at + hour) == []
            statement = await build_statement(session, tenant.id, "2032-05")
            output = [line for line in statement.lines if line.token_kind == "output"]
            assert output[0].as_dict()["reasoning_tokens"] == 4
            assert statement.as_dict()["reasoning_tokens"] == 4
            assert "reasoning_tokens" in statement.to_csv().splitlines()[0]
            report = await admin.usage(session, start=at - timedelta(days=1), end=at + timedelta(days=1),
                                       tenant_id=tenant.id, settings=get_settings())
            assert report.totals.model_dump()["reasoning_tokens"] == 4
    finally:
        await db.dispose()


asyncio.run(ledger())
print("the new kind reached everything")
'''


def _head() -> str:
    heads = ScriptDirectory.from_config(Config(str(ROOT / "alembic.ini"))).get_heads()
    assert len(heads) == 1
    return heads[0]


def _edit(path: Path, anchor: str, addition: str, *, before: bool = False) -> None:
    text = path.read_text()
    assert text.count(anchor) == 1, f"{path}: the anchor {anchor!r} moved; update this test's walk-through"
    path.write_text(text.replace(anchor, addition + anchor if before else anchor + addition))


def test_adding_a_token_kind_touches_three_files(tmp_path: Path, new_database: str) -> None:
    from engine.tiny import create_tiny_checkpoint

    checkpoint = create_tiny_checkpoint(tmp_path / "tiny", arch="llama", seed=0)
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".tollgate", "__pycache__", "test-artifacts", "*.egg-info", "node_modules"))
    touched = [copy / "engine/usage.py", copy / "migrations/versions/29991231_0000_9999_reasoning_tokens.py",
               copy / "engine/output_processor.py"]
    # 1. The kind.
    _edit(touched[0], _KIND, '    REASONING = "reasoning"  # of the output, reasoning tokens\n',
          before=True)
    spec = '    K.REASONING: KindSpec("reasoning_tokens", "Of the output, reasoning.", within=K.OUTPUT),\n'
    _edit(touched[0], _SPEC, spec, before=True)
    # 2. Its columns.
    touched[1].write_text(_MIGRATION.format(head=_head()))
    # 3. The engine counts it (here: half the output, a stand-in for a reasoning parser's count).
    count = "            TokenKind.REASONING: sum(s.num_output_tokens for s in seqs) // 2,\n"
    _edit(touched[2], _PRODUCER, count)
    assert len(touched) == FILES_TOUCHED

    env = {**os.environ, "PYTHONPATH": str(copy)}
    done = subprocess.run([sys.executable, "-c", _CHECK, new_database, str(checkpoint), str(copy)],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "the new kind reached everything" in done.stdout
