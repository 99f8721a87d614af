"""Batch input lines validated on their own (``LineValidator``), without a database."""

from __future__ import annotations

import json

from gateway.batches.lines import LineValidator

LINE = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}}).encode()


def test_a_file_that_starts_with_a_utf8_byte_order_mark_is_read():
    """Editors on Windows write UTF-8 with a BOM: the file's first line is JSON after it; a BOM anywhere
    else is what it is, not JSON."""
    validator = LineValidator("/v1/chat/completions", frozenset({"tiny"}), None)
    parsed = validator.check(1, b"\xef\xbb\xbf" + LINE)
    assert parsed is not None and parsed.custom_id == "a" and validator.errors == []
    assert validator.check(2, b"\xef\xbb\xbf" + LINE.replace(b'"a"', b'"b"')) is None
    assert [(e["line"], e["code"]) for e in validator.errors] == [(2, "invalid_json_line")]
