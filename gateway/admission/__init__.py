"""Admission control (``controller``: RPM, TPM token bucket, concurrency leases, monthly budget, tenant
status in one Redis script) and SLO-based overload shedding (``shedding``)."""

from gateway.admission.controller import AdmissionController, AdmissionRejected
from gateway.admission.limits import Admission, TenantLimits, reservation_tokens

__all__ = ["Admission", "AdmissionController", "AdmissionRejected", "TenantLimits", "reservation_tokens"]
