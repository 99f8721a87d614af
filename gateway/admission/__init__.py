"""Admission control (``controller``: RPM, TPM token bucket, concurrency leases, monthly budget, tenant
status in one Redis script), the ``policy`` the generation service asks of any admission, and SLO-based
overload shedding (``shedding``)."""

from gateway.admission.controller import AdmissionController, AdmissionRejected
from gateway.admission.limits import Admission, TenantLimits, reservation_tokens
from gateway.admission.policy import AdmissionPolicy

__all__ = ["Admission", "AdmissionController", "AdmissionPolicy", "AdmissionRejected", "TenantLimits",
           "reservation_tokens"]
