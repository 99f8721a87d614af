"""The ``Response`` object and its stream of typed events, built as a generation's output arrives.

``ResponseBuilder`` is pure logic (no I/O): the service feeds it final text (``text``) and tool calls
(``call``) as the generation produces them, then ``finish``es it; each call returns the stream events
it causes, in OpenAI's order, each with the next ``sequence_number``:

    response.created, response.in_progress,
    per message:   response.output_item.added, response.content_part.added,
                   response.output_text.delta ..., response.output_text.done,
                   response.content_part.done, response.output_item.done
    per call:      response.output_item.added, response.function_call_arguments.delta,
                   response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Text before a call is one message item, text after it another (output items keep the order the
model produced them in). ``response()`` is the object at any moment (``status`` ``in_progress`` until
``finish``), which a non-streamed request returns and ``GET /v1/responses/{id}`` will.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from gateway.chat.tools import ParsedCall

STATUS_QUEUED = "queued"
STATUS_IN_PROGRESS = "in_progress"
STATUS_COMPLETED = "completed"
STATUS_INCOMPLETE = "incomplete"
STATUS_FAILED = "failed"
STATUS_CANCELLED = "cancelled"
FINAL_EVENTS = {STATUS_COMPLETED: "response.completed", STATUS_INCOMPLETE: "response.incomplete",
                STATUS_FAILED: "response.failed"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _event_logprobs(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ResponseLogProb`` (a delta event's) from ``LogProb`` (the content part's): no bytes."""
    return [{"token": lp["token"], "logprob": lp["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]}
            for lp in logprobs]


class ResponseBuilder:
    def __init__(self, response_id: str, request_fields: dict[str, Any],
                 created_at: int | None = None) -> None:
        """``request_fields``: what the response object echoes of the request (model, instructions,
        tools, tool_choice, text, temperature, top_p, ... as ``Response`` spells them)."""
        self.id = response_id
        self.created_at = int(time.time()) if created_at is None else created_at
        self.fields = request_fields
        self.status = STATUS_IN_PROGRESS
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_reason: str | None = None
        self.completed_at: int | None = None
        self._sequence = 0
        self._message: dict[str, Any] | None = None  # the message item being written

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return event

    def response(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "completed_at": self.completed_at, "error": self.error,
            "incomplete_details": ({"reason": self.incomplete_reason} if self.incomplete_reason else None),
            **self.fields, "output": [dict(item) for item in self.output], "usage": self.usage,
        }

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        if not delta and not logprobs:
            return []
        events = [] if self._message is not None else self._open_message()
        part = self._message["content"][0]  # type: ignore[index]
        part["text"] += delta
        if logprobs:
            part["logprobs"].extend(logprobs)
        events.append(self._event("response.output_text.delta", item_id=self._message["id"],  # type: ignore[index]
                                  output_index=len(self.output) - 1, content_index=0, delta=delta,
                                  logprobs=_event_logprobs(logprobs or [])))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = {"id": new_id("msg"), "type": "message", "role": "assistant",
                         "status": STATUS_IN_PROGRESS, "content": []}
        self.output.append(self._message)
        index = len(self.output) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = [self._event("response.output_item.added", output_index=index,
                              item={**self._message, "content": []})]
        self._message["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=self._message["id"],
                                  output_index=index, content_index=0, part=dict(part, logprobs=[])))
        return events

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, self._message = self._message, None
        if message is None:
            return []
        index = self.output.index(message)
        part = message["content"][0]
        message["status"] = status
        return [
            self._event("response.output_text.done", item_id=message["id"], output_index=index,
                        content_index=0, text=part["text"], logprobs=_event_logprobs(part["logprobs"])),
            self._event("response.content_part.done", item_id=message["id"], output_index=index,
                        content_index=0, part=dict(part)),
            self._event("response.output_item.done", output_index=index, item=dict(message)),
        ]

    def call(self, call: ParsedCall, *, complete: bool = True) -> list[dict[str, Any]]:
        """A tool call the model made (``complete=False``: its arguments were cut short)."""
        events = self._close_message(STATUS_COMPLETED)
        item = {"id": new_id("fc"), "type": "function_call", "status": STATUS_IN_PROGRESS,
                "call_id": call.id, "name": call.name, "arguments": ""}
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        item["arguments"] = call.arguments
        events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=index, delta=call.arguments))
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=call.name, arguments=call.arguments))
        item["status"] = STATUS_COMPLETED if complete else STATUS_INCOMPLETE
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def finish(self, usage: dict[str, Any] | None, *, cut_short: bool = False,
               error_message: str | None = None, cancelled: bool = False) -> list[dict[str, Any]]:
        """The end: ``cut_short`` by ``max_output_tokens`` (status ``incomplete``), failed with
        ``error_message`` (status ``failed``), ``cancelled`` (the client went away: no event, nobody
        reads it), else ``completed``."""
        if cancelled:
            self._close_message(STATUS_INCOMPLETE)
            self.status, self.usage = STATUS_CANCELLED, usage
            return []
        if error_message is not None:
            status = STATUS_FAILED
            self.error = {"code": "server_error", "message": error_message}
        elif cut_short:
            status = STATUS_INCOMPLETE
            self.incomplete_reason = "max_output_tokens"
        else:
            status = STATUS_COMPLETED
            self.completed_at = int(time.time())
        events = self._close_message(STATUS_INCOMPLETE if status == STATUS_INCOMPLETE else STATUS_COMPLETED)
        self.status = status
        self.usage = usage
        events.append(self._event(FINAL_EVENTS[status], response=self.response()))
        return events
