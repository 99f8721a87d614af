"""Tenants and their API keys: schemas, repository (every query), service (logic), key format."""
