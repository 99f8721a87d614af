"""Batches: create (after checking the input file), retrieve, list, cancel.

Invariants:
- ``create`` only records the batch (``validating``); the caller sends ``batches.validate`` after the
  commit, and the runner checks every line before anything runs (nothing is billed for a batch that
  fails validation).
- ``cancel`` moves ``validating``/``in_progress`` to ``cancelling`` under the row lock (idempotent for a
  batch already cancelling or cancelled); runners stop starting lines within
  ``batch_status_poll_interval_s`` and the batch ends ``cancelled`` with the finished lines kept. A
  batch in any other state cannot be cancelled (400).
- Every query goes through ``BatchRepository`` / ``FileRepository``, bound to the caller's tenant.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.batches.repository import BatchRepository
from gateway.batches.schemas import CreateBatchRequest, batch_list, batch_object
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.files.repository import FileRepository
from tollgate.models import Batch
from tollgate.settings import Settings

CANCELLABLE = frozenset({"validating", "in_progress"})


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


class BatchNotFound(NotFoundError):
    def __init__(self, batch_id: str) -> None:
        super().__init__(f"No batch found with id '{batch_id}'.", param="batch_id")


class BatchService:
    def __init__(self, session: AsyncSession, settings: Settings, tenant_id: int,
                 api_key_id: int | None = None) -> None:
        self.repo = BatchRepository(session, tenant_id)
        self.files = FileRepository(session, tenant_id)
        self.settings = settings
        self.tenant_id = tenant_id
        self.api_key_id = api_key_id

    async def create(self, body: CreateBatchRequest) -> dict[str, Any]:
        file = await self.files.get(body.input_file_id)
        if file is None:
            raise NotFoundError(f"No such File object: {body.input_file_id}", param="input_file_id")
        if file.purpose != "batch":
            raise InvalidRequestError(
                f"File {file.id} has purpose '{file.purpose}'; a batch input must be uploaded with "
                "purpose 'batch'.", param="input_file_id", code="invalid_value")
        now = datetime.now(UTC)
        row = await self.repo.add(Batch(
            id=new_batch_id(), tenant_id=self.tenant_id, api_key_id=self.api_key_id, endpoint=body.endpoint,
            input_file_id=file.id, completion_window=body.completion_window, status="validating",
            batch_metadata=body.metadata,
            output_expires_after_s=body.output_expires_after.seconds if body.output_expires_after else None,
            created_at=now, expires_at=now + timedelta(seconds=self.settings.batch_completion_window_s),
        ))
        return batch_object(row)

    async def retrieve(self, batch_id: str) -> dict[str, Any]:
        row = await self.repo.get(batch_id)
        if row is None:
            raise BatchNotFound(batch_id)
        return batch_object(row)

    async def list(self, *, after: str | None, limit: int) -> dict[str, Any]:
        rows, more = await self.repo.page(after=after, limit=limit)
        return batch_list(rows, more)

    async def cancel(self, batch_id: str) -> tuple[dict[str, Any], bool]:
        """Returns the batch and whether this call started the cancellation (then the caller tells the
        runner after the commit)."""
        row = await self.repo.get(batch_id, for_update=True)
        if row is None:
            raise BatchNotFound(batch_id)
        if row.status in ("cancelling", "cancelled"):
            return batch_object(row), False
        if row.status not in CANCELLABLE:
            raise InvalidRequestError(f"Cannot cancel a batch with status '{row.status}'.",
                                      param="batch_id", code="invalid_state")
        row.status = "cancelling"
        row.cancelling_at = datetime.now(UTC)
        await self.repo.session.flush()
        return batch_object(row), True
