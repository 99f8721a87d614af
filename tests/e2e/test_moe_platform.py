"""A mixture of experts served end to end: ``tollgate up --model <tiny Qwen3-MoE>``, the official SDK,
prompt-cache hits reported to the client and billed at the cached price in the ledger.

Its own platform (``tollgate up`` with its own Postgres, Redis and engine, as a newcomer runs it), since the
shared end-to-end platform serves the dense tiny model.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from openai import OpenAI

from engine.tiny import create_tiny_checkpoint
from tests.e2e.platform_harness import read_env_file
from tests.polling import wait_until
from tests.tollgate.test_up import UpProcess, data_dir  # noqa: F401 - the fixture
from tollgate.local_services import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SYSTEM = ("You are a careful assistant who answers questions about the standard library of Python, "
          "its modules, their functions and the arguments those functions take. ") * 3


def test_a_tiny_qwen3_moe_is_served_through_the_sdk_and_its_cached_tokens_billed(
    data_dir: Path,  # noqa: F811 - the fixture of tests.tollgate.test_up
) -> None:
    model_dir = create_tiny_checkpoint(data_dir.parent / "tiny-qwen3-moe", arch="qwen3_moe")
    up = UpProcess(data_dir, free_port(), free_port(), "--model", str(model_dir))
    try:
        up.wait_ready()
        env = read_env_file(data_dir / "env")
        client = OpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"], max_retries=0)
        assert "tiny-qwen3-moe" in [m.id for m in client.models.list()]
        replies = [
            client.chat.completions.create(
                model="tiny-qwen3-moe", max_tokens=8,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            )
            for question in ("What does json.dumps do?", "And json.loads?")
        ]
        for reply in replies:
            assert reply.choices[0].message.content and reply.usage is not None
            assert reply.choices[0].finish_reason in ("stop", "length")
        first, second = (r.usage for r in replies)
        assert first.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
        cached = second.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
        assert cached >= 32 and cached % 16 == 0  # the shared system prompt's full blocks

        with psycopg.connect(env["TOLLGATE_DATABASE_URL"]) as conn:
            def ledger() -> list[tuple[int, int, int, int]]:
                return conn.execute(
                    "SELECT prompt_tokens, cached_tokens, completion_tokens, cost_pico_usd FROM usage_events"
                    " WHERE model = 'tiny-qwen3-moe' ORDER BY created_at").fetchall()

            wait_until(lambda: len(ledger()) == 2, "both requests in the ledger", timeout_s=60)
            price = conn.execute(
                "SELECT input, cached_input, output FROM prices WHERE model = 'tiny-qwen3-moe'"
                " ORDER BY effective_from DESC LIMIT 1"
            ).fetchone()
            assert price is not None
            for (prompt, hit, completion, cost), usage in zip(ledger(), (first, second), strict=True):
                details = usage.prompt_tokens_details
                assert details is not None
                assert (prompt, hit, completion) == (usage.prompt_tokens, details.cached_tokens,
                                                     usage.completion_tokens)
                assert cost == (prompt - hit) * price[0] + hit * price[1] + completion * price[2]
            assert price[1] < price[0]  # the cached tokens were billed at the lower price
    finally:
        assert up.terminate() == 0
