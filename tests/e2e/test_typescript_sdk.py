"""The official ``openai`` JavaScript/TypeScript SDK, unchanged, against the whole platform: a Node script
(``tests/e2e/ts/responses.mjs``, the SDK installed by ``scripts/bootstrap.sh`` from its lockfile) calls
the Responses API (plain, streamed, structured output, a tool round trip with
``previous_response_id``, a 404), embeddings in float and base64, and chat, and prints what it saw; this
test checks it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.platform_harness import MODEL, PLATFORM_GROUP, Platform

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(PLATFORM_GROUP)]

TS = Path(__file__).resolve().parent / "ts"


def test_the_typescript_sdk_works_unchanged(platform: Platform) -> None:
    node = shutil.which("node")
    assert node is not None, "node is missing: scripts/bootstrap.sh installs it (apt: nodejs npm)"
    assert (TS / "node_modules" / "openai").is_dir(), "run scripts/bootstrap.sh (npm ci in tests/e2e/ts)"
    env = {**platform.env, "TOLLGATE_MODEL": MODEL}
    done = subprocess.run([node, str(TS / "responses.mjs")], env=env, cwd=TS, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["plain"]["id"].startswith("resp_") and seen["plain"]["text"]
    assert seen["plain"]["status"] in ("completed", "incomplete")
    assert seen["plain"]["usage"]["output_tokens"] > 0
    kinds = seen["stream"]["kinds"]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert seen["stream"]["text"] == seen["plain"]["text"]  # greedy: the same text
    assert seen["structured"]["status"] == "completed"
    assert set(seen["structured"]["parsed"]) == {"city", "sunny"}
    assert seen["tools"]["call"]["type"] == "function_call" and seen["tools"]["call"]["name"] == "get_weather"
    assert "city" in seen["tools"]["call"]["arguments"]
    assert seen["tools"]["answer"] == "message" and seen["tools"]["previous"] is True
    assert seen["embeddings"]["count"] == 2 and seen["embeddings"]["length"] > 0
    assert seen["embeddings"]["sameAsBase64"] is True and seen["embeddings"]["promptTokens"] > 0
    assert seen["chat"] == {"object": "chat.completion", "role": "assistant"}
    assert seen["notFound"] == {"status": 404, "code": "response_not_found", "isNotFound": True}
