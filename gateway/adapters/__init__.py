"""Tenants' LoRA adapters served as their own models (``ft:<base>:<tenant>:<name>:<id>``): see service.py."""
