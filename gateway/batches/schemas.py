"""OpenAI's batch request and objects (``CreateBatchRequest``, ``Batch``, ``ListBatchesResponse``).

Statuses (OpenAI's): ``validating`` → ``in_progress`` → ``finalizing`` → ``completed``; or ``failed``
(validation), ``expired`` (window over; finished lines kept), ``cancelling`` → ``cancelled``.
``request_counts``: ``total`` lines, ``completed`` (answered 2xx), ``failed`` (answered with an error or
given up); lines stopped by cancel or expiry count in neither. ``usage`` sums the successful lines.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.files.schemas import MAX_EXPIRES_AFTER_S, MIN_EXPIRES_AFTER_S, unix
from gateway.openai.schemas import check_metadata
from tollgate.models import Batch

SUPPORTED_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
FINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRES_AFTER_S, le=MAX_EXPIRES_AFTER_S)


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: OutputExpiresAfter | None = None

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        if value not in SUPPORTED_ENDPOINTS:
            raise ValueError(f"'{value}' is not supported; use one of {', '.join(SUPPORTED_ENDPOINTS)}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)


class ListBatchesQuery(BaseModel):
    after: str | None = None
    limit: int = Field(default=20, ge=1, le=100)


def batch_object(row: Batch) -> dict[str, Any]:
    """The ``Batch`` object of a row (nulls for timestamps not reached yet, as OpenAI sends them)."""
    usage = {
        "input_tokens": row.prompt_tokens,
        "input_tokens_details": {"cached_tokens": row.cached_tokens},
        "output_tokens": row.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": row.prompt_tokens + row.completion_tokens,
    }
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "model": row.model,
        "errors": {"object": "list", "data": row.errors} if row.errors else None,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": unix(row.created_at),
        "in_progress_at": unix(row.in_progress_at),
        "expires_at": unix(row.expires_at),
        "finalizing_at": unix(row.finalizing_at),
        "completed_at": unix(row.completed_at),
        "failed_at": unix(row.failed_at),
        "expired_at": unix(row.expired_at) if row.status == "expired" else None,
        "cancelling_at": unix(row.cancelling_at),
        "cancelled_at": unix(row.cancelled_at),
        "request_counts": {"total": row.request_total, "completed": row.request_completed,
                           "failed": row.request_failed},
        "usage": usage,
        "metadata": row.batch_metadata,
    }


def batch_list(rows: list[Batch], has_more: bool) -> dict[str, Any]:
    data = [batch_object(r) for r in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
