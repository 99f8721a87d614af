"""``AdmissionPolicy``: what the generation service asks of admission, whichever tier it runs for.

Two implementations: ``AdmissionController`` (interactive: RPM, TPM, concurrency leases, monthly budget,
one Redis script) and ``gateway.batches.runtime.BatchAdmission`` (batch lines: the tenant's batch
tokens-per-day quota and budget; a line that does not fit is deferred, never failed). The generation
service (``gateway.generation``) calls only these four methods, so it never asks which one it has.

- ``admit`` reserves ``reserved_tokens`` (and the estimated cost) or raises a ``GatewayError``.
- ``settle`` reconciles an admission that produced no usage record (nothing reached an engine).
- ``settle_and_append`` reconciles it with the tokens really used and appends the usage record to the
  billing outbox; it never raises, it returns the errors of the two parts (None: done).
- ``renew_lease`` keeps a long request's lease alive (a no-op where there is none).
"""

from __future__ import annotations

from typing import Protocol

from billing.outbox import UsageRecord
from gateway.admission.limits import Admission, TenantLimits


class AdmissionPolicy(Protocol):
    async def admit(self, limits: TenantLimits, request_id: str, reserved_tokens: int,
                    estimated_cost_pico_usd: int) -> Admission: ...

    async def settle(self, admission: Admission, used_tokens: int, cost_pico_usd: int) -> None: ...

    async def settle_and_append(self, admission: Admission, used_tokens: int, cost_pico_usd: int,
                                record: UsageRecord) -> tuple[Exception | None, Exception | None]: ...

    async def renew_lease(self, admission: Admission) -> None: ...
