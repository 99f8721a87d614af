"""The chaos judge's rule for completed ledger rows that no client knows (``unexplained_completed``)."""

from __future__ import annotations

from collections import Counter

from benchmarks.chaos_judge import unexplained_completed
from benchmarks.chaos_load import Outcome

KILL_AT = 100.0


def _outcome(op: str, kind: str, started: float, ended: float) -> Outcome:
    return Outcome(op=op, tenant="t", kind=kind, started=started, ended=ended)


def test_background_responses_explain_their_own_rows() -> None:
    found = Counter({(40, 8): 2})
    assert unexplained_completed(found, Counter({(40, 8): 2}), [], [KILL_AT]) == (Counter(), 0)


def test_an_answer_billed_then_lost_with_its_killed_worker_is_counted_apart() -> None:
    cut = _outcome("cached_chat", "transport", 99.0, 100.2)
    assert unexplained_completed(Counter({(646, 6): 1}), Counter(), [cut], [KILL_AT]) == (Counter(), 1)


def test_a_transport_error_without_a_worker_kill_explains_nothing() -> None:
    found = Counter({(646, 6): 1})
    earlier = _outcome("chat", "transport", 10.0, 10.5)
    assert unexplained_completed(found, Counter(), [earlier], [KILL_AT]) == (found, 0)


def test_a_streamed_request_cut_by_a_kill_explains_nothing() -> None:
    # A stream's usage is recorded at its end, after every byte was sent: no completed row can follow a
    # connection that broke before its first byte.
    found = Counter({(20, 5): 1})
    cut = _outcome("chat_stream", "transport", 99.0, 100.2)
    assert unexplained_completed(found, Counter(), [cut], [KILL_AT]) == (found, 0)


def test_more_rows_than_cut_requests_are_all_reported() -> None:
    found = Counter({(646, 6): 1, (30, 4): 1})
    cut = _outcome("chat", "transport", 99.0, 100.2)
    assert unexplained_completed(found, Counter(), [cut], [KILL_AT]) == (found, 0)
